"""testlib: what the Python test drivers and benches share.

Standard library only, so any Python runs it (the system's, a chart test's
virtualenv, a torch one):
  - failing, skipping and dispatch: Fail, check, Skip/SKIP, run_case and
    run_cases (named cases, one line each: "ok   NAME", "FAIL NAME: why");
  - waiting: wait_for, a poll with a deadline;
  - processes: pid_alive, children, tree, kill_tree, and Etcd, a private etcd on
    free ports that a test can kill, stop (SIGSTOP) and restart;
  - the network: free_port, tcp_open, http_get, and Netns, a named network
    namespace wired to this one by a veth pair (root only; Skip without).
Chart rendering lives in tests/chart/conftest.py, beside the pytest fixtures
that hand it to the chart tests.
"""
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

SKIP = 77  # the exit status of a test that could not run here (ctest: SKIP_RETURN_CODE)


class Fail(Exception):
    pass


class Skip(Exception):
    pass


def check(cond, what):
    if not cond:
        raise Fail(what)


def run_case(name, fn, *args):
    """fn(*args) as the case `name`: True when it passed, False when it raised
    Fail (said on stderr), None when it raised Skip."""
    try:
        fn(*args)
    except Fail as e:
        print("FAIL %s: %s" % (name, e), file=sys.stderr, flush=True)
        return False
    except Skip as e:
        print("SKIP %s: %s" % (name, e), flush=True)
        return None
    print("ok   %s" % name, flush=True)
    return True


def run_cases(cases, names, *args):
    """Runs the cases (a dict name -> fn) named in names, or all of them; the
    exit status: 0 when all passed, SKIP when all were skipped, else 1."""
    results = [run_case(n, cases[n], *args) for n in (names or list(cases))]
    if False in results:
        return 1
    return SKIP if results and all(r is None for r in results) else 0


def wait_for(pred, timeout, what, step=0.05):
    """pred's first true value, polled every step seconds until timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(step)
    raise Fail("timed out after %.0f s waiting for %s" % (timeout, what))


# ---- processes ----

def pid_alive(pid):
    """Whether pid runs (a zombie does not)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):  # gone, or going while read (ESRCH)
        return False


def children(pid):
    """The pids of pid's children."""
    try:
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [int(x) for x in out.split()]


def tree(pid):
    """pid and all its descendants, pid first."""
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        todo += children(p)
    return pids


def kill_tree(pid, depth=False):
    """SIGKILLs pid and its children at once (a pod crash); with depth, all
    its descendants. The pids signalled, pid first."""
    pids = tree(pid) if depth else [pid] + children(pid)
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


class Etcd:
    """A private etcd on free ports, its data in workdir/etcd and its log in
    workdir/etcd.log; hosts are where clients reach it (127.0.0.1, and maybe
    a veth address)."""

    def __init__(self, workdir, hosts=("127.0.0.1",), name="e", log_level="warn"):
        self.dir = os.path.join(workdir, "etcd")
        self.hosts = hosts
        self.name = name
        self.log_level = log_level
        self.port = free_port()
        self.peer = free_port()
        self.proc = None
        self.logf = os.path.join(workdir, "etcd.log")

    @property
    def endpoint(self):
        return "http://127.0.0.1:%d" % self.port

    def start(self, timeout=20):
        """Starts it (again, on the same ports and data) and waits until it listens."""
        clients = ",".join("http://%s:%d" % (h, self.port) for h in self.hosts)
        peer = "http://127.0.0.1:%d" % self.peer
        with open(self.logf, "a") as out:
            self.proc = subprocess.Popen(
                ["etcd", "--name", self.name, "--data-dir", self.dir,
                 "--listen-client-urls", clients, "--advertise-client-urls", clients,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", self.name + "=" + peer, "--initial-cluster-state", "new",
                 "--logger", "zap", "--log-level", self.log_level],
                stdout=out, stderr=out)
        wait_for(lambda: tcp_open(self.port, timeout=0.2), timeout, "etcd to listen", step=0.1)

    def kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self):
        """SIGTERM (after a SIGCONT, in case it was stopped); SIGKILL after 10 s."""
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


# ---- the network ----

def free_port():
    """A loopback port that was free a moment ago."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def tcp_open(port, host="127.0.0.1", timeout=0.5):
    """Whether something accepts connections on host:port."""
    s = socket.socket()
    try:
        s.settimeout(timeout)
        s.connect((host, port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def http_get(port, path, host="127.0.0.1", timeout=5):
    """(status, body) of GET http://host:port/path; an HTTP error is an answer."""
    try:
        with urllib.request.urlopen("http://%s:%d%s" % (host, port, path),
                                    timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def ip(*args, check_=True):
    """Runs `ip ARGS`; one that fails raises Skip (the machine cannot), unless
    check_ is false."""
    r = subprocess.run(["ip"] + list(args), capture_output=True, text=True)
    if check_ and r.returncode != 0:
        raise Skip("cannot set up a network namespace (ip %s): %s" %
                   (" ".join(args), r.stderr.strip()))
    return r


class Netns:
    """A named network namespace `ns` and a veth pair: `host` here with
    host_ip, `peer` in ns with ns_ip (a /30 between them) and ns's loopback
    up. Commands run in it under prefix(); the link can be cut (down) and
    mended (up). close() removes both; use it in a finally."""

    def __init__(self, ns, host, peer, host_ip, ns_ip, prefix_len=30):
        self.ns, self.host, self.peer = ns, host, peer
        self.host_ip, self.ns_ip, self.prefix_len = host_ip, ns_ip, prefix_len

    def setup(self):
        ip("netns", "add", self.ns)
        ip("link", "add", self.host, "type", "veth", "peer", "name", self.peer)
        ip("link", "set", self.peer, "netns", self.ns)
        ip("addr", "add", "%s/%d" % (self.host_ip, self.prefix_len), "dev", self.host)
        ip("link", "set", self.host, "up")
        ip("-n", self.ns, "addr", "add", "%s/%d" % (self.ns_ip, self.prefix_len), "dev",
           self.peer)
        ip("-n", self.ns, "link", "set", self.peer, "up")
        ip("-n", self.ns, "link", "set", "lo", "up")

    def prefix(self):
        """The argv prefix that runs a command in the namespace."""
        return ["ip", "netns", "exec", self.ns]

    def link(self, up):
        ip("link", "set", self.host, "up" if up else "down")

    def close(self):
        ip("link", "del", self.host, check_=False)
        ip("netns", "del", self.ns, check_=False)
