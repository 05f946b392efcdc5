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

The reference run can be shared: `reference` runs it alone and writes it to
--reference-file F, and a later invocation given the same F reads it from
there instead of running it (make test runs it once, as a ctest fixture,
for the core's scenarios that run one per test). `--list SUITE` prints a
suite's cases, one a line (for tests/e2e/CMakeLists.txt).

The scenarios are in scenarios.py and scenarios_gpu.py, the job they run
and the checks in job.py; this file holds the suites and the driver.

usage: e2e.py --agent A --train T [--data DIR] [--seed S] [--chaos-seed S]
              [--device cpu|cuda] [--reference-file F]
              SCENARIO[:MODE]... | all | core | gpu | chaos
              | core-contended | gpu-contended | reference
       e2e.py --list SUITE...
Exit 0 when every scenario passes, 77 when all were skipped, else 1.
"""
import argparse
import collections
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from job import CHAOS_EPOCHS, EPOCHS, GPU_EPOCHS, TRAIN_N, Job, accounting, check, log
from testlib import Fail, Skip
import scenarios as sc
import scenarios_gpu as gp


SCENARIOS = collections.OrderedDict([
    ("worker_kill", (sc.sc_worker_kill, ("inplace", "restart"))),
    ("agent_kill", (sc.sc_agent_kill, ("inplace", "restart"))),
    ("scale_down", (sc.sc_scale_down, ("inplace", "restart"))),
    ("scale_up", (sc.sc_scale_up, ("inplace", "restart"))),
    ("hot_spare", (sc.sc_hot_spare, ("inplace", "restart"))),
    ("below_min", (sc.sc_below_min, ("inplace",))),
    ("etcd_restart", (sc.sc_etcd_restart, ("inplace",))),
    ("etcd_pause", (sc.sc_etcd_pause, ("inplace",))),
    ("netns", (sc.sc_netns, ("inplace",))),
    ("slow_node", (sc.sc_slow_node, ("inplace",))),
    ("disk_full", (sc.sc_disk_full, ("restart",))),
    ("duplicate_id", (sc.sc_duplicate_id, ("inplace",))),
    ("hung_worker", (sc.sc_hung_worker, ("inplace", "restart"))),
    ("stuck_step", (sc.sc_stuck_step, ("inplace", "restart"))),
    ("sticky_error", (gp.sc_sticky_error, ("inplace",))),
    ("local_nccl", (gp.sc_local_nccl, ("inplace",))),
    ("local_nccl_repeat", (gp.sc_local_nccl_repeat, ("inplace",))),
    ("gpu_vs_cpu", (gp.sc_gpu_vs_cpu, ("inplace",))),
    ("local_ranks", (gp.sc_local_ranks, ("inplace",))),
    ("visible_one", (gp.sc_visible_one, ("inplace",))),
])
CHAOS = collections.OrderedDict([("chaos", (sc.sc_chaos, ("inplace", "restart")))])
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
SUITES = {"core": CORE, "gpu": GPU_CORE, "core-contended": CORE_CONTENDED,
          "gpu-contended": GPU_CONTENDED}


class Env:
    def __init__(self, a):
        self.agent, self.train, self.data, self.seed = a.agent, a.train, a.data, a.seed
        self.device = a.device
        self.epochs = GPU_EPOCHS if a.device == "cuda" else EPOCHS
        self.workdir = tempfile.mkdtemp(prefix="ductile-e2e-")
        self.keep = bool(os.environ.get("KEEP"))
        self.chaos_seed = a.chaos_seed if a.chaos_seed is not None else random.randrange(1 << 30)
        self.ref_file = a.reference_file

    def job(self, name, mode, **kw):
        return Job(self, name, mode, **kw)

    def reference(self, epochs):
        """The accuracy of an uninterrupted run of `epochs`: the one the
        reference file holds for this seed, else run here (and kept there)."""
        key = "%d:%d" % (self.seed, epochs)
        refs = self.saved_refs() if self.ref_file else {}
        if key in refs:
            acc = refs[key]
            log("reference (3 agents, uninterrupted, from %s): accuracy %.4f" % (self.ref_file, acc))
            return acc
        acc = self.reference_run(epochs)
        if self.ref_file:
            refs[key] = acc
            tmp = "%s.%d.tmp" % (self.ref_file, os.getpid())  # one writer a file
            with open(tmp, "w") as f:
                json.dump(refs, f)
            os.replace(tmp, self.ref_file)
        return acc

    def saved_refs(self):
        """The reference file's accuracies, those that are one (a number in
        [0, 1]); none when it is absent or not JSON."""
        try:
            with open(self.ref_file) as f:
                refs = json.load(f)
        except (OSError, ValueError):
            return {}
        if not isinstance(refs, dict):
            return {}
        return {k: v for k, v in refs.items()
                if isinstance(v, float) and 0.0 <= v <= 1.0}

    def reference_run(self, epochs):
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


def expand(names, device):
    """The cases the command line names: suites expanded, SCENARIO[:MODE] kept."""
    cases = []
    for c in names:
        if c in SUITES:
            cases += SUITES[c]
        elif c == "all":
            cases += ["%s:%s" % (k, m) for k, (_, modes) in SCENARIOS.items() for m in modes
                      if k not in GPU_ONLY or device == "cuda"]
        else:
            cases.append(c)
    return cases


def run_one(env, fn, m, ref):
    """One scenario in one mode: (PASS|SKIP|FAIL, why), /dev/shm checked after."""
    shm_before = dev_shm()
    try:
        fn(env, m, ref)
        left = dev_shm_leaks(shm_before)
        check(not left, "left in /dev/shm: %s" % " ".join(left))
        return "PASS", ""
    except Skip as e:
        return "SKIP", str(e)
    except Fail as e:
        return "FAIL", str(e)


def run(env, cases):
    """The cases in order, each scenario in each of its modes: the results,
    or 2 for an unknown scenario. A reference run that fails raises Fail."""
    results = []
    table = dict(SCENARIOS, **CHAOS)
    refs = {}
    for c in cases:
        name, _, mode = c.partition(":")
        if name not in table:
            log("unknown scenario %s" % name)
            return 2
        epochs = CHAOS_EPOCHS if name in CHAOS else env.epochs
        if epochs not in refs:
            refs[epochs] = env.reference(epochs) if env.device == "cpu" else None
        fn, modes = table[name]
        for m in ([mode] if mode else modes):
            t = time.monotonic()
            results.append((c, m) + run_one(env, fn, m, refs[epochs]))
            log("%s %s: %s (%.0f s) %s" % (name, m, results[-1][2], time.monotonic() - t,
                                           results[-1][3]))
    return results


def main():
    signal.signal(signal.SIGTERM, on_term)
    if sys.argv[1:2] == ["--list"]:  # for tests/e2e/CMakeLists.txt: a suite's cases
        print("\n".join(expand(sys.argv[2:], "cpu")))
        return 0
    p = argparse.ArgumentParser()
    p.add_argument("--agent", required=True)
    p.add_argument("--train", required=True)
    p.add_argument("--data", default=os.environ.get("FASHION_MNIST",
                                                   "/usr/share/datasets/fashion-mnist"))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--chaos-seed", type=int)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--reference-file")
    p.add_argument("cases", nargs="+")
    a = p.parse_args()
    only_ref = a.cases == ["reference"]
    if only_ref and not a.reference_file:
        p.error("reference needs --reference-file")
    if only_ref and os.path.exists(a.reference_file):
        os.unlink(a.reference_file)  # run anew: the build's binaries may have changed
    env = Env(a)
    try:
        results = [] if only_ref else run(env, expand(a.cases, a.device))
        if only_ref:
            env.reference(env.epochs)
    except Fail as e:
        log("reference run failed: %s" % e)
        return 1
    finally:
        if not env.keep:
            shutil.rmtree(env.workdir, ignore_errors=True)
        else:
            log("kept", env.workdir)
    if results == 2:
        return 2
    for c, m, r, why in results:
        print("%-4s %-14s %-8s %s" % (r, c.partition(":")[0], m, why))
    if any(r == "FAIL" for _, _, r, _ in results):
        return 1
    if results and all(r == "SKIP" for _, _, r, _ in results):
        return 77
    return 0


if __name__ == "__main__":
    sys.exit(main())
