"""agentkit: what the agent's integration tests (tests/agent/) and
bench/agent share.

Standard library only. A Job is one job id in the test etcd (ETCD, from
with-etcd) with its own folder; job.start() runs a real ductile-agent in it
(an Agent: its process, its log files), the test worker (tests/agent/
test_worker.c) as its command unless told otherwise. The workers report
into the folder: job.workers() reads their environments, job.worker_log()
what each heard, job.wait_round() waits for a round of N of them, and
job.command() tells them what to do. Beside them: run_agent (the agent's
subcommands), the job's state as `status` reads it, etcd's keys and
leases (etcd_call, etcd_value, lease_alive), and main, which runs the case
named on the command line. ARGS holds that command line (--agent,
--worker, --torch-python); main, or the bench, sets it.
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
import urllib.request
from testlib import SKIP, Fail, check, pid_alive, run_case, wait_for
from testlib import free_port  # noqa: F401  (bench_agent.py reads it here)

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


def status_of(job):
    r = run_agent(["status", "--rdzv-endpoint", ETCD, "--rdzv-id", job.name, "--json"])
    check(r.returncode == 0, "status exit %d: %s" % (r.returncode, r.stderr))
    return json.loads(r.stdout)


def run_agent(args, env=None, timeout=10):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([ARGS.agent] + args, env=e, capture_output=True, text=True,
                          timeout=timeout)


# Short timings keep the suite fast; they are the agent's own flags.
FAST = ["--lease-ttl", "3", "--last-call", "0.5", "--stop-grace", "2",
        "--shutdown-timeout", "8", "--join-timeout", "60"]


# The sentinels off (failpoint): each agent watches its next members' agents
# and revokes a dead one's lease at once (case_sigkill_pod); a test of what
# else finds a dead pod (its lease, its peers' workers, a takeover) turns
# them off, as when a pod's watchers died with it.
SENTINEL_OFF = {"DUCTILE_FAILPOINTS": "rdzv.sentinel=1+:off"}


def crash_until(job, a, b, how, world, rnd):
    w = workers_of(job, a)[0]
    job.command(w["_pid"], how)
    return job.wait_round(world, 40, newer_than=rnd)


def finish_with(job, agents):
    job.command("all", "exit 0")
    for ag in agents:
        check(ag.wait_exit(30) == 0, "agent %s exits 0 at the job's end:\n%s" % (ag.node, ag.log()))


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


def thread_names(pid):
    """pid's threads: thread id -> name (/proc/PID/task/TID/comm)."""
    names = {}
    for tid in os.listdir("/proc/%d/task" % pid):
        with open("/proc/%d/task/%s/comm" % (pid, tid)) as f:
            names[tid] = f.read().strip()
    return names


def torch_python():
    """The Python with torch installed (make test-torch makes one), or None."""
    for py in (os.environ.get("DUCTILE_TORCH_PYTHON"), ARGS.torch_python):
        if py and os.access(py, os.X_OK) and subprocess.run(
                [py, "-c", "import torch, torch.distributed"], capture_output=True).returncode == 0:
            return py
    return None



def main(cases):
    """Runs the case named on the command line, the case_NAME of cases (a
    dict of name -> function: a case file's globals()), in a fresh Job."""
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--agent", required=True)
    ap.add_argument("--worker", required=True)
    ap.add_argument("--torch-python")
    ap.add_argument("case")
    ARGS = ap.parse_args()
    fn = cases.get("case_" + ARGS.case)
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
