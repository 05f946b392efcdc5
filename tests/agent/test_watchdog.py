"""test_watchdog.py: --hang-timeout, the agent's watchdog of its workers.

A worker gone silent, or beating but making no progress, is killed by its
own agent, counted once as that node's failure and shown in /metrics.
"""
import re
import time
from agentkit import FAST, job_restarts, workers_of
from testlib import check, free_port, http_get, pid_alive, wait_for



def case_watchdog(job):
    """A worker that reported steps and then goes silent (hung, its sockets
    open) is killed by its own agent after --hang-timeout, counted once as
    that node's failure, and shown in /metrics; the other node is not blamed.
    Then one that stays alive and beating but makes no progress in local
    work is killed too."""
    job.flags += FAST + ["--nnodes", "2", "--max-restarts", "2"]
    port = free_port()
    a = job.start("node-a")
    b = job.start("node-b", ["--hang-timeout", "2", "--http-port", str(port)])
    r1 = job.wait_round(2, 60)
    w = workers_of(job, b)[0]
    step_re = r'^ductile_worker_step\{rank="\d+",local_rank="0"\} ([1-9]\d*)$'
    wait_for(lambda: re.search(step_re, http_get(port, "/metrics")[1], re.M), 20,
             "a worker's step in /metrics")
    text = http_get(port, "/metrics")[1]
    m = re.search(r'^ductile_worker_last_progress_timestamp_seconds\{rank="\d+",local_rank="0",'
                  r'phase="[a-z_]*"\} ([0-9.]+)$', text, re.M)
    check(m and abs(float(m.group(1)) - time.time()) < 120,
          "last progress is a Unix time of now: %s" % (m and m.group(0)))
    check(re.search(r"^ductile_worker_hangs_total 0$", text, re.M), "no hang yet")
    job.command(w["_pid"], "hang")
    job.wait_round(2, 60, newer_than=r1)
    check(re.search(r"worker rank \d+ \(pid %d\) hung: silent for [0-9.]+ s "
                    r"\(--hang-timeout 2 s\).*killing it" % w["_pid"], b.log()),
          "one line on the hang: %s" % b.log()[-600:])
    check(not pid_alive(w["_pid"]), "the hung worker was killed")
    wait_for(lambda: re.search(r"^ductile_worker_hangs_total 1$", http_get(port, "/metrics")[1],
                               re.M), 10, "the hang counted in /metrics")
    check(job_restarts(job) == 1, "one restart counted, got %s" % job_restarts(job))
    check(not re.search(r"\(pid \d+\) hung:", a.log()), "node-a's worker killed for node-b's hang")
    check(a.alive() and b.alive(), "agents carry on")
    # Alive and beating (`phase compute` every 0.5 s) but no new step: stuck
    # in local work, killed for want of progress, not for silence.
    r2 = job.wait_round(2, 60)
    w2 = workers_of(job, b)[0]
    wait_for(lambda: re.search(step_re, http_get(port, "/metrics")[1], re.M), 20,
             "the new worker's step in /metrics")
    job.command(w2["_pid"], "stall")
    job.wait_round(2, 60, newer_than=r2)
    check(re.search(r"worker rank \d+ \(pid %d\) hung: no progress for [0-9.]+ s "
                    r"\(--hang-timeout 2 s\) in phase compute" % w2["_pid"], b.log()),
          "one line on the stall: %s" % b.log()[-600:])
    check(job_restarts(job) == 2, "a second restart counted, got %s" % job_restarts(job))
