"""test_http.py: what the agent shows: its HTTP endpoints and `status`.

/healthz, /readyz and /metrics (the round, the counters, the workers'
progress from their `step` lines), JSON logs, named threads, and
`ductile-agent status` in text and JSON.
"""
import json
import re
import time
from agentkit import ETCD, FAST, run_agent, thread_names, workers_of
from testlib import check, free_port, http_get, tcp_open, wait_for



def case_http_and_status(job):
    job.flags += FAST + ["--nnodes", "2", "--max-restarts", "2"]
    port = free_port()
    a = job.start("node-a", ["--http-port", str(port), "--log-format", "json"])
    wait_for(lambda: http_get(port, "/healthz")[0] == 200 if tcp_open(port) else False, 20,
             "/healthz")
    check(http_get(port, "/readyz")[0] == 503, "not ready before a round")
    b = job.start("node-b")
    r1 = job.wait_round(2, 60)
    wait_for(lambda: http_get(port, "/readyz")[0] == 200, 10, "/readyz 200 in a round")
    # Every thread but the main one says what it is (ps -L, gdb, /proc).
    names = thread_names(a.proc.pid)
    main = names.pop(str(a.proc.pid))
    check(main not in names.values(), "every thread named: %s" % sorted(names.values()))
    for name in ["rdzv-driver", "rdzv-keepalive", "rdzv-watch", "rdzv-probe"]:
        check(name in names.values(), "a thread named %s: %s" % (name, sorted(names.values())))
    code, text = http_get(port, "/metrics")
    check(code == 200, "/metrics 200")
    for name in ["ductile_round", "ductile_members", "ductile_world_size",
                 "ductile_restarts_total", "ductile_workers_running",
                 "ductile_rendezvous_seconds_total", "ductile_membership_changes_total"]:
        check("# HELP %s " % name in text and "# TYPE %s " % name in text, "HELP/TYPE " + name)
    check(re.search(r"^ductile_round %d$" % r1, text, re.M), "ductile_round value")
    check(re.search(r"^ductile_world_size 2$", text, re.M), "world size 2")
    check(re.search(r"^ductile_workers_running 1$", text, re.M), "workers running 1")
    for cause in ["member_lost", "member_left", "node_waiting", "failure", "peer_lost"]:
        check('ductile_membership_changes_total{cause="%s"}' % cause in text, "cause " + cause)
    check(http_get(port, "/nope")[0] == 404, "404")
    # A failure shows in the counters.
    w = workers_of(job, b)[0]
    job.command(w["_pid"], "exit 1")
    job.wait_round(2, 40, newer_than=r1)
    wait_for(lambda: re.search(r'^ductile_membership_changes_total\{cause="failure"\} 1$',
                               http_get(port, "/metrics")[1], re.M), 10, "failure counted")
    wait_for(lambda: re.search(r"^ductile_restarts_total 1$", http_get(port, "/metrics")[1],
                               re.M), 10, "restart counted")
    # JSON logs: every line of the agent's own log parses.
    for line in a.log().splitlines():
        if line.startswith("{"):
            obj = json.loads(line)
            check("event" in obj and "msg" in obj and obj["node"] == "node-a", "json log line")
    check(any(json.loads(l).get("event") == "round_frozen" for l in a.log().splitlines()
              if l.startswith("{")), "round_frozen event in JSON")
    # status --json parses and describes the job.
    r = run_agent(["status", "--rdzv-endpoint", ETCD, "--rdzv-id", job.name, "--json"])
    check(r.returncode == 0, "status exit %d: %s" % (r.returncode, r.stderr))
    st = json.loads(r.stdout)
    check(isinstance(st, dict), "status is an object")
    text = json.dumps(st)
    check("node-a" in text and "node-b" in text, "status names the members: " + text)
    r = run_agent(["status", "--rdzv-endpoint", ETCD, "--rdzv-id", job.name])
    check(r.returncode == 0 and "node-a" in r.stdout, "status text")


def metric(text, name, rank):
    """The value of name{rank="rank",...} on a /metrics page, or None."""
    m = re.search(r'^%s\{rank="%d",local_rank="0"\} (\S+)$' % (name, rank), text, re.M)
    return float(m.group(1)) if m else None


def case_progress(job):
    # The test worker says `step K samples 32K loss 2/K` every 0.5 s.
    job.flags += FAST + ["--nnodes", "1"]
    port = free_port()
    a = job.start("node-a", ["--http-port", str(port)])
    job.wait_round(1, 60)
    names = ["ductile_worker_step", "ductile_worker_last_step_timestamp_seconds",
             "ductile_worker_samples_total", "ductile_worker_samples_per_second",
             "ductile_worker_loss"]

    def progressing():
        text = http_get(port, "/metrics")[1]
        return text if (metric(text, "ductile_worker_step", 0) or 0) >= 3 and \
            (metric(text, "ductile_worker_samples_per_second", 0) or 0) > 0 else None

    text = wait_for(progressing, 30, "steps and samples/s on /metrics")
    for name in names:
        check("# HELP %s " % name in text and "# TYPE %s " % name in text, "HELP/TYPE " + name)
    check("# TYPE ductile_worker_samples_total counter" in text, "samples_total is a counter")
    step = metric(text, "ductile_worker_step", 0)
    total = metric(text, "ductile_worker_samples_total", 0)
    # The first report is the baseline: every later step adds 32.
    check(total is not None and total > 0 and total % 32 == 0 and total <= 32 * step,
          "samples total %r at step %r" % (total, step))
    rate = metric(text, "ductile_worker_samples_per_second", 0)
    check(rate > 0, "samples/s %r" % rate)
    loss = metric(text, "ductile_worker_loss", 0)
    check(loss is not None and 0 < loss <= 2.0 / (step - 1), "loss %r at step %r" % (loss, step))
    at = metric(text, "ductile_worker_last_step_timestamp_seconds", 0)
    check(at is not None and abs(at - time.time()) < 300, "last step timestamp %r" % at)
    # A bad `step` line is logged and dropped; the counts go on.
    w = workers_of(job, a)[0]
    job.command(w["_pid"], "bad-step")
    wait_for(lambda: "invalid control line" in a.log(), 20, "bad step line logged")
    wait_for(lambda: (metric(http_get(port, "/metrics")[1], "ductile_worker_samples_total", 0)
                      or 0) > total, 20, "samples go on after a bad line")
    # status reads each member's /metrics and shows its progress.
    r = run_agent(["status", "--rdzv-endpoint", ETCD, "--rdzv-id", job.name,
                   "--metrics-port", str(port)])
    check(r.returncode == 0, "status exit %d: %s" % (r.returncode, r.stderr))
    check(re.search(r"step \d+  [0-9.]+ samples/s  loss [0-9.e-]+  last step [0-9.]+s ago",
                    r.stdout), "status text shows progress: " + r.stdout)
    r = run_agent(["status", "--rdzv-endpoint", ETCD, "--rdzv-id", job.name, "--json"],
                  env={"DUCTILE_HTTP_PORT": str(port)})
    check(r.returncode == 0, "status --json exit %d: %s" % (r.returncode, r.stderr))
    pr = json.loads(r.stdout)["members"][0]["progress"]
    check(pr["read"] and pr["step"] >= 3 and pr["samples_per_second"] > 0 and
          0 < pr["loss"] <= 2 and pr["last_step_age_seconds"] >= 0, "status --json: %r" % pr)
    # An agent that does not answer is shown so; status still succeeds.
    r = run_agent(["status", "--rdzv-endpoint", ETCD, "--rdzv-id", job.name,
                   "--metrics-port", str(free_port())])
    check(r.returncode == 0 and "progress: not read" in r.stdout, "unreachable: " + r.stdout)
    r = run_agent(["status", "--rdzv-endpoint", ETCD, "--rdzv-id", job.name,
                   "--metrics-port", "70000"])
    check(r.returncode == 2 and "--metrics-port" in r.stderr and
          len(r.stderr.strip().splitlines()) == 1, "bad port: " + r.stderr)
