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
- The Indexed Job: the test plays the Job controller's part (jobsim.py)
  with the rendered Job and real agents, their workers the agents' test
  worker (tests/agent/test_worker.c). Pods for indices 0..3; one is killed
  and recreated with the same index; the Job is scaled to 2 (indices 2 and
  3 get SIGTERM); the training ends. Every agent's exit code, judged by
  the rendered podFailurePolicy, must be what the chart expects, and the
  Job must end Complete. A pod deleted while training does not complete its
  index (its agent exits 5): it is replaced, uncounted, and the job ends
  Complete. Exits 2 and 3 must end the Job Failed at once. And
  why node ids are pod names: an index-only id is refused while a killed
  pod's lease lasts.
"""

import os
import random
import signal
import string
import subprocess
import time

import pytest

from jobsim import IndexedJob, exit_code_of, pod_failure_action
from testlib import free_port, pid_alive

AGENT = os.environ.get("DUCTILE_AGENT_BIN")
WORKER = os.environ.get("DUCTILE_TEST_WORKER")
ETCD = os.environ.get("DUCTILE_TEST_ETCD")

# Run by hand without them, the tests skip; under ctest (DUCTILE_CTEST set)
# a missing one is a failure, never a silent skip.
pytestmark = pytest.mark.skipif(
    not (AGENT and ETCD and WORKER) and not os.environ.get("DUCTILE_CTEST"),
    reason="needs DUCTILE_AGENT_BIN, DUCTILE_TEST_WORKER and a with-etcd etcd (ctest sets them)")

INDEX_ANNOTATION = "metadata.annotations['batch.kubernetes.io/job-completion-index']"

# Correctness bounds, not speed: each is far above what the step takes.
DEADLINE = 90


def pod_env(container, overrides, pod_name="demo-ductile-worker-0", index=None, secrets=None,
            configmaps=None):
    """The container's env as the kubelet would set it, plus overrides;
    secrets and configmaps (configmaps_of) map (name, key) to the value a
    secretKeyRef or configMapKeyRef reads."""
    env = {"PATH": os.path.dirname(AGENT) + os.pathsep + os.environ["PATH"]}
    for k in ("ASAN_OPTIONS", "UBSAN_OPTIONS", "LSAN_OPTIONS"):
        if k in os.environ:
            env[k] = os.environ[k]
    fields = {"metadata.name": pod_name, "metadata.namespace": "ml",
              "status.podIP": "127.0.0.1"}
    if index is not None:
        fields[INDEX_ANNOTATION] = str(index)
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "fieldRef" in e.get("valueFrom", {}):
            env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in e.get("valueFrom", {}) and secrets:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = secrets[(ref["name"], ref["key"])]
        elif "configMapKeyRef" in e.get("valueFrom", {}) and configmaps:
            ref = e["valueFrom"]["configMapKeyRef"]
            env[e["name"]] = configmaps[(ref["name"], ref["key"])]
        else:
            pytest.fail(f"env {e['name']} comes from {e['valueFrom']}: not set up here")
    if index is not None:
        # What the Job controller adds to every container of an Indexed Job.
        env["JOB_COMPLETION_INDEX"] = str(index)
    env.update(overrides)
    return env


def configmaps_of(rendered):
    """What the rendered ConfigMaps hold, by (name, key): the install id."""
    return {(cm["metadata"]["name"], k): v for cm in rendered.of_kind("ConfigMap")
            for k, v in (cm.get("data") or {}).items()}


def run(args, env, timeout=60):
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)


def wait_until(pred, what, tick=None, deadline=DEADLINE):
    """pred()'s first answer that is neither None nor False."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if tick:
            tick()
        got = pred()
        if got is not None and got is not False:
            return got
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


def live_nodes(job_id):
    """The node ids registered (alive) in job_id, from `ductile-agent status`."""
    proc = run([AGENT, "status", "--rdzv-endpoint", ETCD, "--rdzv-id", job_id],
               dict(os.environ))
    line = next((l for l in proc.stdout.splitlines() if l.startswith("live nodes")), None)
    return set(line.split(":", 1)[1].split()) if line else set()


def run_one_node_job(render, name, rendered=None, **job):
    """Renders a one-node CPU job (or takes `rendered`, one such render) and
    runs its agent (worker: `true`) to the end."""
    assert AGENT and ETCD, "DUCTILE_AGENT_BIN or DUCTILE_TEST_ETCD not set"
    r = rendered or render({"job": {"name": name, "command": ["true"], "lastCall": 1, **job}})
    container = r.agent()
    env = pod_env(container, {"DUCTILE_RDZV_ENDPOINT": ETCD,
                              "DUCTILE_HTTP_PORT": str(free_port())},
                  configmaps=configmaps_of(r))
    assert env["DUCTILE_NODE_ADDR"] == "127.0.0.1"  # from status.podIP
    proc = run(container["command"] + container["args"], env)
    return r, proc


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


# ---- the Indexed Job, with the Job controller played by jobsim ----


class Pod:
    """One pod of the Job: the rendered container's command and env, run
    as a process. Its name is the Job's, the index and a random suffix, as
    the Job controller names pods; it is the agent's node id."""

    def __init__(self, rendered, index, workdir):
        job_name = rendered.workers()["metadata"]["name"]
        suffix = "".join(random.choice(string.ascii_lowercase + string.digits) for _ in range(5))
        self.name = f"{job_name}-{index}-{suffix}"
        self.index = index
        self.conditions = ()
        container = rendered.agent()
        env = pod_env(container, {"DUCTILE_RDZV_ENDPOINT": ETCD,
                                  "DUCTILE_HTTP_PORT": str(free_port()),
                                  "AGENT_TEST_DIR": workdir},
                      pod_name=self.name, index=index, configmaps=configmaps_of(rendered))
        self.log_path = os.path.join(workdir, f"{self.name}.log")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(container["command"] + container["args"], env=env,
                                         stdout=log, stderr=subprocess.STDOUT)

    def poll(self):
        return self.proc.poll()

    def delete(self):
        """A graceful delete: SIGTERM (the kubelet's SIGKILL after the
        grace period is never needed here)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self):
        """The pod dies at once: an OOM kill, a crash."""
        self.proc.kill()

    def log(self):
        with open(self.log_path) as f:
            return f.read()


def workers(workdir):
    """Every test worker that has started, as a dict of its environment."""
    out = []
    for name in os.listdir(workdir):
        if name.startswith("w.") and name.endswith(".env"):
            with open(os.path.join(workdir, name)) as f:
                out.append(dict(line.rstrip("\n").split("=", 1) for line in f if "=" in line))
    return out


def running_round(workdir, pods, newer_than=0):
    """The newest round, after newer_than, in which exactly the live
    workers of `pods` run, one per pod, with world size len(pods); or None."""
    want = {p.proc.pid: p for p in pods}
    live = [w for w in workers(workdir) if pid_alive(int(w["TEST_PID"]))]
    for rnd in sorted({int(w["DUCTILE_ROUND"]) for w in live}, reverse=True):
        ws = [w for w in live if int(w["DUCTILE_ROUND"]) == rnd]
        if rnd > newer_than and sorted(int(w["TEST_PPID"]) for w in ws) == sorted(want) and \
                all(int(w["WORLD_SIZE"]) == len(pods) for w in ws):
            assert sorted(int(w["RANK"]) for w in ws) == list(range(len(pods)))
            return rnd
    return None


def job_values(name, replicas=4, **job):
    """A CPU job of the agents' test worker, with short timings (the
    agent's own flags) and no restart to spare: a pod loss must never be
    counted as a failure, or every agent exits 3."""
    values = {"job": {"name": name, "command": [WORKER], "minNodes": 2, "maxNodes": 4,
                      "lastCall": 1, "leaseTTL": 2, "maxRestarts": 0, "shutdownTimeout": 15,
                      "stopGrace": 2, "joinTimeout": 120},
              "workers": {"replicas": replicas}}
    values["job"].update(job)
    return values


@pytest.fixture
def workdir(tmp_path):
    return str(tmp_path)


@pytest.fixture
def cleanup():
    pods = []
    yield pods
    for p in pods:
        if p.poll() is None:
            p.kill()
            p.proc.wait()


def start_job(render, values, workdir, cleanup):
    r = render(values)
    job = r.workers()
    assert job["kind"] == "Job"

    def start_pod(index):
        pod = Pod(r, index, workdir)
        cleanup.append(pod)
        return pod

    return r, IndexedJob(job, start_pod)


def test_indexed_job_kill_scale_and_complete(render, workdir, cleanup):
    """Indices 0..3 train; index 1 is killed and recreated; scaled to 2;
    the training ends and the Job is Complete."""
    assert AGENT and ETCD and WORKER, "DUCTILE_AGENT_BIN, DUCTILE_TEST_WORKER or etcd not set"
    r, ctl = start_job(render, job_values("contract-job"), workdir, cleanup)
    assert ctl.completions == 4 and sorted(ctl.active) == [0, 1, 2, 3]
    for ix, pod in ctl.active.items():
        assert pod.name.startswith(f"demo-ductile-worker-{ix}-")

    pods = lambda: [ctl.active[i] for i in sorted(ctl.active)]  # noqa: E731
    r1 = wait_until(lambda: running_round(workdir, pods()), "a round of indices 0..3",
                    tick=ctl.sync)
    # The node ids are the pods' names, each with its index.
    assert live_nodes("ml-contract-job") == {p.name for p in pods()}

    # Index 1 dies at once (an OOM kill). A pod loss is a membership change
    # for the others; the Job controller counts the failure and recreates
    # the index with a new pod, which joins under its own name while the
    # dead pod's lease may still run.
    killed = ctl.active[1]
    killed.kill()
    wait_until(lambda: 1 in ctl.active and ctl.active[1] is not killed,
               "index 1 recreated", tick=ctl.sync)
    replacement = ctl.active[1]
    assert replacement.name != killed.name and replacement.index == 1
    r2 = wait_until(lambda: running_round(workdir, pods(), newer_than=r1),
                    "a round of indices 0..3 with the new pod of index 1", tick=ctl.sync)
    (dead,) = [f for f in ctl.finished if f.pod is killed]
    assert dead.exit_code == 137 and dead.action == "Count"
    assert ctl.failed == 1 and ctl.condition is None
    assert replacement.name in live_nodes("ml-contract-job")

    # Scale to 2: the pods of indices 2 and 3 get SIGTERM and leave cleanly.
    leaving = [ctl.active[2], ctl.active[3]]
    ctl.scale(2)
    wait_until(lambda: running_round(workdir, pods(), newer_than=r2), "a round of indices 0, 1",
               tick=ctl.sync)
    wait_until(lambda: all(p.poll() is not None for p in leaving), "indices 2, 3 to exit",
               tick=ctl.sync)
    for p in leaving:
        # they left a running job: 5 (the Job controller ignores how pods
        # of removed indices end)
        assert p.poll() == 5, p.log()
        (f,) = [f for f in ctl.finished if f.pod is p]
        assert f.action == "Removed"

    # The training ends: every worker exits 0, the agents mark the job done
    # in etcd and exit 0, and both indices are complete.
    with open(os.path.join(workdir, "cmd.all"), "w") as f:
        f.write("exit 0\n")
    wait_until(ctl.done, "the Job to finish", tick=ctl.sync)
    assert ctl.condition == "Complete", [(f.index, f.exit_code, f.action) for f in ctl.finished]
    last = [ctl.created[0][-1], ctl.created[1][-1]]
    for p in last:
        assert p.poll() == 0, p.log()
        assert "job complete" in p.log()
    # Every pod ended as the podFailurePolicy expects: one counted failure
    # (the kill), nothing that fails the Job, nothing left running.
    actions = sorted(f.action for f in ctl.finished)
    assert actions == ["Count", "Removed", "Removed", "Succeeded", "Succeeded"], actions
    assert ctl.failed <= ctl.backoff_limit
    assert all(p.poll() is not None for p in cleanup)


def test_a_deleted_pod_is_replaced(render, workdir, cleanup):
    """A pod deleted while the job trains (kubectl delete pod, an eviction,
    a preemption) gets SIGTERM; its agent leaves cleanly and exits 5
    (DUCTILE_LEAVE_EXIT_CODE, which the chart sets), so the Job does not
    count its index as complete: the podFailurePolicy ignores the exit and
    a new pod takes the index, joins, and the job ends Complete with every
    index's last pod exiting 0."""
    r, ctl = start_job(render, job_values("contract-delete", replicas=3), workdir, cleanup)
    pods = lambda: [ctl.active[i] for i in sorted(ctl.active)]  # noqa: E731
    r1 = wait_until(lambda: running_round(workdir, pods()), "a round of indices 0..2",
                    tick=ctl.sync)
    deleted = ctl.active[2]
    deleted.delete()
    wait_until(lambda: deleted.poll() is not None, "the deleted pod to exit", tick=ctl.sync)
    ctl.sync()
    assert exit_code_of(deleted.poll()) == 5, deleted.log()
    (f,) = [f for f in ctl.finished if f.pod is deleted]
    assert f.action == "Ignore" and 2 not in ctl.succeeded
    wait_until(lambda: 2 in ctl.active and ctl.active[2] is not deleted, "a new pod for index 2",
               tick=ctl.sync)
    wait_until(lambda: running_round(workdir, pods(), newer_than=r1),
               "a round of indices 0..2 with the new pod", tick=ctl.sync)
    with open(os.path.join(workdir, "cmd.all"), "w") as f:
        f.write("exit 0\n")
    wait_until(ctl.done, "the Job to finish", tick=ctl.sync)
    assert ctl.condition == "Complete"
    assert [len(ctl.created[i]) for i in range(3)] == [1, 1, 2]  # index 2 replaced once
    assert ctl.failed == 0


def test_restart_budget_spent_fails_the_job(render, workdir, cleanup):
    """A worker crash with job.maxRestarts 0: every agent exits 3, which
    the podFailurePolicy turns into a failed Job at once, uncounted."""
    r, ctl = start_job(render, job_values("contract-fail", replicas=2),
                       workdir, cleanup)
    wait_until(lambda: running_round(workdir, [ctl.active[0], ctl.active[1]]),
               "a round of indices 0, 1", tick=ctl.sync)
    with open(os.path.join(workdir, "cmd.all"), "w") as f:
        f.write("exit 1\n")
    wait_until(ctl.done, "the Job to finish", tick=ctl.sync)
    assert ctl.condition == "Failed" and ctl.reason == "PodFailurePolicy"
    assert ctl.failed == 0
    first = ctl.finished[0]
    assert first.exit_code == 3 and first.action == "FailJob", ctl.finished[0].pod.log()
    # No pod was recreated.
    assert all(len(pods) == 1 for pods in ctl.created.values())


def test_other_node_limits_fail_the_job(render, workdir, cleanup):
    """A pod whose node limits differ from the job's in etcd (a job
    installed again with other minNodes/maxNodes) exits 2: FailJob."""
    r, ctl = start_job(render, job_values("contract-limits", replicas=2),
                       workdir, cleanup)
    wait_until(lambda: running_round(workdir, [ctl.active[0], ctl.active[1]]),
               "a round of indices 0, 1", tick=ctl.sync)
    other = render(job_values("contract-limits", replicas=2, maxNodes=3))
    late = Pod(other, 1, workdir)
    cleanup.append(late)
    wait_until(lambda: late.poll(), "the pod with other limits to exit")
    code = exit_code_of(late.poll())
    assert code == 2, late.log()
    assert pod_failure_action(other.workers(), code) == "FailJob"


def test_index_only_node_ids_would_collide(render, workdir, cleanup):
    """Why the node id is the pod's name, not its index. An agent killed
    without SIGTERM keeps its registration until its lease ends. A
    replacement under the same id takes it over at once only when the dead
    agent's probe port is provably closed (the same address: a StatefulSet
    pod, a restarted container), as here; a Job's replacement pod comes
    with a new IP, the old one does not answer at all, and the replacement
    would be refused (exit 1, a counted failure) until the lease ends. The
    pod's name never collides."""
    r = render(job_values("contract-dup", leaseTTL=60))
    container = r.agent()
    node = "demo-ductile-worker-1"

    def env():
        return pod_env(container, {"DUCTILE_RDZV_ENDPOINT": ETCD,
                                   "DUCTILE_HTTP_PORT": str(free_port()),
                                   "AGENT_TEST_DIR": workdir, "DUCTILE_NODE_ID": node},
                       index=1, configmaps=configmaps_of(r))

    first = subprocess.Popen(container["command"] + container["args"], env=env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    second = None
    try:
        # Registered; it waits for a second node (minNodes 2).
        wait_until(lambda: node in live_nodes("ml-contract-dup") or first.poll(),
                   "the first agent to register")
        assert first.poll() is None
        first.kill()
        first.wait()
        err = os.path.join(workdir, "second.err")
        with open(err, "w") as f:
            second = subprocess.Popen(container["command"] + container["args"], env=env(),
                                      stdout=subprocess.DEVNULL, stderr=f)

        def took_over():
            with open(err) as f:
                text = f.read()
            if second.poll() is not None:
                pytest.fail("the replacement exited %d: %s" % (second.returncode, text))
            return "which is gone: took its place" in text
        wait_until(took_over, "the replacement to take the dead agent's registration over")
        assert node in live_nodes("ml-contract-dup")
        # Refused instead (an old address that does not answer), its exit
        # status would be counted by the Job: that is what the pod name avoids.
        assert pod_failure_action(r.workers(), 1) == "Count"
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


class PendingPod:
    """A pod the scheduler has not placed yet (no capacity, a gang not yet
    complete): it runs nothing, so it can neither fail nor succeed, until
    place() starts it."""

    def __init__(self, rendered, index, workdir, cleanup):
        self.args, self.cleanup = (rendered, index, workdir), cleanup
        self.index, self.conditions, self.pod = index, (), None

    def place(self):
        self.pod = Pod(*self.args)
        self.cleanup.append(self.pod)

    def __getattr__(self, name):  # name, proc, log, delete, kill: the running pod's
        if self.pod is None:
            raise AttributeError(f"pending pod has no {name}")
        return getattr(self.pod, name)

    def poll(self):
        return None if self.pod is None else self.pod.poll()

    def delete(self):
        if self.pod is not None:
            self.pod.delete()


def test_waiting_for_capacity_is_never_counted(render, workdir, cleanup):
    """Only part of a job is scheduled: index 1 stays Pending. Index 0's
    agent waits job.joinTimeout for a second node and exits 6, which the
    podFailurePolicy ignores: the Job replaces the pod, uncounted, as often
    as it takes, and the Pending pod counts towards nothing. Once index 1 is
    placed, the round forms and the Job completes with no failure counted."""
    # The join timeout outlasts the last call (1 s), so two pods can form a round.
    values = job_values("contract-wait", replicas=2, joinTimeout=4)
    values["workers"]["job"] = {"backoffLimit": 0}  # one counted failure would fail the Job
    r = render(values)
    pending = {}

    def start_pod(index):
        if index == 1 and not pending:
            pending[1] = PendingPod(r, 1, workdir, cleanup)
            return pending[1]
        pod = Pod(r, index, workdir)
        cleanup.append(pod)
        return pod

    ctl = IndexedJob(r.workers(), start_pod)
    assert ctl.backoff_limit == 0
    # Index 0 times out alone again and again; nothing is counted.
    wait_until(lambda: len([f for f in ctl.finished if f.index == 0]) >= 2,
               "index 0 to time out twice", tick=ctl.sync)
    for f in ctl.finished:
        assert (f.index, f.exit_code, f.action) == (0, 6, "Ignore"), f.pod.log()
        assert "exiting with code 6" in f.pod.log() and "too few nodes" in f.pod.log()
    assert ctl.failed == 0 and ctl.condition is None
    assert ctl.active[1] is pending[1] and len(ctl.created[1]) == 1
    # The scheduler places index 1: the next pod of index 0 meets it.
    pending[1].place()
    pods = lambda: [ctl.active[i] for i in sorted(ctl.active)]  # noqa: E731
    wait_until(lambda: len(ctl.active) == 2 and running_round(workdir, pods()),
               "a round of indices 0, 1", tick=ctl.sync)
    with open(os.path.join(workdir, "cmd.all"), "w") as f:
        f.write("exit 0\n")
    wait_until(ctl.done, "the Job to finish", tick=ctl.sync)
    assert ctl.condition == "Complete", [(f.index, f.exit_code, f.action) for f in ctl.finished]
    assert ctl.failed == 0


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
