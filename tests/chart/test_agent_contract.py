"""The chart and the agent agree: the real ductile-agent runs with the chart's env.

The worker container's environment is taken from the rendered workload,
with only what the kubelet and the Job controller would fill in (the
downward API fields, JOB_COMPLETION_INDEX) and the etcd address replaced by
a real etcd on 127.0.0.1 (this test runs under with-etcd).

- One node: the agent accepts every DUCTILE_* value the chart sets and runs
  a one-node job to completion; the `helm test` pod's script, taken from
  the rendered test pod, passes for that job and fails for a job etcd has
  never seen, and when etcd cannot be reached.
- The pre-install check (an existing etcd): its script, taken from the
  rendered hook Job, refuses an ended job in one line naming job.startOver,
  passes a new one, and with job.startOver deletes the old job so that the
  id trains again.
- The install id: a job ended by one install (one render: its own id) is
  refused by the next one's agent (exit 2, FailJob), still done for the
  same install's, and trained again with job.startOver.
- The chart's own etcd over TLS: the certificates the chart makes serve a
  real etcd with the rendered flags, and the agent and the `helm test`
  script use them; with auth: the agent starts first and waits while the
  post-install hook's etcdctl steps turn auth on with the chart's password.

The Indexed Job's tests, with the Job controller played, are in
test_indexed_job.py; both share agentpod.py.
"""

import os
import subprocess
import time

import pytest

from agentpod import (AGENT, DEADLINE, ETCD, NEEDS_AGENT, configmaps_of, pod_env, run,
                      run_one_node_job, wait_until)
from jobsim import pod_failure_action
from testlib import free_port

pytestmark = NEEDS_AGENT


@pytest.fixture(scope="module")
def job(render):
    return run_one_node_job(render, "contract")


def test_agent_accepts_chart_env_and_completes_job(job):
    _, proc = job
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "demo-ductile-worker-0" in proc.stdout + proc.stderr  # DUCTILE_NODE_ID was used


def helm_test_script(rendered):
    pod = rendered.one("Pod", "-test-rendezvous")
    container = pod["spec"]["containers"][0]
    return container["command"], pod_env(container, {"DUCTILE_RDZV_ENDPOINT": ETCD})


def test_helm_test_pod_passes_for_the_job(job):
    r, _ = job
    cmd, env = helm_test_script(r)
    proc = run(cmd, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "job ml-contract: done" in proc.stdout


def test_helm_test_pod_fails_for_an_unknown_job(render, job):
    cmd, env = helm_test_script(render({"job": {"name": "never-started"}}))
    proc = run(cmd, env)
    assert proc.returncode != 0
    assert "no job ml-never-started in etcd" in proc.stderr


def test_helm_test_pod_fails_without_etcd(job):
    r, _ = job
    cmd, env = helm_test_script(r)
    env["DUCTILE_RDZV_ENDPOINT"] = f"http://127.0.0.1:{free_port()}"
    proc = run(cmd, env)
    assert proc.returncode != 0


# ---- the pre-install check (an existing etcd) ----

EXTERNAL = {"etcd": {"enabled": False, "external": {"endpoints": ["http://127.0.0.1:2379"]}}}


def check_hook(render, name, start_over=False):
    r = render({**EXTERNAL, "job": {"name": name, "startOver": start_over}})
    job = r.one("Job", "-check")
    container = job["spec"]["template"]["spec"]["containers"][0]
    return run(container["command"], pod_env(container, {"DUCTILE_RDZV_ENDPOINT": ETCD}))


def test_check_refuses_an_ended_job_in_one_line(render, job):
    proc = check_hook(render, "contract")
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "job ml-contract has ended (done)" in lines[0]
    assert "set job.startOver=true" in lines[0]


def test_check_passes_a_new_job(render, job):
    proc = check_hook(render, "contract-new")
    assert proc.returncode == 0, proc.stderr
    assert "job ml-contract-new: not ended" in proc.stdout


def test_check_fails_without_etcd(render, job):
    r = render({**EXTERNAL, "job": {"name": "contract"}})
    container = r.one("Job", "-check")["spec"]["template"]["spec"]["containers"][0]
    env = pod_env(container, {"DUCTILE_RDZV_ENDPOINT": f"http://127.0.0.1:{free_port()}"})
    assert run(container["command"], env).returncode != 0


def test_start_over_deletes_the_ended_job_and_it_trains_again(render):
    _, proc = run_one_node_job(render, "contract-over")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert check_hook(render, "contract-over").returncode != 0
    proc = check_hook(render, "contract-over", start_over=True)
    assert proc.returncode == 0, proc.stderr
    assert "job ml-contract-over: " in proc.stdout and "key(s) deleted" in proc.stdout
    assert check_hook(render, "contract-over").returncode == 0
    # The same id trains again, from round 1.
    _, proc = run_one_node_job(render, "contract-over")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "round 1 frozen" in proc.stdout + proc.stderr



def install_id(rendered):
    return rendered.one("ConfigMap", "-install")["data"]["id"]


def test_an_earlier_install_is_refused_and_start_over_trains_again(render):
    """The chart's etcd kept across installs: each render is an install
    with its own id (no lookup offline). A job ended by one install is
    refused by the next (exit 2, FailJob, one line naming both ids), still
    done for a pod of the same install, and trained again with
    job.startOver."""
    first, proc = run_one_node_job(render, "contract-install")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    again = render({"job": {"name": "contract-install", "command": ["true"], "lastCall": 1}})
    a, b = install_id(first), install_id(again)
    assert a != b
    _, proc = run_one_node_job(render, "contract-install", rendered=again)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert pod_failure_action(again.workers(), 2) == "FailJob"
    why = [line for line in (proc.stdout + proc.stderr).splitlines() if "earlier install" in line]
    assert len(why) == 1 and f"(install {a}); this is install {b}: set job.startOver=true" in why[0]
    assert "round 1 frozen" not in proc.stdout + proc.stderr
    # A pod of the first install (replaced after the end) finds it done.
    _, proc = run_one_node_job(render, "contract-install", rendered=first)
    assert proc.returncode == 0 and "already complete" in proc.stdout + proc.stderr, proc.stderr
    # job.startOver: the new install's agent deletes the old job and trains.
    over, proc = run_one_node_job(render, "contract-install", startOver=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "starts over" in out and "round 1 frozen" in out, out
    _, proc = run_one_node_job(render, "contract-install", rendered=again)
    assert proc.returncode == 2 and f"(install {install_id(over)})" in proc.stdout + proc.stderr


# ---- the chart's own etcd over TLS, with the certificates the chart makes ----


def start_etcd(workdir, scheme, flags):
    """A one-member etcd of its own (data and log in workdir), as the chart
    would start it: (process, client URL)."""
    client = f"{scheme}://127.0.0.1:{free_port()}"
    peer = f"{scheme}://127.0.0.1:{free_port()}"
    with open(workdir / "etcd.log", "w") as log:
        proc = subprocess.Popen(
            ["etcd", "--name", "e", "--data-dir", str(workdir / "data"),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"e={peer}", "--initial-cluster-state", "new"] + flags,
            stdout=log, stderr=log)
    return proc, client


def test_generated_tls_certificates_work_for_etcd_and_agent(render, tmp_path):
    """The chart's generated CA and certificate, written out as the Secret's
    volume would hold them, serve a real etcd with the rendered TLS flags
    (clients and peers must show a certificate the CA signed); the agent
    with the chart's env completes a job over it, and a client without the
    certificate is refused."""
    r = render({"job": {"name": "contract-tls", "command": ["true"], "lastCall": 1},
                "etcd": {"tls": {"enabled": True}}})
    import base64
    secret = r.one("Secret", "-etcd-tls")
    for k, v in secret["data"].items():
        (tmp_path / k).write_bytes(base64.b64decode(v))
        (tmp_path / k).chmod(0o600)
    args = r.one("StatefulSet", "-etcd")["spec"]["template"]["spec"]["containers"][0]["args"]
    tls_flags = [a.replace("/etc/etcd/tls", str(tmp_path)) for a in args
                 if a.split("=")[0] in ("--cert-file", "--key-file", "--trusted-ca-file",
                                        "--client-cert-auth", "--peer-cert-file",
                                        "--peer-key-file", "--peer-trusted-ca-file",
                                        "--peer-client-cert-auth")]
    assert len(tls_flags) == 8, args
    etcd, client = start_etcd(tmp_path, "https", tls_flags)
    try:
        container = r.agent()
        env = pod_env(container, {"DUCTILE_RDZV_ENDPOINT": client,
                                  "DUCTILE_HTTP_PORT": str(free_port())},
                      configmaps=configmaps_of(r))
        for k in ("DUCTILE_ETCD_CACERT", "DUCTILE_ETCD_CERT", "DUCTILE_ETCD_KEY"):
            assert env[k].startswith("/etc/ductile/etcd-tls/"), env[k]
            env[k] = env[k].replace("/etc/ductile/etcd-tls", str(tmp_path))
        assert r.env()["DUCTILE_RDZV_ENDPOINT"].startswith("https://")

        def status(e):
            return run([AGENT, "status", "--rdzv-id", "ml-contract-tls"], e)
        wait_until(lambda: status(env).returncode == 0, "etcd over TLS to answer")
        proc = run(container["command"] + container["args"], env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "job ml-contract-tls: done" in status(env).stdout
        # Without a client certificate etcd refuses the connection.
        bare = {k: v for k, v in env.items() if k not in ("DUCTILE_ETCD_CERT", "DUCTILE_ETCD_KEY")}
        assert status(bare).returncode == 1
        # The `helm test` pod's script reads it with the same settings.
        pod = r.one("Pod", "-test-rendezvous")["spec"]["containers"][0]
        tenv = pod_env(pod, {"DUCTILE_RDZV_ENDPOINT": client})
        for k in ("DUCTILE_ETCD_CACERT", "DUCTILE_ETCD_CERT", "DUCTILE_ETCD_KEY"):
            tenv[k] = tenv[k].replace("/etc/ductile/etcd-tls", str(tmp_path))
        proc = run(pod["command"], tenv)
        assert proc.returncode == 0 and "job ml-contract-tls: done" in proc.stdout, proc.stderr
    finally:
        etcd.kill()
        etcd.wait()


# ---- the chart's own etcd with auth: the post-install hook turns it on ----


def test_etcd_auth_hook_and_agents(render, tmp_path):
    """A real etcd started as the chart starts it (no auth yet); the agent
    with the chart's env starts first and waits; the post-install hook's
    etcdctl steps, run as the kubelet would run them, add root with the
    chart's password and turn auth on; the job completes, and etcd now
    refuses a client without the password."""
    import base64
    import re
    import shutil
    if not shutil.which("etcdctl"):
        pytest.fail("etcdctl (Debian's etcd-client) is needed")
    r = render({"job": {"name": "contract-auth", "command": ["true"], "lastCall": 1},
                "etcd": {"auth": {"enabled": True}}})
    secret = r.one("Secret", "-etcd-auth")
    password = base64.b64decode(secret["data"]["password"]).decode()
    assert len(password) == 32
    secrets = {(secret["metadata"]["name"], "password"): password}
    etcd, client = start_etcd(tmp_path, "http", [])
    agent = None
    try:
        container = r.agent()
        env = pod_env(container, {"DUCTILE_RDZV_ENDPOINT": client,
                                  "DUCTILE_HTTP_PORT": str(free_port())}, secrets=secrets,
                      configmaps=configmaps_of(r))
        assert env["DUCTILE_ETCD_USER"] == "root" and env["DUCTILE_ETCD_PASSWORD"] == password
        bare = {k: v for k, v in env.items() if not k.startswith("DUCTILE_ETCD_")}
        wait_until(lambda: run([AGENT, "status", "--rdzv-id", "x"], bare).returncode == 0,
                   "etcd to answer")
        with open(tmp_path / "agent.log", "w") as log:
            agent = subprocess.Popen(container["command"] + container["args"], env=env,
                                     stdout=log, stderr=subprocess.STDOUT)
        time.sleep(1)
        hook = r.one("Job", "-etcd-auth")
        assert hook["metadata"]["annotations"]["helm.sh/hook"] == "post-install"
        spec = hook["spec"]["template"]["spec"]
        for c in spec["initContainers"] + spec["containers"]:
            cenv = pod_env(c, {"ETCDCTL_ENDPOINTS": client}, secrets=secrets)
            args = [re.sub(r"\$\((\w+)\)", lambda m: cenv[m.group(1)], a) for a in c["args"]]
            proc = run(["etcdctl"] + args, dict(cenv, PATH=os.environ["PATH"]))
            assert proc.returncode == 0, (c["name"], proc.stdout, proc.stderr)
        assert agent.wait(DEADLINE) == 0, (tmp_path / "agent.log").read_text()
        proc = run([AGENT, "status", "--rdzv-id", "ml-contract-auth"], env)
        assert "job ml-contract-auth: done" in proc.stdout, proc.stderr
        # Without the password etcd refuses; with a wrong one too.
        assert run([AGENT, "status", "--rdzv-id", "ml-contract-auth"], bare).returncode == 1
        wrong = dict(env, DUCTILE_ETCD_PASSWORD="wrong")
        assert run([AGENT, "status", "--rdzv-id", "ml-contract-auth"], wrong).returncode == 1
    finally:
        if agent and agent.poll() is None:
            agent.kill()
            agent.wait()
        etcd.kill()
        etcd.wait()
