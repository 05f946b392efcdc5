"""test_torch.py: real PyTorch under the agent (skipped without torch).

An unmodified DDP script restarted at a smaller world after a pod is lost,
resuming from its checkpoint; torch's own @record error file.
"""
import os
import re
from agentkit import ETCD, job_restarts, torch_python
from testlib import Skip, check, wait_for



def case_torch_ddp(job):
    """An unmodified PyTorch DDP script (gloo, env://) under 2 agents in restart
    mode, with the default flags (no restart budget): it trains; SIGKILL one
    agent (its worker dies with it: a pod lost) and it restarts at world size
    1 and resumes from its own checkpoint. The survivor's agent finds the dead
    pod's agent gone, by its sentinel (the dead agent's connection closed) or
    by its script's exit on the lost gloo peer, whichever comes first, so the
    restart is a membership change: the count stays 0 and the job finishes."""
    py = torch_python()
    if not py:
        raise Skip("torch is not installed (make test-torch installs it)")
    job.flags += ["--nnodes", "1:2"]
    ckpt = os.path.join(job.dir, "ckpt")
    os.mkdir(ckpt)
    total = 150
    cmd = [py, os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_ddp.py"), ckpt,
           str(total)]
    a = job.start("node-a", cmd=cmd)
    b = job.start("node-b", cmd=cmd)
    progress = os.path.join(ckpt, "progress")

    def lines():
        try:
            with open(progress) as f:
                return [tuple(l.split()) for l in f.read().splitlines()]
        except FileNotFoundError:
            return []
    wait_for(lambda: any(int(s) >= 10 and w == "2" for s, w, _ in lines()), 120,
             "training at world size 2")
    b.proc.kill()
    wait_for(lambda: any(w == "1" for _, w, _ in lines()), 120, "training at world size 1")
    code = a.wait_exit(180)
    check(code == 0, "agent a exits 0 when the script completes (exit %d)" % code)
    ls = lines()
    two = [int(s) for s, w, _ in ls if w == "2"]
    one = [(int(s), r) for s, w, r in ls if w == "1"]
    check(two and one, "trained at world sizes 2 then 1")
    first_one = one[0][0]
    check(first_one > 1 and first_one <= max(two) + 1,
          "resumed from the checkpoint: first step at world 1 is %d, last at world 2 %d" %
          (first_one, max(two)))
    check(one[0][1] == "0", "TORCHELASTIC_RESTART_COUNT stayed 0: %r" % (one[0],))
    check(job_restarts(job) == 0, "no restart counted, got %s" % job_restarts(job))
    check("member node-b is gone" in a.log() or "the worker's exit was a lost peer" in a.log(),
          "node-b found gone:\n" + a.log())
    check(re.search(r"resumed at step \d+, world size 1", a.out()), "the script says it resumed")
    check(re.search(r"round \d+: started 1 workers, ranks 0\.\.0 \(1 from a warm interpreter: "
                    r"torch,torch\._dynamo preloaded\)", a.log()),
          "the restart adopted a warm interpreter with torch imported:\n" + a.log())
    with open(os.path.join(ckpt, "done")) as f:
        step, world, _ = f.read().split()
    check(int(step) == total and world == "1", "finished all %d steps at world size 1" % total)


def case_torch_record(job):
    """torch's own @record writes TORCHELASTIC_ERROR_FILE; the agent, run as
    torchrun with DUCTILE_PYTHON the Python with torch, shows its message."""
    py = torch_python()
    if not py:
        raise Skip("torch is not installed (make test-torch installs it)")
    script = os.path.join(job.dir, "record.py")
    with open(script, "w") as f:
        f.write("from torch.distributed.elastic.multiprocessing.errors import record\n"
                "@record\n"
                "def main():\n"
                "    raise ValueError('bad batch size 0\\nmore detail')\n"
                "main()\n")
    a = job.start_raw("node-a", ["--rdzv-endpoint", ETCD, "--rdzv-id", job.name,
                                 "--last-call", "0.2", script], env={"DUCTILE_PYTHON": py})
    code = a.wait_exit(120)
    check(code == 3, "the job failed: exit %d\n%s" % (code, a.log()))
    check("worker rank 0 exited with code 1: ValueError: bad batch size 0" in a.log(),
          "the message of torch's error file: %s" % a.log())
