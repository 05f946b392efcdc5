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
from testlib import SKIP, Fail, Skip, check, children, free_port, http_get, pid_alive  # noqa: E402
from testlib import run_case, tcp_open, wait_for  # noqa: E402

ARGS = None
ETCD = os.environ.get("DUCTILE_TEST_ETCD", "")


class Agent:
    def __init__(self, job, node, flags, env_extra=None, cmd=None, raw=None):
        self.job, self.node = job, node
        # Agents started with one node id (a restarted pod, a twin) log apart.
        n = sum(1 for x in job.agents if x.node == node)
        name = node if n == 0 else "%s.%d" % (node, n + 1)
        self.out_path = os.path.join(job.dir, "agent.%s.out" % name)
        self.err_path = os.path.join(job.dir, "agent.%s.err" % name)
        env = dict(os.environ)
        env["AGENT_TEST_DIR"] = job.dir
        # An agent's private directory (its workers' error files) goes with
        # the job's, also when the test kills the agent.
        env["TMPDIR"] = job.dir
        env.update(env_extra or {})
        cmd = [ARGS.agent, "--rdzv-endpoint", ETCD, "--rdzv-id", job.name, "--node-id", node,
               "--node-addr", "127.0.0.1"] + job.flags + flags + ["--"] + (cmd or [ARGS.worker])
        if raw is not None:  # a command line as given (torchrun's); the node by its variables
            env.setdefault("DUCTILE_NODE_ID", node)
            env.setdefault("DUCTILE_NODE_ADDR", "127.0.0.1")
            cmd = [ARGS.agent] + raw
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

    def start_raw(self, node, argv, env=None):
        """An agent run with exactly argv (a torchrun command line)."""
        a = Agent(self, node, [], env, raw=argv)
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


# torchrun's flags (torch 2.x `torchrun --help`).
TORCHRUN_FLAGS = [
    "nnodes", "nproc-per-node", "rdzv-backend", "rdzv-endpoint", "rdzv-id", "rdzv-conf",
    "standalone", "max-restarts", "monitor-interval", "start-method", "event-log-handler",
    "role", "module", "no-python", "run-path", "log-dir", "redirects", "tee",
    "log-line-prefix-template", "local-ranks-filter", "duplicate-stdout-filters",
    "duplicate-stderr-filters", "node-rank", "master-addr", "master-port", "local-addr",
    "logs-specs", "numa-binding", "signals-to-handle", "shutdown-timeout", "virtual-local-rank",
    "print-completion"]


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
        # torchrun's flags are checked as torchrun checks them
        ["--rdzv-conf", "no_such_key=1"], ["--rdzv-conf", "timeout"],
        ["--rdzv-conf", "timeout=x"], ["--rdzv_conf=keep_alive_interval=5000"],
        ["--rdzv-backend", "zookeeper"], ["-r", "4"], ["--tee", "0:x"], ["-t"],
        ["--redirects", "0:1,"], ["--start-method", "thread"], ["--local-ranks-filter", "a"],
        ["--master-port", "70000"], ["--node-rank", "-1"], ["--numa-binding", "cpu"],
        ["--monitor-interval", "soon"], ["-m"], ["-x"], ["-mx"], ["--log-dir="],
        ["--preload", ""], ["--preload="], ["--preload", "1torch"], ["--preload", "torch,"],
        ["--preload", ",torch"], ["--preload", "torch..nn"], ["--preload", "torch.nn."],
        ["--preload", "torch numpy"], ["--preload", "torch;rm"], ["--preload", "x" * 300],
        ["--install-id", "a_b"], ["--install-id", "x" * 65], ["--install-id", "a b"],
        ["--install-id", "a/b"], ["--start-over=maybe"],
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
    # torchrun's PET_* too, and they name theirs.
    for var, val in (("PET_NNODES", "two"), ("PET_RDZV_CONF", "is_host=1,bogus=2"),
                     ("PET_TEE", "9")):
        r = run_agent(base + ["--", "true"], env={var: val})
        check(r.returncode == 2 and r.stderr.startswith("ductile-agent: " + var) and
              len(r.stderr.strip().splitlines()) == 1, "%s: %r" % (var, r.stderr))
    # An unknown --rdzv-conf key names the key and the known ones.
    r = run_agent(base + ["--rdzv-conf", "timeout=60,no_such_key=1", "x.py"])
    check("unknown key 'no_such_key'" in r.stderr and "join_timeout" in r.stderr,
          "rdzv-conf: %r" % r.stderr)
    # -m and --no-python together, or -m after --, are torchrun's errors too.
    for flags in (["-m", "--no-python", "mod"], ["--module", "--", "mod"]):
        r = run_agent(base + flags)
        check(r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1,
              "%s: exit %d %r" % (flags, r.returncode, r.stderr))
    r = run_agent(base + ["--", "true"], env={"DUCTILE_PRELOAD": "torch,,numpy"})
    check(r.returncode == 2 and "DUCTILE_PRELOAD" in r.stderr and len(r.stderr.splitlines()) == 1,
          "env: %r" % r.stderr)
    # --help lists every flag with its variable.
    r = run_agent(["--help"])
    check(r.returncode == 0, "--help exit %d" % r.returncode)
    for flag in ["nnodes", "nproc-per-node", "rdzv-endpoint", "rdzv-id", "max-restarts",
                 "node-id", "node-addr", "lease-ttl", "last-call", "join-timeout",
                 "shutdown-timeout", "rebuild", "standalone", "http-port", "log-format",
                 "leave-exit-code", "hang-timeout", "preload",
                 "etcd-cacert", "etcd-cert", "etcd-key", "etcd-user", "etcd-password"]:
        check("--" + flag in r.stdout, "--help lacks --" + flag)
        check("DUCTILE_" + flag.upper().replace("-", "_") in r.stdout, "--help lacks env of " + flag)
    # ... and every torchrun flag (torch 2.x's list) with its PET_* variable.
    for flag in TORCHRUN_FLAGS:
        check("--" + flag + " " in r.stdout or "--" + flag + "\n" in r.stdout,
              "--help lacks torchrun's --" + flag)
        check("PET_" + flag.upper().replace("-", "_") in r.stdout, "--help lacks PET_ of " + flag)
    for short in ("-m, --module", "-r, --redirects", "-t, --tee"):
        check(short in r.stdout, "--help lacks " + short)
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
    if sentinel:
        env["DUCTILE_RDZV_DEBUG"] = "1"  # says when a sentinel watches a member
    a, b, c = (job.start(n, env=env) for n in ("node-a", "node-b", "node-c"))
    rnd = job.wait_round(3, 60)
    if sentinel:  # a member never seen answering is not judged: watch node-c first
        wait_for(lambda: all("watching member node-c" in x.log() for x in (a, b)), 30,
                 "node-a and node-b to watch node-c")
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
    # The pod's agent first (its workers die with it, PR_SET_PDEATHSIG): a
    # worker killed alone while its agent still answers is that node's own
    # failure, and the peers' exits then count too (the rule's limit).
    workers = workers_of(job, c)
    c.proc.kill()
    for w in workers:
        try:
            os.kill(w["_pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
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


def case_join_timeout(job):
    """Waiting is not failing: an agent that no round could take within
    --join-timeout (too few nodes came, as when the scheduler has placed only
    part of a job) exits 6, the code the chart's podFailurePolicy ignores,
    with one line saying why; so does a survivor whose round lost a member
    and that waits alone below --nnodes' minimum."""
    flags = ["--lease-ttl", "3", "--last-call", "0.5", "--stop-grace", "2",
             "--shutdown-timeout", "8", "--join-timeout", "2", "--max-restarts", "0"]
    lone = job.start("node-a", flags=flags + ["--nnodes", "2"])
    check(lone.wait_exit(30) == 6, "a lone agent of --nnodes 2 exits 6:\n" + lone.log())
    last = lone.log().strip().splitlines()[-1]
    check("exiting with code 6: no round froze within the join timeout" in last and
          "too few nodes" in last,
          "one line with the reason: %r" % last)
    check(not job.workers(), "no worker started")
    # A survivor: the round of two formed, one pod is lost, and no one comes.
    b = job.start("node-b", flags=flags + ["--nnodes", "2"])
    c = job.start("node-c", flags=flags + ["--nnodes", "2"])
    job.wait_round(2, 60)
    c.proc.kill()
    check(b.wait_exit(40) == 6, "the survivor exits 6:\n" + b.log())
    last = b.log().strip().splitlines()[-1]
    check("exiting with code 6: no round froze within the join timeout" in last,
          "why: %r" % last)
    check(job_restarts(job) == 0, "no restart counted")


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


def case_install_id(job):
    """A job's end records the install id of the agents that ended it. Agents
    of another install (a new Helm release under the same job id, whose etcd
    kept the old state) are refused with exit 2 and one line, training
    nothing; with --start-over they delete the old keys and train it again,
    several at once safely. Agents of the same install (a replacement pod)
    still find the job done and exit 0, as do agents without an install id."""
    job.flags += FAST + ["--nnodes", "2"]
    a = job.start("node-a", flags=["--install-id", "inst-A"])
    b = job.start("node-b", env={"DUCTILE_INSTALL_ID": "inst-A"})
    job.wait_round(2, 60)
    finish_with(job, (a, b))
    state, _ = etcd_value(job, "state")
    check(state == {"state": "done", "reason": "", "install": "inst-A"},
          "the end records the install: %r" % state)
    check(status_of(job).get("install") == "inst-A", "status shows the install")
    r = run_agent(["status", "--rdzv-endpoint", ETCD, "--rdzv-id", job.name])
    check(r.returncode == 0 and "\ninstall: inst-A " in r.stdout, "status text: %r" % r.stdout)
    done = len(job.workers())
    # Another install: refused, one line naming both installs and the way out.
    for ag in (job.start("node-a", flags=["--install-id", "inst-B"]),
               job.start("node-b", env={"DUCTILE_INSTALL_ID": "inst-B"})):
        check(ag.wait_exit(30) == 2, "another install exits 2:\n%s" % ag.log())
        lines = [ln for ln in ag.log().splitlines() if "inst-A" in ln]
        check(len(lines) == 1 and "earlier install (install inst-A); this is install inst-B"
              in lines[0] and "job.startOver=true" in lines[0], "the reason: %r" % ag.log())
    check(len(job.workers()) == done, "another install trained nothing")
    check(etcd_value(job, "state")[0] == state, "a refused install changed nothing")
    # The same install (a pod replaced after the end), and no install id: done.
    for flags in (["--install-id", "inst-A"], ["--install-id", "inst-A", "--start-over"], []):
        ag = job.start("node-c", flags=flags)
        check(ag.wait_exit(30) == 0 and "already complete" in ag.log(),
              "%s: exits 0 on a done job:\n%s" % (flags, ag.log()))
    check(len(job.workers()) == done, "nothing trained again")
    check(etcd_value(job, "state")[0] == state, "this install's end is never started over")
    # Start over: three agents at once; one deletes, all train the new job.
    os.remove(os.path.join(job.dir, "cmd.all"))
    job.flags[job.flags.index("--nnodes") + 1] = "3"
    agents = [job.start("node-%d" % i, flags=["--install-id", "inst-B", "--start-over"])
              for i in range(2)]
    agents.append(job.start("node-2", flags=["--install-id", "inst-B"],
                            env={"DUCTILE_START_OVER": "true"}))
    rnd = job.wait_round(3, 60)
    check(rnd == 1, "the job starts over at round 1, got %d" % rnd)
    logs = [ag.log() for ag in agents]
    check(sum("starts over" in lg for lg in logs) == 1,
          "one agent deleted the old keys:\n%s" % "\n".join(logs))
    check(status_of(job)["job_state"] == "running", "the job runs again")
    finish_with(job, agents)
    check(etcd_value(job, "state")[0] == {"state": "done", "reason": "", "install": "inst-B"},
          "the new end records install inst-B")
    # A failed end is refused the same way.
    check(run_agent(["reset", "--rdzv-endpoint", ETCD, "--rdzv-id", job.name]).returncode == 0,
          "reset")
    etcd_call("/v3/kv/put", {
        "key": base64.b64encode(("/ductile/%s/state" % job.name).encode()).decode(),
        "value": base64.b64encode(json.dumps(
            {"state": "failed", "reason": "x", "install": "inst-B"}).encode()).decode()})
    ag = job.start("node-a", flags=["--install-id", "inst-C"])
    check(ag.wait_exit(30) == 2 and "ended (failed) in an earlier install" in ag.log(),
          "a failed end elsewhere: exit 2:\n%s" % ag.log())


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


def thread_names(pid):
    """pid's threads: thread id -> name (/proc/PID/task/TID/comm)."""
    names = {}
    for tid in os.listdir("/proc/%d/task" % pid):
        with open("/proc/%d/task/%s/comm" % (pid, tid)) as f:
            names[tid] = f.read().strip()
    return names


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


class EventSink:
    """A stand-in for the Kubernetes API server on 127.0.0.1: records every
    POST (path, Authorization header, JSON body) and answers `status`."""

    def __init__(self):
        import http.server
        import threading
        sink = self
        self.posts, self.status = [], 201

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                try:
                    obj = json.loads(body)
                except ValueError:
                    obj = None
                sink.posts.append((self.path, self.headers.get("Authorization"), obj))
                self.send_response(sink.status)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b"{}" if sink.status == 201 else b"not json")

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = "http://127.0.0.1:%d" % self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def events(self, reason=None):
        return [b for _, _, b in self.posts if b and (reason is None or b.get("reason") == reason)]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def case_k8s_events(job):
    sink = EventSink()
    token = os.path.join(job.dir, "token")
    with open(token, "w") as f:
        f.write("secret-token\n")
    env = {"DUCTILE_K8S_API": sink.url, "DUCTILE_K8S_TOKEN_FILE": token,
           "DUCTILE_K8S_NAMESPACE": "ml", "DUCTILE_K8S_JOB_NAME": "train-worker",
           "DUCTILE_K8S_JOB_UID": "0b5c7a38-uid"}
    others = []
    try:
        # Off (the default): the same settings, a round and a failure, nothing posted.
        off = Job(job.name + "-off", FAST + ["--nnodes", "1", "--max-restarts", "3"])
        others.append(off)
        a = off.start("node-a", env=env)
        r1 = off.wait_round(1, 60)
        off.command(workers_of(off, a)[0]["_pid"], "exit 1")
        off.wait_round(1, 40, newer_than=r1)
        wait_for(lambda: "failure recorded" in a.log(), 20, "the failure recorded")
        a.signal(signal.SIGTERM)
        a.wait_exit(30)
        check(sink.posts == [], "no Events without --k8s-events: %r" % sink.posts)

        # On: a round, a failure counted, the job failed; node rank 0 speaks for rounds.
        job.flags += FAST + ["--nnodes", "2", "--max-restarts", "1", "--k8s-events"]
        a, b = job.start("node-a", env=env), job.start("node-b", env=env)
        r1 = job.wait_round(2, 60)
        wait_for(lambda: sink.events("RoundFormed"), 20, "RoundFormed posted")
        ev = sink.events("RoundFormed")[0]
        check(ev["involvedObject"] == {"apiVersion": "batch/v1", "kind": "Job",
                                       "name": "train-worker", "namespace": "ml",
                                       "uid": "0b5c7a38-uid"}, "involvedObject: %r" % ev)
        check(ev["type"] == "Normal" and ev["kind"] == "Event" and
              ev["metadata"]["namespace"] == "ml" and
              ev["metadata"]["generateName"] == "train-worker.", "event: %r" % ev)
        check(re.match(r"round %d formed with 2 nodes, world size 2" % r1, ev["message"]),
              "RoundFormed message: " + ev["message"])
        path, auth, _ = sink.posts[0]
        check(path == "/api/v1/namespaces/ml/events" and auth == "Bearer secret-token",
              "posted to %s with %r" % (path, auth))
        r2 = crash_until(job, b, a, "exit 1", 2, r1)
        wait_for(lambda: sink.events("RestartCounted") and sink.events("WorkerFailed") and
                 len(sink.events("RoundFormed")) >= 2, 20,
                 "RestartCounted, WorkerFailed and a second RoundFormed: %r" % sink.posts)
        rc = sink.events("RestartCounted")[0]
        check(rc["type"] == "Warning" and "restarts now 1 of 1" in rc["message"] and
              "exited with code 1" in rc["message"] and rc["source"]["host"] == "node-b",
              "RestartCounted: %r" % rc)
        wf = sink.events("WorkerFailed")[0]
        check(wf["type"] == "Warning" and wf["message"].startswith("round %d ended" % r1),
              "WorkerFailed: %r" % wf)
        check(sink.events("RoundFormed")[-1]["message"].startswith("round %d formed" % r2),
              "second round's Event")
        # One Event per change: the round's Events come from node rank 0 alone.
        check(len(sink.events("RoundFormed")) == 2 and len(sink.events("WorkerFailed")) == 1,
              "no duplicates: %r" % [e["reason"] for e in sink.events()])
        job.command(workers_of(job, a)[0]["_pid"], "exit 1")
        for ag in (a, b):
            check(ag.wait_exit(40) != 0, "job failed")
        failed = sink.events("JobFailed")
        check(len(failed) == 1 and failed[0]["type"] == "Warning" and
              failed[0]["message"].startswith("job failed: restart limit") and
              failed[0]["source"]["host"] == sink.events("RoundFormed")[-1]["source"]["host"],
              "JobFailed, from node rank 0: %r" % failed)

        # An API server that refuses: logged once, training unaffected.
        sink.status = 403
        n = len(sink.posts)
        bad = Job(job.name + "-bad", FAST + ["--nnodes", "1", "--max-restarts", "3",
                                             "--k8s-events"])
        others.append(bad)
        c = bad.start("node-c", env=env)
        r1 = bad.wait_round(1, 60)
        bad.command(workers_of(bad, c)[0]["_pid"], "exit 1")
        bad.wait_round(1, 40, newer_than=r1)
        # Tried all the same: two rounds formed, a restart counted, a round ended.
        wait_for(lambda: len(sink.posts) >= n + 4, 20, "four refused posts")
        bad.command("all", "exit 0")
        check(c.wait_exit(40) == 0, "the job completes: " + c.log())
        check(c.log().count("k8s_events_failed") + c.log().count("cannot post Kubernetes") == 1,
              "the refusal logged once: " + c.log())
        # A node joins, then leaves: node rank 0 says so.
        sink.status = 201
        grow = Job(job.name + "-grow", FAST + ["--nnodes", "1:2", "--k8s-events"])
        others.append(grow)
        d = grow.start("node-d", env=env)
        r1 = grow.wait_round(1, 60)
        e = grow.start("node-e", env=env)
        grow.wait_round(2, 60, newer_than=r1)
        wait_for(lambda: sink.events("NodeJoined"), 20, "NodeJoined posted")
        joined = sink.events("NodeJoined")[0]
        check(joined["type"] == "Normal" and joined["source"]["host"] == "node-d" and
              joined["message"].startswith("round %d ended" % r1), "NodeJoined: %r" % joined)
        e.signal(signal.SIGTERM)
        check(e.wait_exit(30) == 0, "node-e left")
        wait_for(lambda: sink.events("NodeLeft"), 20, "NodeLeft posted")
        left = sink.events("NodeLeft")[0]
        check(left["source"]["host"] == "node-d" and "node-e" in left["message"],
              "NodeLeft: %r" % left)
        d.signal(signal.SIGTERM)
        d.wait_exit(30)
        # Incomplete settings: one line, exit 2.
        r = run_agent(["--rdzv-endpoint", ETCD, "--rdzv-id", job.name + "-cfg", "--k8s-events",
                       "--", ARGS.worker], env={"DUCTILE_K8S_API": sink.url,
                                                "DUCTILE_K8S_NAMESPACE": "ml"})
        check(r.returncode == 2 and "DUCTILE_K8S_JOB_NAME" in r.stderr and
              len(r.stderr.strip().splitlines()) == 1, "no job name: %d %s" %
              (r.returncode, r.stderr))
    finally:
        for o in others:
            o.cleanup(keep=False)
        sink.close()


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


# ---------------------------------------------------------------------------
# torchrun's command lines, as PyTorch's elastic docs (torchrun quickstart and
# usage) give them, run unchanged with tests/agent/torchrun_train.py standing in
# for YOUR_TRAINING_SCRIPT.py. The node's id and address come from variables
# (DUCTILE_NODE_ID/ADDR), as one machine runs several nodes.

TRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchrun_train.py")


def train_records(job):
    """What every run of the training script saw: {(rank, restart): record}."""
    out = {}
    for name in os.listdir(job.dir):
        m = re.fullmatch(r"py\.(\d+)\.(\d*)\.json", name)
        if m:
            with open(os.path.join(job.dir, name)) as f:
                out[(int(m.group(1)), m.group(2))] = json.load(f)
    return out


def host_port(url):
    return url.split("://", 1)[-1]


def check_world(job, world, restart="0", argv=None, max_restarts=None):
    recs = {r: v for (r, rs), v in train_records(job).items() if rs == restart}
    check(sorted(recs) == list(range(world)),
          "ranks %s ran attempt %s, want 0..%d" % (sorted(recs), restart, world - 1))
    for r, v in recs.items():
        check(v["WORLD_SIZE"] == str(world), "rank %d: WORLD_SIZE %s" % (r, v["WORLD_SIZE"]))
        check(v["argv"][0] == TRAIN, "rank %d: run as a script: %r" % (r, v["argv"]))
        if argv is not None:
            check(v["argv"][1:] == argv, "rank %d: argv %r" % (r, v["argv"]))
        if max_restarts is not None:
            check(v["TORCHELASTIC_MAX_RESTARTS"] == str(max_restarts),
                  "rank %d: TORCHELASTIC_MAX_RESTARTS %s" % (r, v["TORCHELASTIC_MAX_RESTARTS"]))
    return recs


def case_torchrun_docs(job):
    ep = host_port(ETCD)  # torchrun's HOST_NODE_ADDR form: host:port
    # Single-node multi-worker:
    #   torchrun --standalone --nnodes=1 --nproc-per-node=$NUM_TRAINERS
    #       YOUR_TRAINING_SCRIPT.py (--arg1 ... train script args...)
    args = ["--arg1", "a b", "--epochs=2", "-v"]
    a = job.start_raw("solo", ["--standalone", "--nnodes=1", "--nproc-per-node=2", TRAIN] + args,
                      env={"TEST_ARGV": json.dumps(args)})
    check(a.wait_exit(90) == 0, "standalone: exit %s\n%s" % (a.proc.returncode, a.log()))
    check_world(job, 2, argv=args)
    out = a.out()
    check("[0] stdout of rank 0" in out and "[1] stdout of rank 1" in out, "output: %r" % out)
    for name in os.listdir(job.dir):
        if name.startswith("py."):
            os.unlink(os.path.join(job.dir, name))
    # Fault tolerant (fixed sized nodes, restarts), two nodes; the first attempt
    # fails (rank 1 exits 1) and the job restarts:
    #   torchrun --nnodes=$NUM_NODES --nproc-per-node=$NUM_TRAINERS --max-restarts=3
    #       --rdzv-id=$JOB_ID --rdzv-backend=c10d --rdzv-endpoint=$HOST_NODE_ADDR
    #       YOUR_TRAINING_SCRIPT.py
    cmd = ["--nnodes=2", "--nproc-per-node=2", "--max-restarts=3", "--rdzv-id=%s" % job.name,
           "--rdzv-backend=c10d", "--rdzv-endpoint=%s" % ep, TRAIN]
    env = {"TEST_FAIL": "once", "TEST_ARGV": "[]", "DUCTILE_LAST_CALL": "0.5"}
    nodes = [job.start_raw(n, cmd, env=env) for n in ("node-a", "node-b")]
    for n in nodes:
        check(n.wait_exit(120) == 0, "fault tolerant: %s exit %s\n%s" %
              (n.node, n.proc.returncode, n.log()))
    check_world(job, 4, restart="1", max_restarts=3)
    check((1, "0") in train_records(job), "the first attempt ran (and failed)")
    check("--rdzv-backend c10d: the rendezvous is etcd" in nodes[0].log(),
          "the backend note: %s" % nodes[0].log())
    # Elastic (min=1, max=4, tolerates up to 3 membership changes or failures):
    #   torchrun --nnodes=1:4 --nproc-per-node=$NUM_TRAINERS --max-restarts=3
    #       --rdzv-id=$JOB_ID --rdzv-backend=c10d --rdzv-endpoint=$HOST_NODE_ADDR
    #       YOUR_TRAINING_SCRIPT.py
    job2 = job.name + "-elastic"
    cmd = ["--nnodes=1:4", "--nproc-per-node=2", "--max-restarts=3", "--rdzv-id=%s" % job2,
           "--rdzv-backend=c10d", "--rdzv-endpoint=%s" % ep, TRAIN]
    for name in os.listdir(job.dir):
        if name.startswith("py."):
            os.unlink(os.path.join(job.dir, name))
    nodes = [job.start_raw(n, cmd, env={"DUCTILE_LAST_CALL": "3"}) for n in ("el-a", "el-b")]
    for n in nodes:
        check(n.wait_exit(120) == 0, "elastic: %s exit %s\n%s" % (n.node, n.proc.returncode,
                                                                   n.log()))
    recs = train_records(job)
    check(recs and all(v["TORCHELASTIC_RUN_ID"] == job2 for v in recs.values()), "run id")
    # The static rendezvous form (torchrun's and torch.distributed.launch's
    # --node-rank/--master-addr/--master-port): the ranks come from etcd
    # (given by variable here), the static flags are logged as ignored.
    #   torchrun --nproc-per-node=2 --nnodes=1 --node-rank=0 --master-addr=127.0.0.1
    #       --master-port=29500 YOUR_TRAINING_SCRIPT.py
    for name in os.listdir(job.dir):
        if name.startswith("py."):
            os.unlink(os.path.join(job.dir, name))
    s = job.start_raw("static", ["--nproc-per-node=2", "--nnodes=1", "--node-rank=0",
                                 "--master-addr=127.0.0.1", "--master-port=29500", TRAIN],
                      env={"DUCTILE_RDZV_ENDPOINT": ETCD, "DUCTILE_RDZV_ID": job.name + "-static",
                           "DUCTILE_LAST_CALL": "0.2"})
    check(s.wait_exit(90) == 0, "static form: exit %s\n%s" % (s.proc.returncode, s.log()))
    check_world(job, 2)
    for flag in ("--node-rank", "--master-addr", "--master-port"):
        check(len(re.findall(re.escape(flag) + " is ignored", s.log())) == 1,
              "%s noted once: %s" % (flag, s.log()))


def case_torchrun_pet(job):
    """A PyTorchJob's PET_* variables drive agents given no flags at all."""
    pet = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_RDZV_ENDPOINT": host_port(ETCD),
           "PET_RDZV_ID": job.name, "PET_RDZV_BACKEND": "c10d", "PET_MAX_RESTARTS": "2",
           "PET_MASTER_ADDR": "job-master-0", "PET_MASTER_PORT": "23456",
           "PET_NODE_RANK": "0", "PET_RDZV_CONF": "last_call_timeout=0.5,read_timeout=60",
           "PYTHONPATH": os.path.dirname(TRAIN), "TEST_ARGV": '["--lr", "0.1"]'}
    a = job.start_raw("pod-0", [TRAIN, "--lr", "0.1"], env=pet)
    # The second pod: -m from PET_MODULE, and DUCTILE_* over PET_* (one worker).
    b = job.start_raw("pod-1", ["torchrun_train", "--lr", "0.1"],
                      env=dict(pet, PET_MODULE="1", DUCTILE_NPROC_PER_NODE="1",
                               PET_NODE_RANK="1"))
    for n in (a, b):
        check(n.wait_exit(90) == 0, "%s exit %s\n%s" % (n.node, n.proc.returncode, n.log()))
    recs = train_records(job)
    check(sorted(r for r, _ in recs) == [0, 1, 2], "world of 3 (2 + 1): %s" % sorted(recs))
    for v in recs.values():
        check(v["WORLD_SIZE"] == "3" and v["TORCHELASTIC_MAX_RESTARTS"] == "2",
              "PET_* read: %r" % v)
        check(v["MASTER_ADDR"] == "127.0.0.1", "MASTER_ADDR from the rendezvous: %r" % v)
    by_module = [v for v in recs.values() if v["LOCAL_WORLD_SIZE"] == "1"]
    check(len(by_module) == 1 and by_module[0]["argv"][0].endswith("torchrun_train.py"),
          "-m ran the module: %r" % by_module)
    check("PET_MASTER_ADDR is ignored" in a.log() and "read_timeout ignored" in a.log(),
          "notes: %s" % a.log())


def torchrun_files(base):
    """{relative path: text} of every file under base."""
    out = {}
    for root, _, names in os.walk(base):
        for n in names:
            p = os.path.join(root, n)
            with open(p) as f:
                out[os.path.relpath(p, base)] = f.read()
    return out


def case_torchrun_logs(job):
    logs = os.path.join(job.dir, "logs")
    # Local rank 0: stderr to its file only; local rank 1: both streams to the
    # files and the console.
    a = job.start_raw("node-a", ["--rdzv-endpoint", ETCD, "--rdzv-id", job.name,
                                 "--nproc-per-node", "2", "--log-dir", logs, "-r", "0:2",
                                 "--tee=1:3", "--last-call", "0.2", TRAIN])
    check(a.wait_exit(90) == 0, "exit %s\n%s" % (a.proc.returncode, a.log()))
    runs = os.listdir(logs)
    check(len(runs) == 1 and re.fullmatch(re.escape(job.name) + r"_\w{6}", runs[0]),
          "one run directory JOB_XXXXXX: %r" % runs)
    files = torchrun_files(os.path.join(logs, runs[0]))
    check(sorted(files) == ["attempt_0/0/stderr.log", "attempt_0/1/stderr.log",
                            "attempt_0/1/stdout.log"], "files: %r" % sorted(files))
    check(files["attempt_0/0/stderr.log"] == "stderr of rank 0\n", "0/stderr.log: %r" % files)
    check(files["attempt_0/1/stdout.log"] == "stdout of rank 1\n", "1/stdout.log: %r" % files)
    check(files["attempt_0/1/stderr.log"] == "stderr of rank 1\n", "1/stderr.log: %r" % files)
    out, err = a.out(), a.log()
    check("[0] stdout of rank 0" in out and "[1] stdout of rank 1" in out, "stdout: %r" % out)
    check("stderr of rank 0" not in err and "[1] stderr of rank 1" in err, "stderr: %r" % err)
    recs = train_records(job)
    check(recs[(0, "0")]["TORCHELASTIC_ERROR_FILE"] ==
          os.path.join(logs, runs[0], "attempt_0", "0", "error.json"), "error file: %r" % recs)
    # --local-ranks-filter: the console shows rank 1 only; the files keep both.
    logs2 = os.path.join(job.dir, "logs2")
    b = job.start_raw("node-b", ["--rdzv-endpoint", ETCD, "--rdzv-id", job.name + "-f",
                                 "--nproc_per_node=2", "--log_dir=" + logs2, "--tee", "3",
                                 "--local-ranks-filter", "1", "--last-call", "0.2", TRAIN])
    check(b.wait_exit(90) == 0, "exit %s\n%s" % (b.proc.returncode, b.log()))
    files = torchrun_files(logs2)
    check(len(files) == 4 and all(t.endswith("of rank %s\n" % p.split(os.sep)[-2])
                                  for p, t in files.items()), "files: %r" % files)
    out, err = b.out(), b.log()
    check("of rank 0" not in out + err and "[1] stdout of rank 1" in out and
          "[1] stderr of rank 1" in err, "console: %r %r" % (out, err))


def case_torchrun_error_file(job):
    """torch's @record error file: its message ends the failure line."""
    tmp = os.path.join(job.dir, "tmp")
    os.mkdir(tmp)
    a = job.start_raw("node-a", ["--rdzv-endpoint", ETCD, "--rdzv-id", job.name,
                                 "--nproc-per-node", "2", "--last-call", "0.2", TRAIN],
                      env={"TEST_FAIL": "error", "TMPDIR": tmp})
    code = a.wait_exit(90)
    check(code == 3, "the job failed: exit %d\n%s" % (code, a.log()))
    lines = [l for l in a.log().splitlines() if "exiting with code 3" in l]
    check(len(lines) == 1 and
          "worker rank 1 exited with code 1: RuntimeError: rank 1 gave up" in lines[0],
          "the failure line: %r" % lines)
    check("second line" not in a.log(), "only the message's first line")
    check(os.listdir(tmp) == [], "the private error-file directory removed: %r" % os.listdir(tmp))


# ---- warm spares (--preload): tests/agent/warm_worker.py and warm_marker.py ----

WARM_DIR = os.path.dirname(os.path.abspath(__file__))
WARM_SCRIPT = os.path.join(WARM_DIR, "warm_worker.py")


def warm_python():
    """This Python under a name the agent takes for an interpreter."""
    if re.fullmatch(r"python[0-9.]*", os.path.basename(sys.executable)):
        return sys.executable
    return shutil.which("python3")


def warm_files(job, prefix):
    """The JSON records named PREFIX.PID[.json] in the job's folder."""
    out = []
    for name in os.listdir(job.dir):
        if re.fullmatch(re.escape(prefix) + r"\.\d+(\.json)?", name):
            with open(os.path.join(job.dir, name)) as f:
                out.append(json.load(f))
    return out


def warm_plain(argv):
    """What warm_worker.py reports under a plain `python ARGS...`, started
    from the agents' folder."""
    env = dict(os.environ, WARM_WORKER_PLAIN="1", PYTHONPATH=WARM_DIR)
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
    check(r.returncode == 0, "plain run of %s: %s" % (argv, r.stderr))
    return json.loads(r.stdout)


def warm_spares(job, agents):
    """Each agent's spare: a live child that imported warm_marker and is no
    worker (a pid no worker record has); None until every agent has one."""
    worker_pids = {r["pid"] for r in warm_files(job, "ww")}
    found = {}
    for m in warm_files(job, "marker"):
        if m["pid"] not in worker_pids and pid_alive(m["pid"]) and \
                m["pid"] in children(m["ppid"]):
            found[m["ppid"]] = m
    return found if all(a.proc.pid in found for a in agents) else None


def warm_spare_killed(job, ag):
    """SIGKILLs ag's spare and returns the one its agent starts instead."""
    first = wait_for(lambda: warm_spares(job, [ag]), 60, "a spare")[ag.proc.pid]
    os.kill(first["pid"], signal.SIGKILL)

    def other():
        s = warm_spares(job, [ag])
        return s and s[ag.proc.pid]["pid"] != first["pid"] and s[ag.proc.pid]
    again = wait_for(other, 60, "a spare started again after %d was killed" % first["pid"])
    check("the warm interpreter %d was killed by SIGKILL" % first["pid"] in ag.log(),
          "the agent reaped its spare as one:\n" + ag.log())
    return again


def warm_round(job, world, newer_than=0):
    """The newest round above newer_than whose `world` workers all wrote a
    record, as (round, records), or None."""
    by_round = {}
    for r in warm_files(job, "ww"):
        by_round.setdefault(int(r["DUCTILE_ROUND"]), []).append(r)
    rounds = [n for n, rs in by_round.items() if n > newer_than and len(rs) == world]
    return (max(rounds), by_round[max(rounds)]) if rounds else None


def check_adopted(rec, spare, plain, killed_at, what):
    """rec, a worker's record, is the spare's process running the script as
    plainly as `plain` did, with its round's environment only."""
    check(rec["pid"] == spare["pid"], "%s: worker pid %d, want the spare's %d" %
          (what, rec["pid"], spare["pid"]))
    check(spare["time"] < killed_at, "%s: the spare imported its modules before the kill" % what)
    check(spare["RANK"] is None, "%s: no RANK at import time, got %r" % (what, spare["RANK"]))
    check(spare["modules"] == "warm_marker", "%s: DUCTILE_PRELOAD_MODULES %r" %
          (what, spare["modules"]))
    check(rec["marker"], "%s: warm_marker was imported before the script ran" % what)
    for k in ("argv", "path0", "name", "dont_write_bytecode"):
        check(rec[k] == plain[k], "%s: %s %r, a plain run has %r" % (what, k, rec[k], plain[k]))
    check(rec["WARM_MARKER_STALE"] is None, "%s: a variable set before adoption survived" % what)
    check(rec["DUCTILE_PRELOAD_MODULES"] is None, "%s: the spare's own variable survived" % what)
    check(rec["ctl_open"] and rec["DUCTILE_CONTROL_FD"] == "3", "%s: control channel at fd 3" % what)
    check(not rec["fd4_open"], "%s: the go pipe is closed before the script runs" % what)


def warm_kill_restart(job, agents, world, victim):
    """Waits for a round and every agent's spare, SIGKILLs victim's worker
    and returns (spares before the kill, kill time, new round, its records)."""
    r1, _ = wait_for(lambda: warm_round(job, world), 60, "the first round's workers")
    spares = wait_for(lambda: warm_spares(job, agents), 60, "a warm spare beside each worker")
    victim_pid = [r["pid"] for r in warm_files(job, "ww")
                  if int(r["DUCTILE_ROUND"]) == r1 and r["ppid"] == victim.proc.pid][0]
    killed_at = time.time()
    os.kill(victim_pid, signal.SIGKILL)
    r2, recs = wait_for(lambda: warm_round(job, world, newer_than=r1), 60,
                        "the restarted round's workers")
    return spares, killed_at, r2, recs


def warm_alone(job, name, preload, cmd, flags=None):
    """A job of one agent, apart from `job`, running cmd; returns (job, agent)."""
    j = Job(job.name + "-" + name, FAST + ["--nnodes", "1", "--preload", preload] + (flags or []))
    job.agents_elsewhere.append(j)
    return j, j.start("node-a", env={"PYTHONPATH": WARM_DIR}, cmd=cmd)


def case_warm_spare(job):
    """--preload: a restart adopts a warm spare. Two agents run a Python
    script by restart; each keeps a spare that imported warm_marker (which
    records its pid). SIGKILL one worker: the next round's workers are
    exactly those spares, and the script sees what a plain `python3 -B
    SCRIPT ARGS` sees, with the new round's variables and nothing the spare
    had before. Its exit status is its own; spares go with their agent. The
    same by -m; none with --preload none, nor for `python3 -c`."""
    py = warm_python()
    check(py, "no python3")
    job.agents_elsewhere = []
    failed = True
    try:
        warm_spare_cases(job, py)
        failed = False
    finally:
        for j in job.agents_elsewhere:
            j.cleanup(keep=failed or bool(os.environ.get("AGENT_TEST_KEEP")))


def warm_spare_cases(job, py):
    args = ["one", "two words"]
    cmd = [py, "-B", WARM_SCRIPT] + args
    plain = warm_plain(cmd)
    job.flags += FAST + ["--nnodes", "2", "--max-restarts", "1", "--preload", "warm_marker"]
    # RANK in the agents' own environment: a stale value no worker may see.
    env = {"PYTHONPATH": WARM_DIR, "RANK": "99"}
    a, b = job.start("node-a", env=env, cmd=cmd), job.start("node-b", env=env, cmd=cmd)
    spares, killed_at, r2, recs = warm_kill_restart(job, [a, b], 2, a)
    check(sorted(r["RANK"] for r in recs) == ["0", "1"], "ranks 0 and 1: %r" % recs)
    for rec in recs:
        node = "node-a" if rec["ppid"] == a.proc.pid else "node-b"
        check(rec["WORLD_SIZE"] == "2", "%s: WORLD_SIZE %r" % (node, rec["WORLD_SIZE"]))
        check_adopted(rec, spares[rec["ppid"]], plain, killed_at, node)
    for ag in (a, b):
        check(re.search(r"round %d: started 1 workers, ranks \d\.\.\d \(1 from a warm "
                        r"interpreter: warm_marker preloaded\)" % r2, ag.log()),
              "%s logs the adoption:\n%s" % (ag.node, ag.log()))
    # What the adopted worker prints is passed through with its rank.
    for rec in recs:
        wait_for(lambda: "[%s] warm worker %d in round %d" % (rec["RANK"], rec["pid"], r2)
                 in a.out() + b.out(), 10, "the adopted worker's output, prefixed")
    # The next restart's spares are ready again.
    wait_for(lambda: warm_spares(job, [a, b]), 60, "new spares after the restart")
    # The script's exit status is its own: 7 is a failure, the restart budget is spent.
    spare_pids = [m["pid"] for m in warm_files(job, "marker")]
    job.command("all", "exit 7")
    for ag in (a, b):
        check(ag.wait_exit(30) == 3, "agent %s: job failed, exit 3:\n%s" % (ag.node, ag.log()))
    check("exited with code 7" in a.log() + b.log(), "a worker exited with code 7")
    left = [p for p in spare_pids if pid_alive(p)]
    check(not left, "spares outlived their agent: %s" % left)

    # python -m MODULE: the module's file is argv[0], the folder it runs in sys.path[0].
    mcmd = [py, "-m", "warm_worker", "m-arg"]
    mplain = warm_plain(mcmd)
    j, m = warm_alone(job, "module", "warm_marker", mcmd, ["--max-restarts", "2"])
    r1, _ = wait_for(lambda: warm_round(j, 1), 60, "-m: the first round's worker")
    # A spare that dies is reaped as no worker (the round goes on) and started again.
    second = warm_spare_killed(j, m)
    check(warm_round(j, 1)[0] == r1 and len(warm_files(j, "ww")) == 1,
          "-m: a spare's death ended the round:\n" + m.log())
    check("stopping the other workers" not in m.log(), "-m: a spare taken for a worker")
    killed_at = time.time()
    os.kill(warm_files(j, "ww")[0]["pid"], signal.SIGKILL)
    r2, recs = wait_for(lambda: warm_round(j, 1, newer_than=r1), 60, "-m: the restarted worker")
    check_adopted(recs[0], second, mplain, killed_at, "-m")
    # Started again once a round: after two deaths the next restart starts cold.
    fourth = warm_spare_killed(j, m)
    markers = len(warm_files(j, "marker"))
    os.kill(fourth["pid"], signal.SIGKILL)
    time.sleep(2)  # a spare is started again as soon as its death is reaped
    check(len(warm_files(j, "marker")) == markers and not warm_spares(j, [m]),
          "-m: a third spare in one round:\n" + m.log())
    os.kill(recs[0]["pid"], signal.SIGKILL)
    r3, recs = wait_for(lambda: warm_round(j, 1, newer_than=r2), 60, "-m: the cold worker")
    check(not recs[0]["marker"], "-m: the worker after two spare deaths started cold")
    check("round %d: started 1 workers, ranks 0..0 (0 from a warm interpreter" % r3 in m.log(),
          "-m: the launch says it started cold:\n" + m.log())
    j.command("all", "exit 0")
    check(m.wait_exit(30) == 0, "-m: the job completes:\n%s" % m.log())

    # --preload none, and a command that is no script: no spare, the worker alone.
    code = "import runpy; runpy.run_path(%r, run_name='__main__')" % WARM_SCRIPT
    for name, preload, c, why in (
            ("none", "none", [py, "-B", WARM_SCRIPT], None),
            ("dash-c", "warm_marker", [py, "-c", code],
             "no warm interpreters despite --preload warm_marker: the command runs python -c")):
        j, n = warm_alone(job, name, preload, c)
        _, recs = wait_for(lambda: warm_round(j, 1), 60, name + ": the worker")
        time.sleep(1)  # a spare would be started right after the launch
        check(children(n.proc.pid) == [recs[0]["pid"]], "%s: the agent's children are %s, "
              "want its worker %d only" % (name, children(n.proc.pid), recs[0]["pid"]))
        check(not recs[0]["marker"] and not warm_files(j, "marker"), name + ": nothing preloaded")
        check("warm interpreter" not in n.log() or why, name + ": no spare: " + n.log())
        check(why is None or why in n.log(), "%s: the log says why: %s" % (name, n.log()))
        j.command("all", "exit 0")
        check(n.wait_exit(30) == 0, "%s: the job completes:\n%s" % (name, n.log()))



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


def main(cases=None):
    """Runs the case named on the command line: a case_NAME of cases (a
    module's globals(): torch_test.py's) or of this module."""
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--agent", required=True)
    ap.add_argument("--worker", required=True)
    ap.add_argument("--torch-python")
    ap.add_argument("case")
    ARGS = ap.parse_args()
    fn = (cases or globals()).get("case_" + ARGS.case)
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
