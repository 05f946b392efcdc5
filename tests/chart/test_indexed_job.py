"""The Indexed Job with real agents: the chart's podFailurePolicy, played out.

The test plays the Job controller's part (jobsim.py) with the rendered Job
and real agents, their workers the agents' test worker
(tests/agent/test_worker.c). Pods for indices 0..3; one is killed and
recreated with the same index; the Job is scaled to 2 (indices 2 and 3 get
SIGTERM); the training ends. Every agent's exit code, judged by the rendered
podFailurePolicy, must be what the chart expects, and the Job must end
Complete. A pod deleted while training does not complete its index (its
agent exits 5): it is replaced, uncounted, and the job ends Complete. Exits
2 and 3 must end the Job Failed at once. And why node ids are pod names: an
index-only id is refused while a killed pod's lease lasts. Waiting for
capacity (a pod left Pending) is never counted.

Shared with test_agent_contract.py: agentpod.py.
"""

import os
import random
import signal
import string
import subprocess

import pytest

from agentpod import (AGENT, ETCD, NEEDS_AGENT, WORKER, configmaps_of, live_nodes, pod_env,
                      wait_until)
from jobsim import IndexedJob, exit_code_of, pod_failure_action
from testlib import free_port, pid_alive

pytestmark = NEEDS_AGENT


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
