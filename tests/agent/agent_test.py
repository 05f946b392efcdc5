#!/usr/bin/env python3
"""agent_test.py: the agent's integration tests, one case per ctest entry.

Run under with-etcd (DUCTILE_TEST_ETCD is a real etcd on 127.0.0.1):

    with-etcd -- python3 agent_test.py --agent ductile-agent --worker agent-test-worker CASE

Every case starts real ductile-agent processes with test_worker as their
command, drives them (signals, worker commands, etcd restarts) and checks
what the workers report (tests/agent/test_worker.c) and how agents exit.
Timing bounds here are correctness bounds ("before the lease TTL") and are
generous; speed is measured in bench/agent.
"""
import argparse
import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../harness"))
from testlib import SKIP, Fail, Skip, check, free_port, http_get, pid_alive  # noqa: E402
from testlib import run_case, tcp_open, wait_for  # noqa: E402

ARGS = None
ETCD = os.environ.get("DUCTILE_TEST_ETCD", "")


class Agent:
    def __init__(self, job, node, flags, env_extra=None, cmd=None):
        self.job, self.node = job, node
        # Agents started with one node id (a restarted pod, a twin) log apart.
        n = sum(1 for x in job.agents if x.node == node)
        name = node if n == 0 else "%s.%d" % (node, n + 1)
        self.out_path = os.path.join(job.dir, "agent.%s.out" % name)
        self.err_path = os.path.join(job.dir, "agent.%s.err" % name)
        env = dict(os.environ)
        env["AGENT_TEST_DIR"] = job.dir
        env.update(env_extra or {})
        cmd = [ARGS.agent, "--rdzv-endpoint", ETCD, "--rdzv-id", job.name, "--node-id", node,
               "--node-addr", "127.0.0.1"] + job.flags + flags + ["--"] + (cmd or [ARGS.worker])
        self.proc = subprocess.Popen(cmd, env=env, stdout=open(self.out_path, "w"),
                                     stderr=open(self.err_path, "w"))
        self.started = time.monotonic()

    def log(self):
        with open(self.err_path) as f:
            return f.read()

    def out(self):
        with open(self.out_path) as f:
            return f.read()

    def alive(self):
        return self.proc.poll() is None

    def wait_exit(self, timeout):
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise Fail("agent %s did not exit within %.0f s; log:\n%s" %
                       (self.node, timeout, self.log()))

    def signal(self, sig):
        self.proc.send_signal(sig)


class Job:
    def __init__(self, name, flags):
        self.name = name
        self.flags = flags
        self.dir = tempfile.mkdtemp(prefix="agent-test-")
        self.agents = []

    def start(self, node, flags=None, env=None, cmd=None):
        a = Agent(self, node, flags or [], env, cmd)
        self.agents.append(a)
        return a

    def workers(self):
        """Every worker that has reported, as dicts of its environment."""
        out = []
        for name in (os.listdir(self.dir) if os.path.isdir(self.dir) else []):
            m = re.fullmatch(r"w\.(\d+)\.env", name)
            if not m:
                continue
            env = {}
            with open(os.path.join(self.dir, name)) as f:
                for line in f:
                    k, _, v = line.rstrip("\n").partition("=")
                    env[k] = v
            env["_pid"] = int(m.group(1))
            out.append(env)
        return out

    def worker_log(self, pid):
        try:
            with open(os.path.join(self.dir, "w.%d.log" % pid)) as f:
                return f.read().splitlines()
        except FileNotFoundError:
            return []

    def round_workers(self, rnd):
        return [w for w in self.workers() if int(w.get("DUCTILE_ROUND", -1)) == rnd]

    def alive_workers(self):
        return [w for w in self.workers() if pid_alive(w["_pid"])]

    def running_round(self, world):
        """The round whose `world` workers all reported and are alive, or None."""
        ws = self.alive_workers()
        rounds = {int(w["DUCTILE_ROUND"]) for w in ws}
        for r in sorted(rounds, reverse=True):
            rw = [w for w in ws if int(w["DUCTILE_ROUND"]) == r]
            if len(rw) == world and all(int(w["WORLD_SIZE"]) == world for w in rw):
                return r
        return None

    def wait_round(self, world, timeout, newer_than=0):
        def pred():
            r = self.running_round(world)
            return r if r is not None and r > newer_than else None
        return wait_for(pred, timeout, "a round with %d workers running (after round %d)" %
                        (world, newer_than))

    def command(self, pid, cmd):
        path = os.path.join(self.dir, "cmd.%s" % pid)
        with open(path + ".tmp", "w") as f:
            f.write(cmd + "\n")
        os.rename(path + ".tmp", path)

    def cleanup(self, keep):
        for a in self.agents:
            if a.alive():
                a.proc.kill()
                a.proc.wait()
        # Workers die with their agent (PR_SET_PDEATHSIG); make sure.
        for w in self.workers():
            try:
                os.kill(w["_pid"], signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if keep:
            for a in self.agents:
                sys.stderr.write("---- agent %s log ----\n%s" % (a.node, a.log()))
        shutil.rmtree(self.dir, ignore_errors=True)


def workers_of(job, node_agent):
    return [w for w in job.alive_workers() if int(w["TEST_PPID"]) == node_agent.proc.pid]


def job_restarts(job):
    """The job-wide restart count, as `ductile-agent status` reads it."""
    r = run_agent(["status", "--rdzv-endpoint", ETCD, "--rdzv-id", job.name, "--json"])
    return json.loads(r.stdout)["restarts"] if r.returncode == 0 else None


def run_agent(args, env=None, timeout=10):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([ARGS.agent] + args, env=e, capture_output=True, text=True,
                          timeout=timeout)


# Short timings keep the suite fast; they are the agent's own flags.
FAST = ["--lease-ttl", "3", "--last-call", "0.5", "--stop-grace", "2",
        "--shutdown-timeout", "8", "--join-timeout", "60"]

# ---------------------------------------------------------------------------


def case_bad_flags(job):
    bad = [
        ["--nnodes", "x"], ["--nnodes", "3:2"], ["--nnodes", "0"], ["--nnodes", "1:"],
        ["--nnodes", "2:x"], ["--nproc-per-node", "0"], ["--nproc-per-node", "2x"],
        ["--nproc-per-node", "99999999999999999999"], ["--nproc-per-node", "gpus"], ["--max-restarts", "-1"],
        ["--lease-ttl", "1"], ["--lease-ttl", "5.5"], ["--last-call", "abc"],
        ["--join-timeout", "-3"], ["--shutdown-timeout", "nan"], ["--rebuild", "sometimes"],
        ["--log-format", "xml"], ["--http-port", "70000"], ["--rdzv-id", "Bad_Id"],
        ["--node-id", "a b"], ["--standalone=maybe"], ["--no-such-flag", "1"], ["--nnodes"],
        ["--leave-exit-code", "256"], ["--leave-exit-code", "-1"],
        ["--hang-timeout", "0"], ["--hang-timeout", "-5"], ["--hang-timeout", "1e9"],
        ["--hang-timeout", "never"], ["--hang-timeout", "inf"], ["--hang-timeout", ""],
    ]
    base = ["--rdzv-endpoint", ETCD, "--rdzv-id", "j"]
    for flags in bad:
        r = run_agent(base + flags + ["--", "true"])
        check(r.returncode == 2, "%s: exit %d, want 2" % (flags, r.returncode))
        lines = r.stderr.strip().splitlines()
        check(len(lines) == 1 and lines[0].startswith("ductile-agent: "),
              "%s: want one error line, got %r" % (flags, r.stderr))
    # Missing pieces.
    for args in (["--rdzv-id", "j", "--", "true"], ["--rdzv-endpoint", ETCD, "--", "true"],
                 base):
        r = run_agent(args, env={"DUCTILE_RDZV_ENDPOINT": "", "DUCTILE_RDZV_ID": ""}
                      if False else None)
        check(r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1,
              "%s: exit %d %r" % (args, r.returncode, r.stderr))
    # The same checks apply to DUCTILE_* variables, and they name the variable.
    r = run_agent(base + ["--", "true"], env={"DUCTILE_NNODES": "two"})
    check(r.returncode == 2 and "DUCTILE_NNODES" in r.stderr, "env: %r" % r.stderr)
    # --help lists every flag with its variable.
    r = run_agent(["--help"])
    check(r.returncode == 0, "--help exit %d" % r.returncode)
    for flag in ["nnodes", "nproc-per-node", "rdzv-endpoint", "rdzv-id", "max-restarts",
                 "node-id", "node-addr", "lease-ttl", "last-call", "join-timeout",
                 "shutdown-timeout", "rebuild", "standalone", "http-port", "log-format",
                 "leave-exit-code", "hang-timeout",
                 "etcd-cacert", "etcd-cert", "etcd-key", "etcd-user", "etcd-password"]:
        check("--" + flag in r.stdout, "--help lacks --" + flag)
        check("DUCTILE_" + flag.upper().replace("-", "_") in r.stdout, "--help lacks env of " + flag)
    r = run_agent(["status", "--rdzv-id", "j"])
    check(r.returncode == 2, "status without endpoint: exit %d" % r.returncode)


def case_env_and_finish(job):
    job.flags += FAST + ["--nnodes", "3", "--nproc-per-node", "2", "--max-restarts", "7"]
    a = job.start("node-a")
    b = job.start("node-b", env={"OMP_NUM_THREADS": "4"})
    # Flags from DUCTILE_* variables; the command line wins over them.
    c = job.start("node-c", env={"DUCTILE_LOG_FORMAT": "json", "DUCTILE_NPROC_PER_NODE": "5"})
    rnd = job.wait_round(6, 60)
    check(json.loads(c.log().splitlines()[0])["node"] == "node-c", "DUCTILE_LOG_FORMAT=json")
    ws = job.round_workers(rnd)
    check(sorted(int(w["RANK"]) for w in ws) == list(range(6)), "ranks 0..5")
    ports = {w["MASTER_PORT"] for w in ws}
    check(len(ports) == 1 and 0 < int(ports.pop()) < 65536, "one MASTER_PORT")
    by_group = {}
    for w in ws:
        rank, group = int(w["RANK"]), int(w["GROUP_RANK"])
        by_group.setdefault(group, []).append(w)
        expect = {
            "LOCAL_RANK": str(rank - 2 * group), "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2",
            "GROUP_WORLD_SIZE": "3", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": "6",
            "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1",
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "7",
            "TORCHELASTIC_RUN_ID": job.name, "DUCTILE_ETCD_ENDPOINTS": ETCD,
            "DUCTILE_JOB": job.name, "DUCTILE_ROUND": str(rnd),
            "DUCTILE_STORE_PREFIX": "/ductile/%s/rounds/%d/store/" % (job.name, rnd),
            "DUCTILE_CONTROL_FD": "3", "TEST_CONTROL_FD_OPEN": "1",
            "DUCTILE_NODE_ADDR": "127.0.0.1",
        }
        for k, v in expect.items():
            check(w.get(k) == v, "rank %d: %s=%r, want %r" % (rank, k, w.get(k), v))
        want_omp = "4" if int(w["TEST_PPID"]) == b.proc.pid else "1"
        check(w.get("OMP_NUM_THREADS") == want_omp,
              "rank %d: OMP_NUM_THREADS=%r want %s" % (rank, w.get("OMP_NUM_THREADS"), want_omp))
    check(sorted(by_group) == [0, 1, 2], "group ranks 0..2")
    for g, gw in by_group.items():
        check(len({w["TEST_PPID"] for w in gw}) == 1, "group %d on one agent" % g)
    # Output is passed through with the global rank.
    wait_for(lambda: all("[%d] hello from rank %d" % (int(w["RANK"]), int(w["RANK"]))
                         in (a.out() + b.out() + c.out()) for w in ws), 10, "[rank] output")
    wait_for(lambda: "[0] stderr of rank 0" in a.log() + b.log() + c.log(), 10, "[rank] stderr")
    # All workers exit 0: the job is complete and every agent exits 0.
    job.command("all", "exit 0")
    for ag in (a, b, c):
        check(ag.wait_exit(30) == 0, "agent %s exit code" % ag.node)
    check("job complete" in a.log(), "a says job complete")
    os.unlink(os.path.join(job.dir, "cmd.all"))
    # An agent started after completion exits 0 at once, starting nothing.
    d = job.start("node-d")
    check(d.wait_exit(15) == 0, "late agent exit 0")
    check("complete" in d.log(), "late agent says complete: %s" % d.log())
    check(len(job.workers()) == 6, "late agent started no worker")


# The sentinels off (failpoint): each agent watches its next members' agents
# and revokes a dead one's lease at once (case_sigkill_pod); a test of what
# else finds a dead pod (its lease, its peers' workers, a takeover) turns
# them off, as when a pod's watchers died with it.
SENTINEL_OFF = {"DUCTILE_FAILPOINTS": "rdzv.sentinel=1+:off"}


def kill_case(job, ttl, mesh, sentinel=True):
    # No restart budget: losing a pod is a membership change, not a failure.
    job.flags += ["--lease-ttl", str(ttl), "--last-call", "0.5", "--stop-grace", "2",
                  "--nnodes", "2:3", "--max-restarts", "0"]
    env = dict({"AGENT_TEST_MESH": "1"} if mesh else {}, **({} if sentinel else SENTINEL_OFF))
    a, b, c = (job.start(n, env=env) for n in ("node-a", "node-b", "node-c"))
    rnd = job.wait_round(3, 60)
    time.sleep(0.5)
    t0 = time.monotonic()
    c.proc.kill()
    rnd2 = job.wait_round(2, ttl + 30, newer_than=rnd)
    took = time.monotonic() - t0
    ws = job.round_workers(rnd2)
    check({int(w["TEST_PPID"]) for w in ws} == {a.proc.pid, b.proc.pid},
          "the new round holds the survivors only")
    check(a.alive() and b.alive(), "survivors still running")
    check(all(w["TORCHELASTIC_RESTART_COUNT"] == "0" for w in ws), "no restart used")
    # ... and the job still finishes, every survivor exiting 0.
    job.command("all", "exit 0")
    for ag in (a, b):
        check(ag.wait_exit(30) == 0, "agent %s exits 0 at the job's end:\n%s" % (ag.node, ag.log()))
    return took


def case_sigkill_pod(job):
    """A pod lost (its agent and worker SIGKILLed) under workers that never
    notice: the survivors' agents watch the dead one's agent (its probe
    connection closes with its process), find it gone and revoke its lease,
    and the new round forms long before its 30 s lease TTL, with no restart
    counted."""
    ttl = 30
    took = kill_case(job, ttl, mesh=False)
    # Half the TTL: the dead lease's last keep-alive came before the kill.
    check(took < ttl / 2, "new round after %.1f s; the lease TTL is %d s" % (took, ttl))
    logs = job.agents[0].log() + job.agents[1].log()
    check(re.search(r"member node-c is gone \(its agent's connection closed; .*\): its lease "
                    r"is revoked", logs), "a sentinel found node-c gone:\n" + logs)
    check("restart limit" not in logs and job_restarts(job) == 0, "no restart counted")


def case_sigkill_mesh(job):
    # A long TTL: the new round can only come this fast because the survivors'
    # workers saw their peer go and the failure ended the round.
    ttl = 30
    took = kill_case(job, ttl, mesh=True, sentinel=False)
    check(took < ttl, "new round after %.1f s, not before the %d s lease TTL" % (took, ttl))
    a = job.agents[0]
    check(re.search(r"round \d+ ended: peer lost on node-[ab]: worker rank \d+ lost a peer",
                    a.log() + job.agents[1].log()), "a lost peer logged as the cause")
    check("restart limit" not in a.log() + job.agents[1].log(), "no restart counted")


def case_sigkill_script(job):
    """A pod lost under workers that know nothing of the agent (a PyTorch
    script: its collective raises, it exits 1). Their agents ask whose loss
    it was: the dead pod's agent is gone (its probe refuses), so its lease is
    revoked, the exits are a lost peer, not a failure (--max-restarts 0 and
    the job goes on), and the survivors' round forms at once, long before
    the dead agent's 30 s lease would have ended."""
    ttl = 30
    job.flags += ["--lease-ttl", str(ttl), "--stop-grace", "2", "--nnodes", "2:3",
                  "--max-restarts", "0"]
    env = dict(SENTINEL_OFF, AGENT_TEST_MESH="1", AGENT_TEST_MESH_EXIT="1")
    a, b, c = (job.start(n, env=env) for n in ("node-a", "node-b", "node-c"))
    rnd = job.wait_round(3, 60)
    time.sleep(0.5)
    t0 = time.monotonic()
    for w in workers_of(job, c):
        os.kill(w["_pid"], signal.SIGKILL)
    c.proc.kill()
    rnd2 = job.wait_round(2, ttl + 30, newer_than=rnd)
    took = time.monotonic() - t0
    check(took < ttl, "new round after %.1f s, not before the %d s lease TTL" % (took, ttl))
    ws = job.round_workers(rnd2)
    check({int(w["TEST_PPID"]) for w in ws} == {a.proc.pid, b.proc.pid},
          "the new round holds the survivors only")
    check(all(w["TORCHELASTIC_RESTART_COUNT"] == "0" for w in ws), "no restart used")
    logs = a.log() + b.log()
    check(re.search(r"member gone, lease revoked: node-c \(", logs), "node-c found gone: " + logs)
    check("the worker's exit was a lost peer" in logs, "an exit taken for a lost peer")
    check(a.alive() and b.alive(), "survivors still running")
    check(job_restarts(job) == 0, "no restart counted, got %s" % job_restarts(job))
    job.command("all", "exit 0")
    for ag in (a, b):
        check(ag.wait_exit(30) == 0, "agent %s exits 0 at the job's end:\n%s" % (ag.node, ag.log()))


def case_sigkill_ttl(job):
    ttl = 3
    took = kill_case(job, ttl, mesh=False, sentinel=False)
    check(took < ttl + 20, "new round after %.1f s, TTL %d s" % (took, ttl))
    check("node-c lost" in job.agents[0].log(), "the cause names node-c: " + job.agents[0].log())


def case_scale_up_and_spare(job):
    job.flags += FAST + ["--nnodes", "2:3", "--max-restarts", "0"]
    a, b = job.start("node-a"), job.start("node-b")
    r1 = job.wait_round(2, 60)
    c = job.start("node-c")
    r2 = job.wait_round(3, 60, newer_than=r1)
    check(c.proc.pid in {int(w["TEST_PPID"]) for w in job.round_workers(r2)}, "c in round")
    check("waiting" in a.log(), "a logs the node waiting")
    d = job.start("node-d")
    wait_for(lambda: "spare" in d.log(), 30, "node-d waits as a hot spare")
    time.sleep(2)
    check(job.running_round(3) == r2, "a spare does not end a full round")
    check(not workers_of(job, d), "the spare runs no worker")
    b.proc.kill()
    r3 = job.wait_round(3, 40, newer_than=r2)
    pids = {int(w["TEST_PPID"]) for w in job.round_workers(r3)}
    check(pids == {a.proc.pid, c.proc.pid, d.proc.pid}, "the spare took node-b's place")
    check("restarts 0 of 0" in a.log().splitlines()[-1] or "restarts 0" in a.log(),
          "membership changes used no restart")


def case_sigterm(job):
    ttl = 30
    job.flags += ["--lease-ttl", str(ttl), "--last-call", "0.5", "--stop-grace", "2",
                  "--shutdown-timeout", "10", "--nnodes", "2:3"]
    a, b, c = (job.start(n) for n in ("node-a", "node-b", "node-c"))
    rnd = job.wait_round(3, 60)
    cw = workers_of(job, c)
    t0 = time.monotonic()
    c.signal(signal.SIGTERM)
    check(c.wait_exit(10 + 5) == 0, "SIGTERMed agent exits 0")
    check(time.monotonic() - t0 < 12, "within --shutdown-timeout")
    check(any({"term", "stop"} & set(job.worker_log(w["_pid"])) for w in cw),
          "its worker was told to stop")
    rnd2 = job.wait_round(2, ttl - 5, newer_than=rnd)
    check(time.monotonic() - t0 < ttl, "new round before the lease TTL")
    check("node-c left" in a.log(), "cause: node-c left")
    check(rnd2 > rnd, "round number grew")
    # Under a Kubernetes Job a pod that leaves a running job must not count as
    # a completed index: --leave-exit-code gives it another status.
    d = job.start("node-d", ["--leave-exit-code", "5"])
    rnd3 = job.wait_round(3, ttl - 5, newer_than=rnd2)
    d.signal(signal.SIGTERM)
    check(d.wait_exit(15) == 5, "left a running job: exit 5")
    job.wait_round(2, ttl - 5, newer_than=rnd3)
    # At the job's end every agent exits 0, whatever the flag.
    e = job.start("node-e", ["--leave-exit-code", "5"])
    wait_for(lambda: job.running_round(3), 30, "node-e in a round")
    job.command("all", "exit 0")
    for ag in (a, b, e):
        check(ag.wait_exit(30) == 0, "agent %s exits 0 at the job's end" % ag.node)


def crash_until(job, a, b, how, world, rnd):
    w = workers_of(job, a)[0]
    job.command(w["_pid"], how)
    return job.wait_round(world, 40, newer_than=rnd)


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


def status_of(job):
    r = run_agent(["status", "--rdzv-endpoint", ETCD, "--rdzv-id", job.name, "--json"])
    check(r.returncode == 0, "status exit %d: %s" % (r.returncode, r.stderr))
    return json.loads(r.stdout)


def case_reset_ended_job(job):
    """An ended job keeps its state in etcd: agents started again under its id
    end at once without training. `ductile-agent reset` refuses while an agent
    of the job is alive, and deletes the job's keys once none is: the id then
    trains again as a new job."""
    job.flags += FAST + ["--nnodes", "1", "--max-restarts", "2"]
    a = job.start("node-a")
    job.wait_round(1, 60)
    reset = ["reset", "--rdzv-endpoint", ETCD, "--rdzv-id", job.name]
    r = run_agent(reset)
    check(r.returncode == 3 and "1 live node(s)" in r.stderr and len(r.stderr.splitlines()) == 1,
          "reset of a running job: exit %d %r" % (r.returncode, r.stderr))
    check(status_of(job)["job_state"] == "running", "nothing deleted while an agent lives")
    finish_with(job, (a,))
    check(status_of(job)["job_state"] == "done", "the job is done")
    # The trap: the same id again ends at once, no worker started.
    before = len(job.workers())
    again = job.start("node-b")
    check(again.wait_exit(30) == 0, "an agent of a done job exits 0")
    check(len(job.workers()) == before, "no worker started for a done job")
    r = run_agent(reset)
    check(r.returncode == 0 and re.match(r"job %s: [1-9]\d* key\(s\) deleted$" % job.name,
                                         r.stdout.strip()),
          "reset of an ended job: exit %d %r %r" % (r.returncode, r.stdout, r.stderr))
    check(status_of(job)["job_state"] == "none", "no trace of the job after reset")
    r = run_agent(reset)
    check(r.returncode == 0 and "0 key(s) deleted" in r.stdout, "reset again: %r" % r.stdout)
    os.remove(os.path.join(job.dir, "cmd.all"))  # the first run's "exit 0"
    c = job.start("node-c")
    rnd = job.wait_round(1, 60)
    check(rnd == 1, "the id starts over at round 1, got %d" % rnd)
    finish_with(job, (c,))
    for bad in (["reset", "--rdzv-endpoint", ETCD], ["reset", "--rdzv-id", "Bad_Id",
                "--rdzv-endpoint", ETCD], reset + ["--json"]):
        r = run_agent(bad)
        check(r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1,
              "%s: exit %d %r" % (bad, r.returncode, r.stderr))
    r = run_agent(["reset", "--rdzv-endpoint", "http://127.0.0.1:%d" % free_port(),
                   "--rdzv-id", job.name])
    check(r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1,
          "reset without etcd: exit %d %r" % (r.returncode, r.stderr))


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
    # txn 1 registers the node; every later txn of its own calls fails.
    a = job.start("node-a", env={"DUCTILE_FAILPOINTS": "etcd.api.txn=2+:unavailable"})
    b = job.start("node-b")
    job.wait_round(2, 60)
    w = workers_of(job, a)[0]
    job.command(w["_pid"], "exit 3")
    code = a.wait_exit(60)
    check(code != 0, "agent exits non-zero, got %d" % code)
    last = a.log().strip().splitlines()[-1]
    check("could not record" in last and "exiting with code" in last, "one line says why: %r" % last)
    check(b.alive(), "the other agent carries on")


def case_bad_failpoints(job):
    r = run_agent(["--rdzv-endpoint", ETCD or "http://127.0.0.1:1", "--rdzv-id", "x", "--", "true"],
                  env={"DUCTILE_FAILPOINTS": "etcd.api.txn=0:unavailable"})
    check(r.returncode == 2, "exit 2, got %d" % r.returncode)
    lines = r.stderr.strip().splitlines()
    check(len(lines) == 1 and "DUCTILE_FAILPOINTS" in lines[0], "one line: %r" % r.stderr)


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
    # txn 1 registers the node; txn 2 is the report's write: it stalls 20 s.
    a = job.start("node-a", ["--http-port", str(port)],
                  env={"DUCTILE_FAILPOINTS": "etcd.api.txn=2:sleep:20000"})
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


def etcd_call(path, body):
    req = urllib.request.Request(ETCD + path, data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read().decode())


def etcd_value(job, suffix):
    """(value as JSON, lease) of /ductile/<job>/<suffix>, or (None, 0)."""
    key = base64.b64encode(("/ductile/%s/%s" % (job.name, suffix)).encode()).decode()
    kvs = etcd_call("/v3/kv/range", {"key": key}).get("kvs") or []
    if not kvs:
        return None, 0
    return json.loads(base64.b64decode(kvs[0]["value"])), int(kvs[0].get("lease", 0))


def lease_alive(lease):
    return int(etcd_call("/v3/lease/timetolive", {"ID": str(lease)}).get("TTL", -1)) > 0


# A long TTL: a node id back in a round before it could have expired was taken over.
TAKEOVER = ["--lease-ttl", "30", "--last-call", "0.5", "--stop-grace", "2",
            "--shutdown-timeout", "8", "--join-timeout", "60", "--nnodes", "2:3",
            "--max-restarts", "0"]


def finish_with(job, agents):
    job.command("all", "exit 0")
    for ag in agents:
        check(ag.wait_exit(30) == 0, "agent %s exits 0 at the job's end:\n%s" % (ag.node, ag.log()))


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


def case_standalone(job):
    tmp = tempfile.mkdtemp(prefix="agent-standalone-")
    try:
        env = dict(os.environ, TMPDIR=tmp, AGENT_TEST_DIR=job.dir)
        p = subprocess.Popen([ARGS.agent, "--standalone", "--nproc-per-node", "2",
                              "--node-id", "solo", "--node-addr", "127.0.0.1", "--last-call",
                              "0.2", "--", ARGS.worker], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
        try:
            rnd = job.wait_round(2, 60)
            ws = job.round_workers(rnd)
            ep = ws[0]["DUCTILE_ETCD_ENDPOINTS"]
            check(ep.startswith("http://127.0.0.1:") and ep != ETCD, "private etcd: " + ep)
            check(ws[0]["DUCTILE_JOB"] == "standalone", "default job id")
            check(any(n.startswith("ductile-standalone-") for n in os.listdir(tmp)), "data dir")
            job.command("all", "exit 0")
            _, err = p.communicate(timeout=30)
            check(p.returncode == 0, "exit 0: " + err)
            check(os.listdir(tmp) == [], "data dir removed: %r" % os.listdir(tmp))
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def torch_python():
    """The Python with torch installed (make test-torch makes one), or None."""
    for py in (os.environ.get("DUCTILE_TORCH_PYTHON"), ARGS.torch_python):
        if py and os.access(py, os.X_OK) and subprocess.run(
                [py, "-c", "import torch, torch.distributed"], capture_output=True).returncode == 0:
            return py
    return None


def case_torch_ddp(job):
    """An unmodified PyTorch DDP script (gloo, env://) under 2 agents in restart
    mode, with the default flags (no restart budget): it trains; SIGKILL one
    agent (its worker dies with it: a pod lost) and it restarts at world size
    1 and resumes from its own checkpoint. The survivor's script exits 1 on
    the lost gloo peer; its agent finds the dead pod's agent gone, so the
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
    check("the worker's exit was a lost peer" in a.log(), "the exit taken for a lost peer")
    check(re.search(r"resumed at step \d+, world size 1", a.out()), "the script says it resumed")
    with open(os.path.join(ckpt, "done")) as f:
        step, world, _ = f.read().split()
    check(int(step) == total and world == "1", "finished all %d steps at world size 1" % total)


def main():
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--agent", required=True)
    ap.add_argument("--worker", required=True)
    ap.add_argument("--torch-python")
    ap.add_argument("case")
    ARGS = ap.parse_args()
    fn = globals().get("case_" + ARGS.case)
    if not fn:
        print("no such case: " + ARGS.case, file=sys.stderr)
        return 2
    if not ETCD and ARGS.case != "bad_flags":
        print("DUCTILE_TEST_ETCD is not set (run under with-etcd)", file=sys.stderr)
        return 2
    job = Job("t-" + ARGS.case.replace("_", "-") + "-%d" % os.getpid(), [])
    ok = False
    try:
        ok = run_case(ARGS.case, fn, job)
    finally:
        job.cleanup(keep=ok is False or bool(os.environ.get("AGENT_TEST_KEEP")))
    if ok is None:
        return SKIP
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
