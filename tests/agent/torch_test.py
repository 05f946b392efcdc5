#!/usr/bin/env python3
"""torch_test.py: PyTorch scripts rebuilt in place by the ductile.torch helper.

Run under with-etcd, like agent_test.py (whose Job and Agent it uses):

    with-etcd -- python3 torch_test.py --agent ductile-agent --worker agent-test-worker \
        --torch-python PY CASE

Each case starts real agents running tests/agent/torch_elastic.py (torch,
gloo, the helper from python/ in this tree) with --rebuild inplace and
changes the membership: a pod killed, a node leaving, a node joining, a hot
spare taking a dead member's place. From the script's records it checks
that every sample of every epoch was trained exactly once across the
changes, that the parameters (and the optimizer's state) were bit-equal
on every rank after each rebuild, and that the survivors kept their
processes. Without torch the cases report themselves skipped.
"""
import collections
import os
import re
import signal
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "../harness"))
sys.path.insert(0, HERE)
import agent_test as at  # noqa: E402
from testlib import Skip, check, children, free_port  # noqa: E402
from testlib import wait_for  # noqa: E402

PYDIR = os.path.normpath(os.path.join(HERE, "../../python"))
EXAMPLES = os.path.normpath(os.path.join(HERE, "../../examples/pytorch"))
SCRIPT = os.path.join(HERE, "torch_elastic.py")
SAMPLES, BATCH, EPOCHS = 2400, 8, 2
FLAGS = at.FAST + ["--rebuild", "inplace", "--max-restarts", "0"]


def script_env(step_s="0.05"):
    return {"PYTHONPATH": PYDIR, "TORCH_TEST_STEP_S": step_s, "OMP_NUM_THREADS": "1"}


def start(job, node, py, flags=None, plain=False, step_s="0.05"):
    cmd = [py, SCRIPT, "--samples", str(SAMPLES), "--batch", str(BATCH), "--epochs", str(EPOCHS)]
    return job.start(node, flags=flags, env=script_env(step_s), cmd=cmd + (["--plain"] if plain
                                                                           else []))


def records(job):
    """{pid: [fields, ...]} of every script's log."""
    out = {}
    for name in os.listdir(job.dir):
        m = re.fullmatch(r"t\.(\d+)\.log", name)
        if m:
            with open(os.path.join(job.dir, name)) as f:
                out[int(m.group(1))] = [ln.split() for ln in f.read().splitlines() if ln]
    return out


def syncs(job):
    """[(round, start step, rank, world, hash, pid)] of every rebuild."""
    return [(int(r[1]), int(r[2]), int(r[3]), int(r[4]), r[5], pid)
            for pid, rs in records(job).items() for r in rs if r[0] == "sync"]


def fetched(job, rnd=None):
    """Steps fetched (in round rnd, or in all)."""
    return [r for rs in records(job).values() for r in rs
            if r[0] == "fetch" and (rnd is None or int(r[1]) == rnd)]


def synced_round(job, world, after=-1):
    """The newest round after `after` that all `world` ranks synced into."""
    by = collections.defaultdict(set)
    for rnd, _, rank, w, _, _ in syncs(job):
        if w == world and rnd > after:
            by[rnd].add(rank)
    full = [r for r, ranks in by.items() if len(ranks) == world]
    return max(full) if full else None


def wait_training(job, world, after=-1, steps=5, timeout=180):
    """The round (after `after`) in which `world` ranks synced and trained `steps` steps."""
    def pred():
        r = synced_round(job, world, after)
        return r if r is not None and len(fetched(job, r)) >= steps * world else None
    return wait_for(pred, timeout, "%d ranks training in a round after %d" % (world, after))


def pids_of(agent):
    return set(children(agent.proc.pid))


def check_accounting(job):
    """Every sample of every epoch trained exactly once. A step's records count
    unless a later round started at or before it (the agreement went back to
    before that step, so it was trained again)."""
    start = {}
    for rnd, step, _, _, _, _ in syncs(job):
        start[rnd] = step
    seen = collections.defaultdict(collections.Counter)
    counted = set()
    for r in fetched(job):
        rnd, step, epoch = int(r[1]), int(r[2]), int(r[4])
        if any(r2 > rnd and s < step for r2, s in start.items()):
            continue
        counted.add((rnd, step))
        seen[epoch].update(int(i) for i in r[5].split(",") if i)
    check(sorted(seen) == list(range(EPOCHS)), "epochs trained: %s" % sorted(seen))
    for e in range(EPOCHS):
        extra = {i: n for i, n in seen[e].items() if n != 1}
        missing = set(range(SAMPLES)) - set(seen[e])
        check(not extra and not missing,
              "epoch %d: every sample once; twice or more: %s; never: %s" %
              (e, sorted(extra)[:10], sorted(missing)[:10]))
    steps = collections.Counter(s for _, s in counted)
    check(all(n == 1 for n in steps.values()),
          "each step counted in one round: %s" % [s for s, n in steps.items() if n > 1])


def check_bit_equal(job):
    """After each rebuild every rank holds the same parameters and optimizer state."""
    by = collections.defaultdict(dict)
    for rnd, step, rank, world, h, _ in syncs(job):
        by[(rnd, world)][rank] = (h, step)
    check(len(by) >= 2, "more than one rebuild recorded: %s" % sorted(by))
    for (rnd, world), ranks in by.items():
        if len(ranks) < world:
            continue  # a round that ended during its rebuild
        check(len({h for h, _ in ranks.values()}) == 1 and len({s for _, s in ranks.values()}) == 1,
              "round %d: every rank's state is bit-equal: %s" % (rnd, ranks))


def check_kept(job, agent, pids, rnd):
    """The agent's workers are the same processes, and they synced into round rnd."""
    check(pids and pids_of(agent) == pids,
          "%s kept its worker processes: %s then %s" % (agent.node, pids, pids_of(agent)))
    for pid in pids:
        check(any(s[0] == rnd and s[5] == pid for s in syncs(job)),
              "worker %d rebuilt into round %d in its own process" % (pid, rnd))
    check(re.search(r"round %d: \d+ workers kept" % rnd, agent.log()),
          "%s logs its workers kept in round %d:\n%s" % (agent.node, rnd, agent.log()))


def finish(job, agents):
    for a in agents:
        check(a.wait_exit(300) == 0, "agent %s exits 0 when training ends:\n%s" % (a.node, a.log()))
    done = [r for rs in records(job).values() for r in rs if r[0] == "done"]
    check(done and all(int(d[1]) == int(done[0][1]) for d in done),
          "every rank ended at the same step: %s" % done)
    check(at.job_restarts(job) == 0, "no restart counted, got %s" % at.job_restarts(job))
    check_accounting(job)
    check_bit_equal(job)


def torch_python():
    py = at.torch_python()
    if not py:
        raise Skip("torch is not installed (make test-torch installs it)")
    return py


def case_torch_inplace_kill(job):
    """A pod killed (its agent and worker SIGKILLed): the survivors' scripts
    catch the failed collective, rebuild the group at world size 2 in the
    same processes and carry on from the newest state."""
    py = torch_python()
    job.flags += FLAGS + ["--nnodes", "2:3"]
    a, b, c = (start(job, n, py) for n in ("node-a", "node-b", "node-c"))
    r1 = wait_training(job, 3)
    kept = {x.node: pids_of(x) for x in (a, b)}
    victims = pids_of(c)
    c.proc.kill()
    for p in victims:
        os.kill(p, signal.SIGKILL)
    r2 = wait_training(job, 2, after=r1)
    for x in (a, b):
        check_kept(job, x, kept[x.node], r2)
    logs = a.log() + b.log()
    check(re.search(r"round %d ended: .*node-c" % r1, logs), "the cause names node-c:\n" + logs)
    finish(job, (a, b))


def case_torch_inplace_leave(job):
    """A node leaves cleanly (SIGTERM): its scripts end at a step boundary and
    exit 0; the others rebuild in place, no step lost. Two workers per node
    (world 6, then 4)."""
    py = torch_python()
    job.flags += FLAGS + ["--nnodes", "2:3", "--nproc-per-node", "2"]
    a, b, c = (start(job, n, py) for n in ("node-a", "node-b", "node-c"))
    r1 = wait_training(job, 6)
    kept = {x.node: pids_of(x) for x in (a, b)}
    check(all(len(p) == 2 for p in kept.values()), "two workers per node: %s" % kept)
    c.signal(signal.SIGTERM)
    check(c.wait_exit(60) == 0, "the leaving agent exits 0:\n" + c.log())
    r2 = wait_training(job, 4, after=r1)
    for x in (a, b):
        check_kept(job, x, kept[x.node], r2)
    stopped = [r for rs in records(job).values() for r in rs if r[0] == "stopped"]
    check(len(stopped) == 2, "the leaving node's scripts stopped at a boundary: %s" % stopped)
    # The vote: every rank ended round r1 at the same step, and r2 went on from it.
    starts = {s[1] for s in syncs(job) if s[0] == r2}
    check(len({r[1] for r in stopped}) == 1 and starts == {int(stopped[0][1])},
          "all stopped at one step, the next round started there: %s, %s" % (stopped, starts))
    check(re.search(r"round %d ended: .*node-c.* left" % r1, a.log()) or
          re.search(r"round %d ended: member node-c left" % r1, a.log()),
          "a clean leave, not a loss:\n" + a.log())
    finish(job, (a, b))


def case_torch_inplace_join(job):
    """A node joins: the round ends gracefully (every step in flight
    finishes), the two scripts rebuild with the newcomer in place, and the
    newcomer starts from their state, not its own."""
    py = torch_python()
    job.flags += FLAGS + ["--nnodes", "2:3"]
    a, b = (start(job, n, py) for n in ("node-a", "node-b"))
    r1 = wait_training(job, 2)
    kept = {x.node: pids_of(x) for x in (a, b)}
    c = start(job, "node-c", py)
    r2 = wait_training(job, 3, after=r1)
    for x in (a, b):
        check_kept(job, x, kept[x.node], r2)
    new = [s for s in syncs(job) if s[0] == r2 and s[5] in pids_of(c)]
    check(len(new) == 1 and new[0][1] > 0,
          "the newcomer took the survivors' state (step > 0): %s" % new)
    check(re.search(r"round %d ended: node node-c is waiting" % r1, a.log()),
          "a join ends the round gracefully:\n" + a.log())
    finish(job, (a, b, c))


def case_torch_inplace_spare(job):
    """A hot spare (the round is full: --nnodes 2:2) takes a killed member's
    place; the survivor keeps its process and the spare gets its state."""
    py = torch_python()
    job.flags += FLAGS + ["--nnodes", "2:2"]
    a, b = (start(job, n, py) for n in ("node-a", "node-b"))
    r1 = wait_training(job, 2)
    c = start(job, "node-c", py)
    wait_for(lambda: "waiting" in c.log() or "spare" in c.log(), 60, "node-c waits as a spare")
    check(not pids_of(c), "the spare runs no worker while the round is full")
    kept = pids_of(a)
    victims = pids_of(b)
    b.proc.kill()
    for p in victims:
        os.kill(p, signal.SIGKILL)
    r2 = wait_training(job, 2, after=r1)
    check_kept(job, a, kept, r2)
    new = [s for s in syncs(job) if s[0] == r2 and s[5] in pids_of(c)]
    check(len(new) == 1 and new[0][1] > 0, "the spare took the survivor's state: %s" % new)
    finish(job, (a, c))


def case_torch_inplace_fallback(job):
    """A script without the helper (no hello on the control channel) under
    --rebuild inplace: the agent restarts it instead of keeping it, and
    says so in one line; the job still finishes."""
    py = torch_python()
    job.flags += FLAGS + ["--nnodes", "1:2"]
    a, b = (start(job, n, py, plain=True, step_s="0.1") for n in ("node-a", "node-b"))
    wait_for(lambda: len([s for s in syncs(job) if s[3] == 2]) == 2, 180, "2 plain workers")
    before = pids_of(a)
    b.proc.kill()
    wait_for(lambda: any(s[3] == 1 for s in syncs(job)), 120, "the survivor restarted alone")
    check(not (pids_of(a) & before), "the survivor's script was restarted, not kept")
    check(re.search(r"did not say \"hello 1 inplace\".*restarting", a.log()),
          "the fallback is logged in one line:\n" + a.log())
    check(a.wait_exit(300) == 0, "the job finishes:\n" + a.log())
    check(at.job_restarts(job) == 0, "no restart counted")


def case_torch_helper_alone(job):
    """Outside the agent the helper says so in one line and trains as a plain
    script; a control protocol version mismatch is a one-line error naming
    both versions; the examples run outside the agent."""
    py = torch_python()
    env = dict(os.environ, AGENT_TEST_DIR=job.dir, **script_env("0"))
    env.pop("DUCTILE_CONTROL_FD", None)
    cmd = [py, SCRIPT, "--samples", "64", "--batch", "8", "--epochs", "1"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    check(r.returncode == 0, "runs alone: %s" % r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("ductile.torch:")]
    check(len(lines) == 1 and "no control channel" in lines[0], "one line says so: %s" % lines)
    check(any(rr[0] == "done" and rr[1] == "8" for rs in records(job).values() for rr in rs),
          "trained its 8 steps alone")
    # The agent's end of a control channel that speaks version 2.
    mine, theirs = socket.socketpair()
    env["DUCTILE_CONTROL_FD"] = str(theirs.fileno())
    env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    p = subprocess.Popen(cmd, env=env, pass_fds=[theirs.fileno()], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    theirs.close()
    mine.settimeout(120)
    f = mine.makefile("r")
    hello = f.readline().strip()
    check(hello == "hello 1 inplace", "the helper says hello first: %r" % hello)
    mine.sendall(b"hello 2 inplace\n")
    failed = f.readline().strip()
    out, err = p.communicate(timeout=120)
    check(p.returncode not in (0, None), "a version mismatch fails the worker")
    msg = [ln for ln in err.splitlines() if "version mismatch" in ln]
    check(len(msg) == 1 and "version 2" in msg[0] and "version 1" in msg[0],
          "one line names both versions: %s" % err)
    check(failed.startswith("failed ") and "version mismatch" in failed,
          "the agent is told: %r" % failed)
    mine.close()
    # restore(): back to the last commit (buffers a failed step's forward
    # changed, the user's fields); the sampler moves only at commit.
    snippet = """
import torch, torch.nn as nn, ductile.torch as dt
m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
st = dt.State(m, torch.optim.SGD(m.parameters(), lr=0.1), sampler=dt.ElasticSampler(10, 2),
              seen=[1])
for idx in st.sampler:
    m(torch.randn(len(idx), 4)); st.commit()
    break
mean, pos = m[1].running_mean.clone(), st.sampler.pos
m(torch.randn(8, 4) + 5)
st.seen.append(2)
assert not torch.equal(m[1].running_mean, mean)
st.restore()
assert torch.equal(m[1].running_mean, mean), (m[1].running_mean, mean)
assert st.seen == [1] and st.sampler.pos == pos == 2, (st.seen, st.sampler.pos)
print("restored")
"""
    r = subprocess.run([py, "-c", snippet], env=env, capture_output=True, text=True, timeout=300)
    check(r.returncode == 0 and "restored" in r.stdout, "restore(): %s" % r.stderr)
    # The examples, each alone on a slice of Fashion-MNIST.
    data = "/usr/share/datasets/fashion-mnist"
    if not os.path.isdir(data):
        raise Skip("no Fashion-MNIST at %s" % data)
    for ex in ("train.py", "train_elastic.py"):
        ck = os.path.join(job.dir, ex + ".pt")
        e = dict(env, RANK="0", WORLD_SIZE="1", MASTER_PORT=str(free_port()))
        e.pop("DUCTILE_CONTROL_FD")
        r = subprocess.run([py, os.path.join(EXAMPLES, ex), "--data", data, "--limit", "1024",
                            "--epochs", "1", "--checkpoint", ck], env=e, capture_output=True,
                           text=True, timeout=300)
        check(r.returncode == 0 and os.path.exists(ck), "%s trains alone: %s" % (ex, r.stderr))


if __name__ == "__main__":
    sys.exit(at.main(globals()))
