"""The chart and the agent agree: the real ductile-agent runs with the chart's env.

The worker container's environment is taken from a rendered StatefulSet,
with only what the kubelet would fill in (the downward API fields) and the
etcd address replaced by a real etcd on 127.0.0.1 (this test runs under
with-etcd). The agent must accept every DUCTILE_* value the chart sets and
run a one-node job to completion; then the `helm test` pod's script, taken
from the rendered test pod, must pass for that job and fail for a job etcd
has never seen, and when etcd cannot be reached.
"""

import os
import socket
import subprocess

import pytest

AGENT = os.environ.get("DUCTILE_AGENT_BIN")
ETCD = os.environ.get("DUCTILE_TEST_ETCD")

# Run by hand without them, the tests skip; under ctest (DUCTILE_CTEST set)
# a missing one is a failure, never a silent skip.
pytestmark = pytest.mark.skipif(
    not (AGENT and ETCD) and not os.environ.get("DUCTILE_CTEST"),
    reason="needs DUCTILE_AGENT_BIN and a with-etcd etcd (ctest sets both)")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pod_env(container, overrides):
    """The container's env as the kubelet would set it, plus overrides."""
    env = {"PATH": os.path.dirname(AGENT) + os.pathsep + os.environ["PATH"]}
    for k in ("ASAN_OPTIONS", "UBSAN_OPTIONS", "LSAN_OPTIONS"):
        if k in os.environ:
            env[k] = os.environ[k]
    fields = {"metadata.name": "demo-ductile-worker-0", "metadata.namespace": "ml",
              "status.podIP": "127.0.0.1"}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "fieldRef" in e.get("valueFrom", {}):
            env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            pytest.fail(f"env {e['name']} comes from {e['valueFrom']}: not set up here")
    env.update(overrides)
    return env


def run(args, env, timeout=60):
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def job(render):
    """Renders a one-node CPU job and runs its agent (worker: `true`) to the end."""
    assert AGENT and ETCD, "DUCTILE_AGENT_BIN or DUCTILE_TEST_ETCD not set"
    r = render({"job": {"name": "contract", "command": ["true"], "lastCall": 1}})
    container = r.agent()
    env = pod_env(container, {"DUCTILE_RDZV_ENDPOINT": ETCD,
                              "DUCTILE_HTTP_PORT": str(free_port())})
    assert env["DUCTILE_NODE_ADDR"] == "127.0.0.1"  # from status.podIP
    proc = run(container["command"] + container["args"], env)
    return r, proc


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
    assert "job contract: done" in proc.stdout


def test_helm_test_pod_fails_for_an_unknown_job(render, job):
    cmd, env = helm_test_script(render({"job": {"name": "never-started"}}))
    proc = run(cmd, env)
    assert proc.returncode != 0
    assert "no job never-started in etcd" in proc.stderr


def test_helm_test_pod_fails_without_etcd(job):
    r, _ = job
    cmd, env = helm_test_script(r)
    env["DUCTILE_RDZV_ENDPOINT"] = f"http://127.0.0.1:{free_port()}"
    proc = run(cmd, env)
    assert proc.returncode != 0
