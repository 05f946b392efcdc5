"""test_takeover.py: one node id, two agents.

A restarted pod takes its dead incarnation's registration over and rejoins
at once; a twin of a live agent is refused; an agent taken over while
stopped (SIGSTOP) does not take its registration back when it wakes.
"""
import signal
import time
from agentkit import SENTINEL_OFF, etcd_value, finish_with, lease_alive, workers_of
from testlib import check, pid_alive



# A long TTL: a node id back in a round before it could have expired was taken over.
TAKEOVER = ["--lease-ttl", "30", "--last-call", "0.5", "--stop-grace", "2",
            "--shutdown-timeout", "8", "--join-timeout", "60", "--nnodes", "2:3",
            "--max-restarts", "0"]


def case_restart_rejoins(job):
    """A restarted pod rejoins at once: a new agent with the node id of a SIGKILLed
    one finds the old registration (its lease still alive), probes it (refused: dead),
    takes it over and revokes the old lease; the next round lists the node under the
    new lease, in its old rank, long before the old lease's TTL."""
    job.flags += TAKEOVER
    a, b = job.start("node-a", env=SENTINEL_OFF), job.start("node-b")
    r1 = job.wait_round(2, 60)
    rank_b = {int(w["GROUP_RANK"]) for w in workers_of(job, b)}
    reg, old = etcd_value(job, "nodes/node-b")
    check(reg and reg.get("inc") == 1 and reg.get("probe", 0) > 0, "registration %r" % reg)
    b.proc.kill()
    b.proc.wait()
    t0 = time.monotonic()
    check(lease_alive(old), "the old lease is still alive when the pod restarts")
    b2 = job.start("node-b")
    r2 = job.wait_round(2, 25, newer_than=r1)
    took = time.monotonic() - t0
    ws = job.round_workers(r2)
    check({int(w["TEST_PPID"]) for w in ws} == {a.proc.pid, b2.proc.pid},
          "the new round holds node-a and the new node-b")
    check({int(w["GROUP_RANK"]) for w in ws if int(w["TEST_PPID"]) == b2.proc.pid} == rank_b,
          "node-b keeps its rank")
    check(all(w["TORCHELASTIC_RESTART_COUNT"] == "0" for w in ws), "no restart counted")
    reg2, new = etcd_value(job, "nodes/node-b")
    check(new != old and reg2.get("inc") == 2, "registration taken over: %r" % reg2)
    rec, _ = etcd_value(job, "round")
    leases = [int(m["lease"]) for m in rec["members"] if m["node"] == "node-b"]
    check(rec["number"] == r2 and leases == [new], "round %d lists node-b once, under the new "
          "lease: %r" % (r2, rec))
    check(rec["cause"] == "member_lost" and "node-b restarted" in rec["reason"],
          "the round ended because node-b restarted: %r" % rec)
    check(not lease_alive(old), "the old lease was revoked by the takeover")
    check(took < 20, "back in a round after %.1f s; the old lease's TTL is 30 s" % took)
    check("took its place as incarnation 2" in b2.log(), "b2 logs the takeover:\n" + b2.log())
    finish_with(job, (a, b2))


def case_twin_refused(job):
    """A second agent with the node id of a live one is refused (exit 1, one line),
    and the live one keeps training: the round never changes and never lists the id
    twice."""
    job.flags += TAKEOVER
    a, b = job.start("node-a"), job.start("node-b")
    r1 = job.wait_round(2, 60)
    _, lease = etcd_value(job, "nodes/node-b")
    twin = job.start("node-b")
    check(twin.wait_exit(20) == 1, "the twin exits 1")
    last = twin.log().strip().splitlines()[-1]
    check("already registered" in last and "by a live agent" in last, "why: %r" % last)
    check(a.alive() and b.alive(), "the job's agents carry on")
    time.sleep(1)
    check(job.running_round(2) == r1, "round %d still runs" % r1)
    rec, _ = etcd_value(job, "round")
    check(rec["number"] == r1 and [m["node"] for m in rec["members"]].count("node-b") == 1,
          "the round record is unchanged: %r" % rec)
    check(etcd_value(job, "nodes/node-b")[1] == lease, "the registration is untouched")
    check(not [w for w in job.workers() if int(w["TEST_PPID"]) == twin.proc.pid],
          "the twin started no worker")
    finish_with(job, (a, b))


def case_taken_over_comes_back(job):
    """An agent that is stopped (SIGSTOP) cannot be told from a dead one: a new agent
    with its id gets no answer and is refused. One made to take over anyway (failpoint
    rdzv.probe=dead: the worst wrong verdict) trains in the next round; the old one,
    woken (SIGCONT), finds its registration taken and its lease revoked, does not take
    it back, stops its workers and exits 4, never in a round with the new one."""
    job.flags += TAKEOVER
    a, b = job.start("node-a"), job.start("node-b")
    r1 = job.wait_round(2, 60)
    b.signal(signal.SIGSTOP)
    try:
        unsure = job.start("node-b")
        check(unsure.wait_exit(20) == 1, "a twin that gets no answer exits 1")
        check("did not answer" in unsure.log(), "why: " + unsure.log())
        b2 = job.start("node-b", env={"DUCTILE_FAILPOINTS": "rdzv.probe=1:dead"})
        r2 = job.wait_round(2, 25, newer_than=r1)
        check({int(w["TEST_PPID"]) for w in job.round_workers(r2)} == {a.proc.pid, b2.proc.pid},
              "round %d holds node-a and the new node-b" % r2)
    finally:
        b.signal(signal.SIGCONT)
    check(b.wait_exit(30) == 4, "the old node-b exits 4 (dropped):\n" + b.log())
    check("registration taken over" in b.log() or "lease" in b.log(), "why:\n" + b.log())
    check("does not take it back" in b.log(),
          "the old node-b does not take its registration back:\n" + b.log())
    check(not [w for w in job.workers()
               if int(w["TEST_PPID"]) == b.proc.pid and int(w["DUCTILE_ROUND"]) > r1],
          "the old node-b started no worker after round %d" % r1)
    check(not [w for w in job.workers() if int(w["TEST_PPID"]) == b.proc.pid and
               pid_alive(w["_pid"])], "the old node-b's workers are gone")
    check(job.running_round(2) == r2 and a.alive() and b2.alive(),
          "round %d goes on with the new node-b" % r2)
    _, lease = etcd_value(job, "nodes/node-b")
    rec, _ = etcd_value(job, "round")
    check(rec["number"] == r2 and [int(m["lease"]) for m in rec["members"]
                                   if m["node"] == "node-b"] == [lease],
          "the registration and round %d stay the new node-b's: %r" % (r2, rec))
    finish_with(job, (a, b2))
