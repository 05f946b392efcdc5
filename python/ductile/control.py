"""ductile.control: the agent's control channel, in Python.

The agent gives each worker one end of a socketpair as file descriptor
DUCTILE_CONTROL_FD and speaks text lines on it (include/ductile/control.h
is the protocol of record; docs/design.md lists it). This module parses
and formats those lines and keeps a Channel: a reader thread that records
what the agent said (its hello, the newest round, aborts, stop) and a
sender thread that reports progress (`step`, `phase`) without ever making
the training loop wait on the socket. It needs nothing beyond the
standard library, so it can be used and tested without torch.
"""
import os
import re
import socket
import sys
import threading
import time

VERSION = 1              # CTL_VERSION: the control protocol this module speaks
MAX_LINE = 1024          # CTL_MAX_LINE
HEARTBEAT_S = 1.0        # CTL_HEARTBEAT_MS: a worker that says `phase` repeats it this often
EXIT_PEER_LOST = 75      # CTL_EXIT_PEER_LOST: "I lost a peer", not counted as a failure
ENV_FD = "DUCTILE_CONTROL_FD"
_PHASE = re.compile(r"[a-z_]{1,31}")
_INT64_MAX = (1 << 63) - 1
_INT_MAX = (1 << 31) - 1


class ProtocolError(Exception):
    """The agent speaks another protocol version, or said something invalid."""


class Round:
    """A `round` line: this worker's place in round `number`."""
    __slots__ = ("number", "rank", "world_size", "local_rank", "group_rank", "group_world_size",
                 "restarts", "master_addr", "master_port", "store_prefix")

    def __init__(self, number, rank, world_size, local_rank, group_rank, group_world_size,
                 restarts, master_addr, master_port, store_prefix):
        self.number, self.rank, self.world_size = number, rank, world_size
        self.local_rank, self.group_rank = local_rank, group_rank
        self.group_world_size, self.restarts = group_world_size, restarts
        self.master_addr, self.master_port, self.store_prefix = (master_addr, master_port,
                                                                 store_prefix)

    @classmethod
    def from_env(cls, env=None):
        """The round a worker was started in, from the agent's (torchrun's) environment."""
        env = os.environ if env is None else env
        try:
            return cls(int(env.get("DUCTILE_ROUND", "0")), int(env["RANK"]),
                       int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0")),
                       int(env.get("GROUP_RANK", "0")), int(env.get("GROUP_WORLD_SIZE", "1")),
                       int(env.get("TORCHELASTIC_RESTART_COUNT", "0")), env["MASTER_ADDR"],
                       int(env["MASTER_PORT"]), env.get("DUCTILE_STORE_PREFIX", ""))
        except (KeyError, ValueError) as e:
            raise ProtocolError("the worker environment lacks a valid %s" % e) from None

    def __repr__(self):
        return "round %d: rank %d of %d at %s:%d" % (self.number, self.rank, self.world_size,
                                                     self.master_addr, self.master_port)


def _int(word, lo, hi):
    if not re.fullmatch(r"-?[0-9]+", word):
        raise ValueError(word)
    v = int(word)
    if v < lo or v > hi:
        raise ValueError(word)
    return v


def parse(line):
    """One agent -> worker line as (kind, value), or None when it is not valid:
    ("hello", (version, mode)), ("round", Round), ("abort", (n, graceful)),
    ("stop", None)."""
    if len(line) > MAX_LINE:
        return None
    w = line.rstrip("\r\n").split(" ")
    try:
        if w[0] == "hello" and len(w) in (2, 3):
            mode = w[2] if len(w) == 3 else None
            if mode not in (None, "inplace", "restart"):
                return None
            return "hello", (_int(w[1], 1, _INT_MAX), mode)
        if w[0] == "stop" and len(w) == 1:
            return "stop", None
        if w[0] == "abort" and len(w) in (2, 3):
            if len(w) == 3 and w[2] not in ("graceful", "lost"):
                return None
            return "abort", (_int(w[1], 0, _INT64_MAX), len(w) == 3 and w[2] == "graceful")
        if w[0] == "round" and len(w) == 11:
            r = Round(_int(w[1], 0, _INT64_MAX), _int(w[2], 0, _INT_MAX), _int(w[3], 1, _INT_MAX),
                      _int(w[4], 0, _INT_MAX), _int(w[5], 0, _INT_MAX), _int(w[6], 1, _INT_MAX),
                      _int(w[7], 0, _INT64_MAX), w[8], _int(w[9], 0, 65535), w[10])
            if r.rank >= r.world_size or r.group_rank >= r.group_world_size or not w[8]:
                return None
            return "round", r
    except ValueError:
        return None
    return None


def one_line(text, limit=480):
    """text as one line of at most limit characters (a REASON)."""
    s = " ".join(str(text).split())
    return s[:limit] if s else "unknown"


class Channel:
    """The worker's end of the control channel.

    A reader thread records the agent's lines; the training loop asks
    (newest round, aborted?, stopping?) and waits with deadlines. A sender
    thread writes progress: the newest step at once (at most one line per
    20 ms) and the phase on change and every HEARTBEAT_S. Failure reports
    are written at once by the caller. Writes never block the caller for
    long: the socket is the agent's, which reads it in its loop.
    """

    def __init__(self, fd):
        self._sock = socket.socket(fileno=os.dup(fd))
        self._sock.settimeout(None)
        self._wmu = threading.Lock()
        self._cv = threading.Condition()
        self.agent_version = None   # from the agent's `hello`
        self.agent_mode = None      # "inplace" | "restart"
        self.round = None           # the newest Round the agent sent
        self.aborted = {}           # round number -> graceful (bool)
        self.stopping = False       # `stop` said (or SIGTERM, via request_stop)
        self.closed = False         # the agent's end is gone
        self.on_abort = None        # called from the reader thread: fn(number, graceful)
        self._phase = None
        self._step = None           # (step, samples, loss) not yet sent
        self._beat = threading.Event()
        self._done = False
        threading.Thread(target=self._read, name="ductile-control-read", daemon=True).start()
        threading.Thread(target=self._send_loop, name="ductile-control-send",
                         daemon=True).start()

    @classmethod
    def from_env(cls):
        """The channel the agent gave this process, or None outside the agent.
        A variable that names no open socket is a ProtocolError."""
        v = os.environ.get(ENV_FD)
        if v is None or v == "":
            return None
        try:
            fd = int(v)
            return cls(fd)
        except (ValueError, OSError) as e:
            raise ProtocolError("%s=%s is not an open control socket: %s" %
                                (ENV_FD, v, one_line(e))) from None

    # ---- reading ----

    def _read(self):
        f = self._sock.makefile("rb")
        try:
            for raw in f:
                line = raw.decode("utf-8", "replace")
                msg = parse(line)
                if msg is None:
                    sys.stderr.write("ductile: invalid control line from the agent: %r\n" %
                                     line[:120])
                    continue
                self._take(*msg)
        except (OSError, ValueError):
            pass
        with self._cv:
            self.closed = True
            self._cv.notify_all()

    def _take(self, kind, v):
        cb = None
        with self._cv:
            if kind == "hello":
                self.agent_version, self.agent_mode = v
            elif kind == "round":
                if self.round is None or v.number > self.round.number:
                    self.round = v
            elif kind == "abort":
                self.aborted[v[0]] = v[1]
                cb = self.on_abort
            elif kind == "stop":
                self.stopping = True
            self._cv.notify_all()
        if cb:
            cb(v[0], v[1])

    def wait(self, pred, timeout):
        """Waits until pred() (called under the channel's lock) is true, the
        agent's end closes, or timeout seconds pass; returns pred()."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while not pred() and not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(min(left, 1.0))
            return pred()

    def request_stop(self):
        """SIGTERM: as if the agent had said `stop`."""
        with self._cv:
            self.stopping = True
            self._cv.notify_all()

    def ended(self, number):
        """None while round `number` stands; else "graceful" or "lost"."""
        with self._cv:
            if number in self.aborted:
                return "graceful" if self.aborted[number] else "lost"
            if self.round is not None and self.round.number > number:
                return "lost"  # a newer round without an abort: the old one is over
            return None

    # ---- writing ----

    def send(self, line):
        """Writes one line now; False when the agent's end is gone."""
        data = (line.rstrip("\n") + "\n").encode()
        if len(data) > MAX_LINE:
            data = data[:MAX_LINE - 1] + b"\n"
        with self._wmu:
            try:
                self._sock.sendall(data)
                return True
            except OSError:
                return False

    def hello(self, inplace, timeout=30.0):
        """Says `hello VERSION [inplace]` and waits for the agent's reply.
        Returns the agent's mode ("inplace" or "restart"); raises
        ProtocolError when the agent speaks another version or does not
        answer within timeout seconds."""
        self.send("hello %d%s" % (VERSION, " inplace" if inplace else ""))
        if not self.wait(lambda: self.agent_version is not None, timeout):
            raise ProtocolError("the agent did not answer `hello` on its control channel within "
                                "%.0f s%s" % (timeout, " (it closed it)" if self.closed else ""))
        if self.agent_version != VERSION:
            raise ProtocolError("control protocol version mismatch: the agent speaks version %d, "
                                "this helper (ductile.control) version %d" %
                                (self.agent_version, VERSION))
        return self.agent_mode

    def set_phase(self, name):
        if not _PHASE.fullmatch(name):
            raise ValueError("a phase is [a-z_]{1,31}: %r" % name)
        if name != self._phase:
            self._phase = name
            self._beat.set()

    def report_step(self, step, samples=None, loss=None):
        self._step = (step, samples, loss)
        self._beat.set()

    def failed(self, reason):
        self.send("failed " + one_line(reason))

    def peer_lost(self, number, reason):
        self.send("peer_lost %d %s" % (number, one_line(reason)))

    def _send_loop(self):
        sent_phase, last_beat = None, 0.0
        while not self._done:
            self._beat.wait(HEARTBEAT_S)
            self._beat.clear()
            st, self._step = self._step, None
            if st is not None:
                step, samples, loss = st
                line = "step %d" % step
                if samples is not None:
                    line += " samples %d" % samples
                if loss is not None and loss == loss and abs(loss) != float("inf"):
                    line += " loss %.9g" % loss
                self.send(line)
            now = time.monotonic()
            ph = self._phase
            if ph is not None and (ph != sent_phase or now - last_beat >= HEARTBEAT_S * 0.9):
                if not self.send("phase " + ph):
                    return
                sent_phase, last_beat = ph, now
            time.sleep(0.02)

    def close(self):
        """Stops the sender (the socket closes with the process: the agent
        reads its end of the channel until then)."""
        self._done = True
        self._beat.set()
