"""test_restarts.py: worker failures and how they are counted.

A crash or an exit code restarts the round and counts once (also when its
peers see it first, or when it comes while the agent stops the worker);
the budget spent fails the job; a worker that ignores SIGTERM is killed. A
failure report etcd cannot take, or that stalls, neither hangs the agent
nor lets it idle; nor does waiting for MASTER_PORT.
"""
import re
import signal
import time
from agentkit import FAST, crash_until, job_restarts, workers_of
from testlib import Fail, check, free_port, http_get, pid_alive, wait_for



def case_worker_crash(job):
    job.flags += FAST + ["--nnodes", "2", "--max-restarts", "3"]
    a, b = job.start("node-a"), job.start("node-b")
    r1 = job.wait_round(2, 60)
    r2 = crash_until(job, a, b, "segv", 2, r1)
    ws = job.round_workers(r2)
    check(all(w["TORCHELASTIC_RESTART_COUNT"] == "1" for w in ws), "restart count 1")
    r3 = crash_until(job, b, a, "exit 3", 2, r2)
    ws = job.round_workers(r3)
    check(all(w["TORCHELASTIC_RESTART_COUNT"] == "2" for w in ws), "restart count 2")
    check(re.search(r"worker rank \d+ was killed by SIG(SEGV|ABRT)", a.log()), "crash reason logged")
    check(re.search(r"worker rank \d+ exited with code 3", b.log()), "exit code logged")
    check(a.alive() and b.alive(), "agents carry on")


def case_restart_limit(job):
    job.flags += FAST + ["--nnodes", "2", "--max-restarts", "1"]
    a, b = job.start("node-a"), job.start("node-b")
    r1 = job.wait_round(2, 60)
    r2 = crash_until(job, a, b, "exit 5", 2, r1)
    w = workers_of(job, b)[0]
    job.command(w["_pid"], "abort")
    for ag in (a, b):
        code = ag.wait_exit(40)
        check(code != 0, "agent %s exit %d, want non-zero" % (ag.node, code))
        last = ag.log().strip().splitlines()[-1]
        check("job failed" in last and "exiting with code" in last,
              "one line with the reason: %r" % last)
    # A late agent sees the failed job and exits non-zero at once.
    c = job.start("node-c")
    check(c.wait_exit(15) != 0, "late agent on a failed job exits non-zero")
    check(r2 > r1, "rounds grew")


def case_ignore_term(job):
    job.flags += FAST + ["--nnodes", "1:2", "--max-restarts", "3", "--stop-grace", "1"]
    a = job.start("node-a", env={"AGENT_TEST_IGNORE_TERM": "1"})
    b = job.start("node-b")
    r1 = job.wait_round(2, 60)
    aw = workers_of(job, a)[0]
    bw = workers_of(job, b)[0]
    job.command(bw["_pid"], "exit 1")
    r2 = job.wait_round(2, 40, newer_than=r1)
    check("term-ignored" in job.worker_log(aw["_pid"]), "worker ignored SIGTERM")
    check(not pid_alive(aw["_pid"]), "and was killed")
    check("SIGKILL" in a.log(), "the agent logged the SIGKILL")
    # The same on shutdown: killed within --shutdown-timeout, agent exits 0.
    t0 = time.monotonic()
    a.signal(signal.SIGTERM)
    check(a.wait_exit(15) == 0, "agent exits 0 with a stubborn worker")
    check(time.monotonic() - t0 < 8 + 4, "within the shutdown timeout")
    check(r2 > r1, "new round")


def case_crash_counted_once(job):
    """A worker crash seen first by its peers (their rings break) is still one
    restart: the peers' lost-peer reports are not counted, the crashed node's
    own report is, once. A budget of 1 fails the job on a double count."""
    job.flags += FAST + ["--nnodes", "3", "--max-restarts", "1"]
    env = {"AGENT_TEST_MESH": "1"}
    a, b, c = (job.start(n, env=env) for n in ("node-a", "node-b", "node-c"))
    r1 = job.wait_round(3, 60)
    w = workers_of(job, b)[0]
    job.command(w["_pid"], "segv")
    r2 = job.wait_round(3, 60, newer_than=r1)
    # The count lands on whichever round is current when node-b's report
    # comes (the round its peers' reports opened, frozen or not), so the
    # job's own count is what is checked, not a round's environment.
    try:
        wait_for(lambda: job_restarts(job) == 1, 30, "the job-wide restart count at 1")
    except Fail:
        raise Fail("no restart counted; rounds %d, %d; logs:\n%s" % (r1, r2, b.log()))
    check(job.running_round(3) is not None, "a round of 3 runs")
    for ag in (a, b, c):
        check(ag.alive(), "agent %s carries on (a double count would fail the job)" % ag.node)
    job.command("all", "exit 0")
    for ag in (a, b, c):
        check(ag.wait_exit(30) == 0, "agent %s exits 0" % ag.node)
    check(job_restarts(job) == 1, "one restart in all: %r" % job_restarts(job))


def case_crash_while_stopping(job):
    """A worker that crashes on its own while its agent stops it (the round
    ended for another reason first) is still a counted failure: the order in
    which the round's end and the crash reach the agent does not decide it.
    Here the order is forced: node-a's worker reports a lost peer (not
    counted), and node-b's worker segfaults when the agent's SIGTERM comes."""
    job.flags += FAST + ["--nnodes", "2", "--max-restarts", "3"]
    a, b = (job.start(n) for n in ("node-a", "node-b"))
    r1 = job.wait_round(2, 60)
    wb = workers_of(job, b)[0]
    job.command(wb["_pid"], "segv-on-term")
    wait_for(lambda: any("segv-on-term" in l for l in job.worker_log(wb["_pid"])), 10,
             "worker b armed")
    job.command(workers_of(job, a)[0]["_pid"], "peer-lost")
    # The count lands on the round current when node-b's report comes
    # (frozen or not): the job's count says it was made.
    try:
        wait_for(lambda: job_restarts(job) == 1, 60, "the job-wide restart count at 1")
    except Fail:
        raise Fail("the crash while stopping was not counted; logs:\n%s" % b.log())
    job.wait_round(2, 60, newer_than=r1)
    check("while stopping" in b.log(), "node-b says the worker crashed while stopping")
    job.command("all", "exit 0")
    for ag in (a, b):
        check(ag.wait_exit(30) == 0, "agent %s exits 0" % ag.node)


def case_report_unreachable(job):
    """A failure that cannot be recorded in etcd ends the agent non-zero with the
    reason, instead of idling in a round nobody else knows is broken."""
    job.flags += FAST + ["--nnodes", "1:2", "--max-restarts", "3"]
    # The registration goes over the driver's connection; every txn of the
    # agent's own calls (the report first) fails.
    a = job.start("node-a", env={"DUCTILE_FAILPOINTS": "etcd.api.txn=1+:unavailable"})
    b = job.start("node-b")
    job.wait_round(2, 60)
    w = workers_of(job, a)[0]
    job.command(w["_pid"], "exit 3")
    code = a.wait_exit(60)
    check(code != 0, "agent exits non-zero, got %d" % code)
    last = a.log().strip().splitlines()[-1]
    check("could not record" in last and "exiting with code" in last, "one line says why: %r" % last)
    check(b.alive(), "the other agent carries on")


def case_master_wait(job):
    """Waiting for MASTER_PORT (node rank 0 publishes it late) does not block the
    agent: a SIGTERM during the wait is handled at once."""
    job.flags += FAST + ["--nnodes", "2", "--max-restarts", "0", "--shutdown-timeout", "20"]
    # node-a joins first, so it is node rank 0; its store write stalls 20 s.
    a = job.start("node-a", env={"DUCTILE_FAILPOINTS": "etcd.store.txn=1:sleep:20000"})
    wait_for(lambda: "joining job" in a.log(), 20, "a starts")
    time.sleep(1)
    b = job.start("node-b")
    wait_for(lambda: "round_frozen" in b.log() or " frozen: " in b.log(), 30, "b in round 1")
    b.signal(signal.SIGTERM)
    check(b.wait_exit(15) == 0, "b exits 0 on SIGTERM")
    check("workers_started" not in a.log() and "started 1 workers" not in a.log(),
          "node rank 0 had not published yet: b was waiting, and did not block")


def case_report_stalled(job):
    """A failure report stalled on etcd does not stall the agent's loop. While
    the report waits 20 s, the other worker's exit is reaped and logged,
    /healthz answers and /metrics moves, and SIGTERM ends the agent within its
    shutdown budget. Proven by order, not by time: the report's own line
    ("failure recorded") comes only after the stall, and never came here."""
    job.flags += FAST + ["--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "3"]
    port = free_port()
    # txn 1 of the agent's own calls (the registration is the driver
    # connection's) is the report's write: it stalls 20 s.
    a = job.start("node-a", ["--http-port", str(port)],
                  env={"DUCTILE_FAILPOINTS": "etcd.api.txn=1:sleep:20000"})
    job.wait_round(2, 60)
    ws = sorted(workers_of(job, a), key=lambda w: int(w["RANK"]))
    check(len(ws) == 2, "two workers: %r" % ws)
    job.command(ws[0]["_pid"], "exit 3")
    # The crash is reaped, the other worker stopped, reaped and logged.
    other = re.compile(r"worker rank %s (exited|was killed)" % ws[1]["RANK"])
    wait_for(lambda: other.search(a.log()), 15, "the other worker's exit logged")
    check("failure recorded" not in a.log(), "reaped while the report was stalled")
    check(http_get(port, "/healthz")[0] == 200, "/healthz answers")
    wait_for(lambda: re.search(r"^ductile_workers_running 0$", http_get(port, "/metrics")[1],
                               re.M), 10, "/metrics: no worker running")
    check("failure recorded" not in a.log(), "/healthz and /metrics while stalled")
    a.signal(signal.SIGTERM)
    code = a.wait_exit(8 + 5)
    check(code == 0, "SIGTERMed agent exits 0, got %d" % code)
    log = a.log()
    check("SIGTERM: stopping workers" in log, "SIGTERM handled")
    check("failure recorded" not in log and "still waiting on etcd" in log,
          "it exited while the report was still stalled: %r" % log.splitlines()[-3:])
