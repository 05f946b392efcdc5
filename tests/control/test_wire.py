#!/usr/bin/env python3
"""test_wire.py: the Python side of the control protocol
(python/ductile/control.py) against tests/control/wire_cases.txt, the wire
format that the C side (test_wire.c, libductile-control) is tested on too.

ductile.control is a worker's end: it receives agent -> worker lines
(control.parse) and sends worker -> agent ones (its Channel, over a real
socketpair standing in for the agent). So it holds every a>w `accept`,
`refuse` and `send` (read back by parse) and every w>a `send` (written by a
Channel), except those marked @c; a w>a `accept` or `refuse` is the agent's
to hold, not a worker's. The cases file's grammar is at its top.

Usage: test_wire.py wire_cases.txt. Standard library only.
"""
import os
import re
import socket
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "../../python"))
from ductile import control  # noqa: E402

ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"'}
REPEAT = re.compile(r"\((\d+)\)")
INT_FIELDS = ("round", "rank", "world_size", "local_rank", "group_rank", "group_world_size",
              "restarts", "master_port", "graceful", "step", "samples", "version")
STR_FIELDS = ("master_addr", "store_prefix", "phase", "reason", "mode")
# The fields a parsed a>w message has, and their values when a case leaves
# them out.
DEFAULTS = {"round": {}, "abort": {"graceful": 0}, "hello": {"mode": "none"}, "stop": {}}


def split(text):
    """A case line's words, quotes and escapes undone (test_wire.c: split)."""
    words, i, n = [], 0, len(text)
    while True:
        while i < n and text[i] == " ":
            i += 1
        if i >= n or text[i] == "\n":
            return words
        t, quoted = [], False
        while i < n and text[i] != "\n" and (quoted or text[i] != " "):
            c = text[i]
            i += 1
            if c == '"':
                quoted = not quoted
            elif quoted and c == "\\":
                m = REPEAT.match(text, i)
                if m and t and int(m.group(1)) >= 1:
                    t.append(t[-1] * (int(m.group(1)) - 1))
                    i = m.end()
                elif i < n and text[i] in ESCAPES:
                    t.append(ESCAPES[text[i]])
                    i += 1
                else:
                    raise ValueError("a bad escape")
            else:
                t.append(c)
        if quoted:
            raise ValueError("an unclosed quote")
        words.append("".join(t))


def fields_of(words):
    """KIND and its fields {name: value} from words[3:]."""
    kind, fields = words[3], {}
    for w in words[4:]:
        name, eq, v = w.partition("=")
        if not eq or name not in INT_FIELDS + STR_FIELDS + ("loss",):
            raise ValueError("no field %r" % w)
        fields[name] = int(v) if name in INT_FIELDS else float(v) if name == "loss" else v
    return kind, fields


def parsed_fields(msg):
    """control.parse's answer as (KIND, fields) in the cases' names."""
    kind, v = msg
    if kind == "hello":
        return kind, {"version": v[0], "mode": v[1] or "none"}
    if kind == "abort":
        return kind, {"round": v[0], "graceful": int(v[1])}
    if kind == "round":
        return kind, {"round": v.number, "rank": v.rank, "world_size": v.world_size,
                      "local_rank": v.local_rank, "group_rank": v.group_rank,
                      "group_world_size": v.group_world_size, "restarts": v.restarts,
                      "master_addr": v.master_addr, "master_port": v.master_port,
                      "store_prefix": v.store_prefix}
    return kind, {}


def receive(verb, wire, words):
    """An a>w case, read by control.parse; None when it holds, else why not."""
    msg = control.parse(wire)
    if verb == "refuse":
        return None if msg is None else "accepted a line it must refuse"
    if msg is None:
        return "refused a line it must accept"
    kind, want = fields_of(words)
    want = dict(DEFAULTS.get(kind, {}), **want)
    got = parsed_fields(msg)
    return None if got == (kind, want) else "parsed to %r, not %r" % (got, (kind, want))


def channel_says(kind, f):
    """The line a Channel writes for KIND and fields f, as the agent reads it."""
    mine, theirs = socket.socketpair()
    mine.settimeout(10)
    ch = control.Channel(theirs.fileno())
    theirs.close()
    r = mine.makefile("rb")
    try:
        if kind == "hello":
            if f.get("version") != control.VERSION or f.get("mode", "none") not in ("none",
                                                                                    "inplace"):
                raise ValueError("ductile.control says only `hello %d [inplace]`" %
                                 control.VERSION)
            mine.sendall(b"hello %d restart\n" % control.VERSION)  # the agent's answer, early
            ch.hello(f.get("mode") == "inplace", timeout=10)
        elif kind == "step":
            ch.report_step(f["step"], f.get("samples"), f.get("loss"))
        elif kind == "phase":
            ch.set_phase(f["phase"])
        elif kind == "failed":
            ch.failed(f.get("reason", ""))
        elif kind == "peer_lost":
            ch.peer_lost(f["round"], f.get("reason", ""))
        else:
            raise ValueError("ductile.control does not say `%s`: mark the case send@c" % kind)
        return r.readline().decode()
    finally:
        ch.close()
        r.close()
        mine.close()


def run_case(words):
    """One case for the Python side; None when it holds, else why not."""
    verb, direction, wire = words[0].partition("@")[0], words[1], words[2]
    if verb not in ("send", "accept", "refuse") or (verb == "refuse") != (len(words) == 3):
        return "not a case (VERB DIR \"WIRE\" [KIND FIELDS])"
    if direction == "a>w":
        return receive(verb, wire, words)
    if verb == "send":
        said = channel_says(*fields_of(words))
        return None if said == wire else "the Channel said %r" % said
    return None  # a w>a accept or refuse: the agent's, not a worker's


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: test_wire.py wire_cases.txt")
    ran, theirs, bad = 0, 0, 0
    with open(sys.argv[1], encoding="utf-8") as f:
        for lineno, text in enumerate(f, 1):
            if text.startswith(("#", "\n")):
                continue
            try:
                words = split(text)
                side = words[0].partition("@")[2]
                if len(words) < 3 or words[1] not in ("a>w", "w>a") or \
                        side not in ("", "c", "python"):
                    raise ValueError("not a case")
                if side == "c" or (words[1] == "w>a" and words[0].startswith(("accept",
                                                                              "refuse"))):
                    theirs += 1
                    continue
                ran += 1
                why = run_case(words)
            except (ValueError, IndexError, KeyError, OSError) as e:
                why = "%s: %s" % (type(e).__name__, e)
            if why:
                bad += 1
                print("wire_cases.txt:%d: %s" % (lineno, why), file=sys.stderr)
    if bad or not ran:
        print("FAIL control wire (Python): %d of %d cases" % (bad, ran), file=sys.stderr)
        return 1
    print("ok control wire (Python): %d cases, %d for the C side only" % (ran, theirs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
