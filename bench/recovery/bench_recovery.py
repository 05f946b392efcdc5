#!/usr/bin/env python3
"""bench_recovery.py: time from a membership event to the first completed
training step at the new size, for 4 agents on 127.0.0.1.

Events: a worker SIGKILLed (size stays 4), an agent SIGKILLed with its worker
(4 -> 3), an agent SIGTERMed (scale-down, 4 -> 3), a new agent (3 -> 4), a
worker SIGSTOPped (hung with its sockets open; size stays 4: ductile's agents
run with --hang-timeout 10), and a pod restarted with its own node id (the
agent and its worker SIGKILLed and started again at once; 4 -> 4).
Runs: ductile in place and by restart (--last-call 1 --lease-ttl 3), each
also with no restart budget (inplace0, restart0: --max-restarts 0, where a
pod lost must stay a membership change, not a failure); `script`: ductile by
restart with its default flags (lease 10 s, last call 5 s, no restart
budget) running the PyTorch script torchrun runs; `helper`: the same with
--rebuild inplace and the script using the ductile.torch helper; and
torchrun (c10d rendezvous) with its defaults and with its fastest settings
(last_call_timeout=1, keep_alive_interval=1, keep_alive_max_attempt=3),
running the same MLP on the same data with PyTorch DDP (gloo). Every output
line of every process is timestamped as it arrives; the clock starts when
the event is injected and stops at the first "step" line printed by a
process of the new size. Prints the median per cell and the ratios.
"""
import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../tests/harness"))
from testlib import Etcd, Fail, children, free_port, kill_tree, tree  # noqa: E402


class Lines:
    """Timestamped lines from all processes of one trial."""

    def __init__(self):
        self.mu = threading.Lock()
        self.items = []

    def pump(self, name, stream):
        for raw in iter(stream.readline, b""):
            t = time.monotonic()
            with self.mu:
                self.items.append((t, name, raw.decode(errors="replace").rstrip()))
        stream.close()

    def since(self, t0):
        with self.mu:
            return [x for x in self.items if x[0] >= t0]


class Proc:
    def __init__(self, name, cmd, lines, env=None):
        self.name = name
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  start_new_session=True, env=env)
        threading.Thread(target=lines.pump, args=(name, self.p.stdout), daemon=True).start()

    def children(self):
        return children(self.p.pid)

    def tree(self):
        return tree(self.p.pid)

    def kill_tree(self):
        kill_tree(self.p.pid, depth=True)
        self.p.wait()

    def term(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)


class Ductile:
    def __init__(self, a, mode, d, trial, max_restarts=100):
        self.a, self.mode, self.d = a, mode, d
        self.max_restarts = max_restarts
        self.etcd = Etcd(d, name="b", log_level="error")
        try:
            self.etcd.start()
        except Fail:
            raise SystemExit("bench/recovery: etcd did not start")
        self.job = "rec-%s-%d" % (mode, trial)

    def agent_cmd(self, name):
        return [self.a.agent, "--nnodes", "2:5", "--rdzv-endpoint", self.etcd.endpoint,
                "--rdzv-id", self.job, "--node-id", name, "--node-addr", "127.0.0.1",
                "--hang-timeout", "10"]

    def start(self, name, lines):
        cmd = self.agent_cmd(name) + [
            "--lease-ttl", "3", "--last-call", "1", "--rebuild", self.mode,
            "--max-restarts", str(self.max_restarts), "--stop-grace", "3", "--", self.a.train,
            "--data", self.a.data, "--limit-train", "6000", "--epochs", "1000",
            "--batch-size", "64", "--threads", "1", "--log-every", "1",
            "--checkpoint-dir", os.path.join(self.d, "ck"), "--checkpoint-every", "10"]
        return Proc(name, cmd, lines)

    def worker(self, proc):
        return proc.children()

    def new_size(self, line):
        m = re.search(r"world (\d+)", line)
        return int(m.group(1)) if m and "ductile-train" in line else None

    def is_step(self, line):
        return re.search(r"ductile-train: step \d+ ", line) is not None

    def stop(self):
        self.etcd.kill()


class Script(Ductile):
    """ductile-agent with its default flags (restart, lease 10 s, last call
    5 s, --max-restarts 0) running the PyTorch script torchrun runs."""

    def __init__(self, a, d, trial):
        Ductile.__init__(self, a, "script", d, trial)

    def start(self, name, lines):
        cmd = self.agent_cmd(name) + [
            "--", self.a.python, os.path.join(self.a.here, "torch_mlp.py"), "--data", self.a.data,
            "--checkpoint", os.path.join(self.d, "torch.ckpt")]
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1")
        return Proc(name, cmd, lines, env)

    def new_size(self, line):
        m = re.search(r"\] world (\d+) resumed", line)
        return int(m.group(1)) if m else None

    def is_step(self, line):
        return re.search(r"\] step \d+ world", line) is not None


class Helper(Script):
    """`script`, but the script uses the ductile.torch helper and the agent
    runs with --rebuild inplace: its processes are kept."""

    def start(self, name, lines):
        cmd = self.agent_cmd(name) + [
            "--rebuild", "inplace", "--", self.a.python, os.path.join(self.a.here, "torch_mlp.py"),
            "--inplace", "--data", self.a.data, "--checkpoint", os.path.join(self.d, "torch.ckpt")]
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1", PYTHONPATH=os.path.join(self.a.here, "../../python"))
        return Proc(name, cmd, lines, env)


class Torchrun:
    def __init__(self, a, fast, d, trial):
        self.a, self.fast, self.d = a, fast, d
        self.port = free_port()
        self.job = "rec-torch-%d" % trial

    def start(self, name, lines):
        cmd = [self.a.python, "-m", "torch.distributed.run", "--nnodes", "2:5",
               "--nproc-per-node", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", "127.0.0.1:%d" % self.port, "--rdzv-id", self.job,
               "--max-restarts", "100", "--local-addr", "127.0.0.1"]
        if self.fast:
            cmd += ["--monitor-interval", "0.1", "--rdzv-conf",
                    "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"]
        cmd += [os.path.join(self.a.here, "torch_mlp.py"), "--data", self.a.data,
                "--checkpoint", os.path.join(self.d, "torch.ckpt")]
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1")
        return Proc(name, cmd, lines, env)

    def worker(self, proc):
        return [p for p in proc.tree() if p != proc.p.pid]

    def new_size(self, line):
        m = re.match(r"world (\d+) resumed", line)
        return int(m.group(1)) if m else None

    def is_step(self, line):
        return re.match(r"step \d+ world", line) is not None

    def stop(self):
        pass


def wait_steps(lines, sys_, t0, n, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(1 for _, _, l in lines.since(t0) if sys_.is_step(l)) >= n:
            return True
        time.sleep(0.05)
    return False


def first_step_at(lines, sys_, t0, size, timeout):
    """Seconds from t0 to the first step line, after a line announcing `size`,
    from the same process."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sized = set()
        for t, name, l in lines.since(t0):
            if sys_.new_size(l) is not None:
                if sys_.new_size(l) == size:
                    sized.add(name)
                else:
                    sized.discard(name)
            elif name in sized and sys_.is_step(l):
                return t - t0
        time.sleep(0.02)
    return None


def trial(a, kind, event, n):
    d = tempfile.mkdtemp(prefix="bench-recovery-")
    lines = Lines()
    sys_ = {"inplace": lambda: Ductile(a, "inplace", d, n),
            "restart": lambda: Ductile(a, "restart", d, n),
            "inplace0": lambda: Ductile(a, "inplace", d, n, 0),
            "restart0": lambda: Ductile(a, "restart", d, n, 0),
            "script": lambda: Script(a, d, n),
            "helper": lambda: Helper(a, d, n),
            "torch": lambda: Torchrun(a, False, d, n),
            "torch-fast": lambda: Torchrun(a, True, d, n)}[kind]()
    procs = []
    try:
        start = 3 if event == "scale_up" else 4
        for i in range(start):
            procs.append(sys_.start("n%d" % i, lines))
            time.sleep(0.3)
        if not wait_steps(lines, sys_, 0, 30 * start, 300):
            return None
        time.sleep(1)
        victim = procs[-1]
        t0 = time.monotonic()
        if event == "worker_kill":
            size = 4
            for pid in sys_.worker(victim)[:1]:
                os.kill(pid, signal.SIGKILL)
        elif event == "agent_kill":
            size = 3
            victim.kill_tree()
        elif event == "scale_down":
            size = 3
            victim.term()
        elif event == "worker_stop":
            size = 4
            for pid in sys_.worker(victim)[:1]:
                os.kill(pid, signal.SIGSTOP)
        elif event == "pod_restart":
            size = 4
            victim.kill_tree()
            procs.append(sys_.start(victim.name, lines))
        else:
            size = 4
            procs.append(sys_.start("n3", lines))
        return first_step_at(lines, sys_, t0, size, 120)
    finally:
        for p in procs:
            if p.p.poll() is None:
                p.kill_tree()
        sys_.stop()
        subprocess.run(["rm", "-rf", d])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--agent", required=True)
    p.add_argument("--train", required=True)
    p.add_argument("--python", required=True)
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--events", default="worker_kill,agent_kill,scale_down,scale_up,worker_stop,"
                   "pod_restart")
    p.add_argument("--kinds",
                   default="inplace,restart,inplace0,restart0,script,helper,torch,torch-fast",
                   help="which runs (inplace0/restart0: ductile with --max-restarts 0; script: "
                   "ductile with default flags running the PyTorch script; helper: the same "
                   "script with ductile.torch, in place)")
    a = p.parse_args()
    a.here = os.path.dirname(os.path.abspath(__file__))
    kinds = a.kinds.split(",")
    events = a.events.split(",")
    res = {}
    n = 0
    for ev in events:
        for k in kinds:
            vals = []
            for _ in range(a.repeats):
                n += 1
                v = trial(a, k, ev, n)
                print("  %-11s %-10s %s" % (ev, k, "%.2f s" % v if v is not None else
                                            "no step at the new size within 120 s"),
                      flush=True)
                if v is not None:
                    vals.append(v)
            res[(ev, k)] = statistics.median(vals) if vals else None

    def f(v):  # None: no step at the new size within the 120 s deadline
        return "%7.2f" % v if v is not None else "   >120"

    def r(x, y):  # torch time / ours; a torch run that never got there: at least 120 s
        if not x:
            return "       -"
        return "%7.1fx" % (y / x) if y else "  >%4.0fx" % (120 / x)
    ours = [k for k in kinds if not k.startswith("torch")]  # script: ductile too
    base = "torch-fast" if "torch-fast" in kinds else ("torch" if "torch" in kinds else None)
    print()
    print("time from the event to the first step at the new size, seconds (median of %d), "
          "4 agents, 1 worker each, MLP, %d cores" % (a.repeats, os.cpu_count()))
    head = "%-11s" % "event" + "".join(" %10s" % k for k in kinds)
    if base:
        head += "".join(" %10s" % ("%s/%s" % ("tf" if base == "torch-fast" else "t", k.replace("inplace", "inpl").replace("restart", "rest")))
                        for k in ours)
    print(head)
    for ev in events:
        row = "%-11s" % ev + "".join(" %10s" % f(res[(ev, k)]) for k in kinds)
        if base:
            row += "".join(" %10s" % r(res[(ev, k)], res[(ev, base)]) for k in ours)
        print(row)
    print("torch: torchrun c10d defaults; torch-fast (tf): last_call_timeout=1, "
          "keep_alive_interval=1, keep_alive_max_attempt=3, --monitor-interval 0.1; "
          "script: ductile-agent, default flags, the same PyTorch script as torchrun; "
          "helper: that script with ductile.torch, --rebuild inplace; "
          "ratios: torch time / ours; >120: no step at the new size within 120 s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
