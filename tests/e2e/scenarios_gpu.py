"""scenarios_gpu.py: the fault scenarios of the GPU path only (tests/e2e).

Run with --device cuda (on the host test runtime in make test): a sticky CUDA
error, a local NCCL failure once and on every call, two GPUs a node, one
visible GPU a worker, and the GPU path's accuracy beside the CPU's. The
failures are armed by failpoints in the first worker process only
(once_wrapper), so the worker its agent starts next runs clean.
"""
import re
from job import FAULT_EPOCHS, GPU_CPU_TOL, log, once_wrapper, restart_counts, tail, verify
from testlib import check


def sc_sticky_error(env, mode, ref):
    # One trainer's CUDA context gets a sticky error (a launch failure, as
    # an illegal address or an Xid would give): every later CUDA call
    # answers it, so the process exits and its agent starts a fresh one,
    # which takes the state from the survivors; one failure is counted.
    with env.job("sticky-" + mode, mode, max_restarts=3, epochs=FAULT_EPOCHS) as job:
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


def sc_local_nccl(env, mode, ref):
    # One trainer's NCCL call fails with ncclSystemError while every peer
    # is alive (memlock, /dev/shm, a pids limit): its own failure, counted
    # once; its peers' loss of it is not counted.
    with env.job("local-nccl-" + mode, mode, max_restarts=3, epochs=FAULT_EPOCHS) as job:
        job.start()
        job.start(worker_prefix=once_wrapper(job, "nccl", "gpurt.nccl.ncclAllReduce=40:async:system"))
        job.start()
        verify(job, ref)
        counts = restart_counts(job)
        check(counts and max(counts) == 1, "restarts recorded %s: want exactly one" % counts)


def sc_local_nccl_repeat(env, mode, ref):
    # A node whose every NCCL all-reduce fails locally spends the job's
    # restart budget and the job ends, failed, instead of rebuilding forever.
    with env.job("local-nccl-repeat-" + mode, mode, max_restarts=2) as job:
        job.start()
        job.start(worker_prefix=["env", "DUCTILE_FAILPOINTS=gpurt.nccl.ncclAllReduce=30+:async:system"])
        job.start()
        job.finish(240, expect_fail=tuple(job.agents))
        for a in job.agents.values():
            check(a.proc.returncode != 0, "agent %s exited 0 after the budget ran out" % a.name)
        check(any(re.search(r"restart limit (2 reached|reached \(3 > max_restarts 2\))", a.text())
                  for a in job.agents.values()),
              "no agent said the restart limit was reached")


def two_gpu_job(env, name, mode):
    """A job of nodes with two workers and two GPUs each."""
    return env.job(name + "-" + mode, mode, max_restarts=0, epochs=FAULT_EPOCHS,
                   agent_args=["--nproc-per-node", "2"],
                   agent_env={"DUCTILE_GPURT_DEVICES": "2"})


def sc_local_ranks(env, mode, ref):
    # Two workers a node, two GPUs a node: each local rank on its own device
    # (LOCAL_RANK), as on a real node; then a node lost and one joining.
    with two_gpu_job(env, "local-ranks", mode) as job:
        job.start()
        job.start()
        job.wait_step(10)
        log("SIGKILL agent n2; n3 joins")
        job.agents["n2"].kill_tree()
        job.start()
        verify(job, ref)


def sc_visible_one(env, mode, ref):
    # Each worker sees one GPU (CUDA_VISIBLE_DEVICES set per process, as a
    # device plugin or a launcher does): it uses device 0, whatever its
    # LOCAL_RANK, and the two are different GPUs, which NCCL accepts.
    pin = ["sh", "-c", 'export CUDA_VISIBLE_DEVICES="$LOCAL_RANK"; exec "$@"', "pin"]
    with two_gpu_job(env, "visible-one", mode) as job:
        job.start(worker_prefix=pin)
        job.start(worker_prefix=pin)
        verify(job, ref)


def sc_gpu_vs_cpu(env, mode, ref):
    # The same job, calm, on the GPU path and on the CPU: the final accuracy
    # agrees within GPU_CPU_TOL (the GPU's sums are not the CPU's bit for bit).
    accs = {}
    for device in ("cuda", "cpu"):
        with env.job("calm-" + device, mode, device=device, max_restarts=0,
                     epochs=FAULT_EPOCHS) as job:
            for _ in range(3):
                job.start()
            job.finish(300)
            accs[device] = job.accuracy()
    log("calm run, 3 nodes, seed %d: accuracy %.4f on the GPU path, %.4f on the CPU" %
        (env.seed, accs["cuda"], accs["cpu"]))
    check(abs(accs["cuda"] - accs["cpu"]) <= GPU_CPU_TOL,
          "GPU accuracy %.4f is more than %.1f points from the CPU's %.4f" %
          (accs["cuda"], GPU_CPU_TOL * 100, accs["cpu"]))
