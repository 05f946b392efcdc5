"""test_etcd_outage.py: training while etcd is away.

etcd killed and started again under a running job; etcd stopped (SIGSTOP)
for three lease TTLs, after which every agent registers again and joins the
next round, nothing counted; then killed for as long, after which the round
lives on.
"""
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from agentkit import ETCD, finish_with, status_of
from testlib import check, pid_alive, wait_for



def case_etcd_restart(job):
    job.flags += ["--lease-ttl", "10", "--last-call", "0.5", "--stop-grace", "2",
                  "--nnodes", "2", "--max-restarts", "3"]
    a, b = job.start("node-a"), job.start("node-b")
    r1 = job.wait_round(2, 60)
    pid = int(os.environ["DUCTILE_TEST_ETCD_PID"])
    with open("/proc/%d/cmdline" % pid, "rb") as f:
        argv = [x.decode() for x in f.read().split(b"\0") if x]
    os.kill(pid, signal.SIGKILL)
    time.sleep(2)
    log = open(os.path.join(job.dir, "etcd2.log"), "w")
    etcd = subprocess.Popen(argv, stdout=log, stderr=log)
    try:
        def answers():
            try:
                req = urllib.request.Request(ETCD + "/v3/kv/range", data=b'{"key":"Lw=="}')
                urllib.request.urlopen(req, timeout=1).read()
                return True
            except (urllib.error.URLError, OSError):
                return False
        wait_for(answers, 20, "etcd back")
        time.sleep(3)
        check(a.alive() and b.alive(), "agents survived the etcd restart")
        check(job.running_round(2) is not None, "workers still running")
        # The job carries on: it can still change rounds and complete.
        job.command("all", "exit 0")
        for ag in (a, b):
            check(ag.wait_exit(30) == 0, "agent %s completes after etcd restart" % ag.node)
        check(r1 >= 1, "round")
    finally:
        etcd.kill()
        etcd.wait()


def case_etcd_away(job):
    """etcd away for three lease TTLs (stopped, SIGSTOP: it answers nothing,
    as behind a partition), then back. Meanwhile training goes on: nothing
    needs etcd between rounds, and no agent stops its workers on its own
    clock. Back, etcd has counted the leases out; each agent finds its
    registration gone, stops its workers, registers again and joins the next
    round, whose workers start again (from their checkpoint); nothing is
    counted against the restart budget. Then etcd killed for three TTLs and
    started again: a new leader renews every lease, so that round and its
    workers live on. The job completes."""
    ttl = 3
    job.flags += ["--lease-ttl", str(ttl), "--last-call", "0.5", "--stop-grace", "2",
                  "--nnodes", "2", "--max-restarts", "3"]
    a, b = job.start("node-a"), job.start("node-b")
    r1 = job.wait_round(2, 60)
    first = {w["_pid"] for w in job.round_workers(r1)}
    pid = int(os.environ["DUCTILE_TEST_ETCD_PID"])
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(3 * ttl)
        check(a.alive() and b.alive(), "agents alive while etcd is away")
        check(all(pid_alive(p) for p in first), "round %d's workers train on while etcd is "
              "away" % r1)
    finally:
        os.kill(pid, signal.SIGCONT)
    r2 = job.wait_round(2, 60, newer_than=r1)
    check(not any(pid_alive(p) for p in first), "round %d's workers were stopped" % r1)
    for ag in (a, b):
        check(re.search(r"round %d left: lease lost .*registered again, joining the next round"
                        % r1, ag.log()), "agent %s says its lease was lost:\n%s" %
              (ag.node, ag.log()))
        check(re.search(r"round %d frozen: 2 nodes.*this node's lease was lost" % r2, ag.log()),
              "agent %s rejoined in round %d" % (ag.node, r2))
    st = status_of(job)
    check(st["restarts"] == 0 and st["job_state"] == "running",
          "nothing counted, the job runs: %r" % st)
    # etcd killed and started again after three TTLs: a new leader renews
    # every lease, so the round and its workers live on.
    job.wait_round(2, 20, newer_than=r1)
    second = {w["_pid"] for w in job.round_workers(r2)}
    with open("/proc/%d/cmdline" % pid, "rb") as f:
        argv = [x.decode() for x in f.read().split(b"\0") if x]
    os.kill(pid, signal.SIGKILL)
    time.sleep(3 * ttl)
    log = open(os.path.join(job.dir, "etcd2.log"), "w")
    etcd = subprocess.Popen(argv, stdout=log, stderr=log)
    try:
        time.sleep(3 * ttl)
        check(a.alive() and b.alive(), "agents alive after etcd's restart")
        check(all(pid_alive(p) for p in second), "round %d's workers live on" % r2)
        check(job.running_round(2) == r2 and status_of(job)["round"] == r2,
              "no new round after etcd's restart: %r" % status_of(job))
        check(" round %d left" % r2 not in a.log() + b.log(), "no agent left round %d" % r2)
        finish_with(job, (a, b))
    finally:
        etcd.kill()
        etcd.wait()
