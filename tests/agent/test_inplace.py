"""test_inplace.py: --rebuild inplace, workers kept across rounds.

The kept workers hear the round's end (graceful or lost) and the next round
on their control channel; a reported failure counts and keeps them; a
worker that did not say `hello 1 inplace` is restarted instead.
"""
import re
import signal
from agentkit import FAST, job_restarts, workers_of
from testlib import check, pid_alive, wait_for



def case_inplace(job):
    job.flags += FAST + ["--nnodes", "2:3", "--rebuild", "inplace", "--max-restarts", "3"]
    a, b, c = (job.start(n) for n in ("node-a", "node-b", "node-c"))
    r1 = job.wait_round(3, 60)
    keep = {w["_pid"] for w in workers_of(job, a) + workers_of(job, b)}
    wait_for(lambda: all(any(l.startswith("round %d " % r1) for l in job.worker_log(p))
                         for p in keep), 10, "round on the control channel")
    c.proc.kill()

    def next_round():
        logs = [job.worker_log(p) for p in keep]
        rounds = []
        for lg in logs:
            rr = [l for l in lg if l.startswith("round ") and int(l.split()[1]) > r1]
            if not rr:
                return None
            rounds.append(rr[-1])
        return rounds
    rounds = wait_for(next_round, 40, "a new round sent to the kept workers")
    for p in keep:
        check(pid_alive(p), "worker %d kept alive across the change" % p)
        check(any(l == "abort %d lost" % r1 for l in job.worker_log(p)),
              "abort sent, a member lost: %r" % job.worker_log(p))
    for line in rounds:
        check(" world 2 " in line and "group " in line and "/2 " in line,
              "new round has world size 2: %r" % line)
    ranks = sorted(int(l.split()[3]) for l in rounds)
    check(ranks == [0, 1], "ranks 0 and 1 in the new round: %r" % rounds)
    check(a.alive() and b.alive(), "agents alive")
    # A worker reports a failed collective on its channel: the round ends as a
    # failure (one restart), and the workers are still kept.
    r2 = max(int(l.split()[1]) for l in rounds)
    aw = workers_of(job, a)[0]["_pid"]
    job.command(aw, "fail allreduce: peer gone")

    def third_round():
        lines = [[l for l in job.worker_log(p) if l.startswith("round ") and
                  int(l.split()[1]) > r2] for p in keep]
        return lines if all(lines) else None
    lines = wait_for(third_round, 40, "a round after the reported failure")
    for p in keep:
        check(pid_alive(p), "worker %d kept after a reported failure" % p)
    check(all(" restarts 1 " in ls[-1] for ls in lines), "the failure counted: %r" % lines)
    check(re.search(r"round \d+ ended: failure on node-a: worker rank \d+ reported: allreduce",
                    b.log()), "b logs why")
    # Stop: workers get the control message, agents exit 0.
    a.signal(signal.SIGTERM)
    check(a.wait_exit(15) == 0, "a exits 0")
    check(any("stop" in job.worker_log(p) for p in keep), "stop on the control channel")


def case_abort_kinds(job):
    """In place: a node waiting with room ends the round gracefully (the step in
    flight finishes), a lost member does not."""
    job.flags += FAST + ["--nnodes", "2:3", "--rebuild", "inplace", "--max-restarts", "0"]
    a, b = job.start("node-a"), job.start("node-b")
    r1 = job.wait_round(2, 60)
    keep = {w["_pid"] for w in workers_of(job, a) + workers_of(job, b)}
    c = job.start("node-c")
    wait_for(lambda: all("abort %d graceful" % r1 in job.worker_log(p) for p in keep), 30,
             "graceful abort of round %d for a node waiting" % r1)

    def round_after(r):
        got = [[int(l.split()[1]) for l in job.worker_log(p) if l.startswith("round ")
                and int(l.split()[1]) > r] for p in keep]
        return max(min(g) for g in got) if all(got) else None
    r2 = wait_for(lambda: round_after(r1), 30, "round after the scale-up")
    c.proc.kill()
    wait_for(lambda: all("abort %d lost" % r2 in job.worker_log(p) for p in keep), 30,
             "lost abort of round %d after a SIGKILL" % r2)
    check(all(pid_alive(p) for p in keep), "workers kept")


def ctl_round(job, node_agent):
    """(round, world, pid) of the newest `round` line node_agent's one live
    worker read on its control channel, or None."""
    ws = workers_of(job, node_agent)
    if len(ws) != 1:
        return None
    lines = [l.split() for l in job.worker_log(ws[0]["_pid"]) if l.startswith("round ")]
    return (int(lines[-1][1]), int(lines[-1][5]), ws[0]["_pid"]) if lines else None


def same_round(job, agents, world, newer_than=0):
    """The round every one of agents' workers was told on its channel, with
    `world` workers, or None."""
    got = [ctl_round(job, ag) for ag in agents]
    if any(g is None or g[1] != world for g in got) or len({g[0] for g in got}) != 1:
        return None
    return got[0][0] if got[0][0] > newer_than else None


def case_inplace_fallback(job):
    """--rebuild inplace keeps only the workers that said `hello 1 inplace`:
    node-a's is kept across a round's end; node-c's (no hello: a script that
    knows nothing of the protocol) and node-d's (hello of protocol version 2)
    are restarted instead, each agent saying why in one line, and the
    restart counts as restart mode's does: not at all for a lost member."""
    job.flags += FAST + ["--nnodes", "2:4", "--rebuild", "inplace", "--max-restarts", "0"]
    a, b = job.start("node-a"), job.start("node-b")
    c = job.start("node-c", env={"AGENT_TEST_HELLO": "none"})
    d = job.start("node-d", env={"AGENT_TEST_HELLO": "2"})
    nodes = (a, b, c, d)
    r1 = wait_for(lambda: same_round(job, nodes, 4), 60, "a round of all 4 nodes")
    old = {ag.node: ctl_round(job, ag)[2] for ag in nodes}
    # The agents have the hellos: node-a's and node-d's workers got the answer.
    for ag in (a, d):
        wait_for(lambda: "hello 1 inplace" in job.worker_log(old[ag.node]), 10,
                 "the agent's hello answer to %s's worker" % ag.node)
    check("speaks control protocol version 2, this agent version 1" in d.log(),
          "node-d names both versions:\n" + d.log())
    b.proc.kill()
    r2 = wait_for(lambda: same_round(job, (a, c, d), 3, newer_than=r1), 60,
                  "a round of node-a, node-c and node-d")
    now = {ag.node: ctl_round(job, ag)[2] for ag in (a, c, d)}
    check(now["node-a"] == old["node-a"] and pid_alive(old["node-a"]),
          "node-a's worker kept: %r, then %r" % (old, now))
    check("abort %d lost" % r1 in job.worker_log(old["node-a"]),
          "node-a's worker told round %d ended: %r" % (r1, job.worker_log(old["node-a"])))
    check(any(l.startswith("round %d " % r2) for l in job.worker_log(old["node-a"])),
          "node-a's worker told round %d" % r2)
    for ag in (c, d):
        check(now[ag.node] != old[ag.node] and not pid_alive(old[ag.node]),
              "%s's worker restarted: %r, then %r" % (ag.node, old, now))
    fallback = r"round %d: worker rank \d+ %s: restarting this node's workers instead of keeping them"
    lines = re.findall(fallback % (r1, r'did not say "hello 1 inplace" on its control channel '
                                       r'\(a script without the in-place helper\)'), c.log())
    check(len(lines) == 1, "node-c says once why it restarts:\n" + c.log())
    check(re.search(fallback % (r1, "speaks control protocol version 2, not 1"), d.log()),
          "node-d says why it restarts:\n" + d.log())
    check("restarting this node's workers" not in a.log(), "node-a keeps its workers:\n" + a.log())
    check(job_restarts(job) == 0, "no restart counted, got %s" % job_restarts(job))
    job.command("all", "exit 0")
    for ag in (a, c, d):
        check(ag.wait_exit(30) == 0, "agent %s exits 0 at the job's end:\n%s" % (ag.node, ag.log()))
