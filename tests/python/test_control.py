#!/usr/bin/env python3
"""test_control.py: ductile.control (python/ductile/control.py) against the
protocol of include/ductile/control.h, over a real socketpair standing in
for the agent's end. Standard library only: it runs without torch."""
import os
import socket
import subprocess
import sys
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "../../python"))
from ductile import control  # noqa: E402


class Parse(unittest.TestCase):
    def test_agent_lines(self):
        self.assertEqual(control.parse("hello 1 inplace\n"), ("hello", (1, "inplace")))
        self.assertEqual(control.parse("hello 7 restart"), ("hello", (7, "restart")))
        self.assertEqual(control.parse("stop\n"), ("stop", None))
        self.assertEqual(control.parse("abort 4 graceful\n"), ("abort", (4, True)))
        self.assertEqual(control.parse("abort 4 lost\n"), ("abort", (4, False)))
        self.assertEqual(control.parse("abort 4\n"), ("abort", (4, False)))
        kind, r = control.parse("round 5 3 4 1 1 2 2 10.0.0.1 29500 /ductile/j/rounds/5/store/\n")
        self.assertEqual(kind, "round")
        self.assertEqual((r.number, r.rank, r.world_size, r.local_rank, r.group_rank,
                          r.group_world_size, r.restarts, r.master_addr, r.master_port,
                          r.store_prefix),
                         (5, 3, 4, 1, 1, 2, 2, "10.0.0.1", 29500, "/ductile/j/rounds/5/store/"))

    def test_invalid_lines(self):
        for bad in ["", "hello", "hello 0", "hello -1", "hello x", "hello 1 bogus",
                    "hello 1 inplace extra", "abort", "abort x", "abort 3 maybe", "stop now",
                    "round 5 4 4 1 1 2 2 a 1 p", "round 5 0 4 1 2 2 2 a 1 p",
                    "round 5 0 4 1 1 2 2 a 70000 p", "round 5 0 4 1 1 2 2 a 1",
                    "step 3", "x" * 2000]:
            self.assertIsNone(control.parse(bad), bad)

    def test_env_round(self):
        env = {"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "h", "MASTER_PORT": "9",
               "DUCTILE_ROUND": "4"}
        r = control.Round.from_env(env)
        self.assertEqual((r.number, r.rank, r.world_size, r.master_port), (4, 2, 3, 9))
        with self.assertRaisesRegex(control.ProtocolError, "MASTER_PORT"):
            control.Round.from_env({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h"})


class Agent:
    """The agent's end of a socketpair, read line by line."""

    def __init__(self):
        self.mine, theirs = socket.socketpair()
        self.ch = control.Channel(theirs.fileno())
        theirs.close()
        self.f = self.mine.makefile("r")
        self.mine.settimeout(10)

    def say(self, line):
        self.mine.sendall((line + "\n").encode())

    def line(self):
        return self.f.readline().rstrip("\n")

    def lines_until(self, pred):
        got = []
        while True:
            ln = self.line()
            if not ln:
                raise AssertionError("channel closed after %r" % got)
            got.append(ln)
            if pred(ln):
                return got


class ChannelTest(unittest.TestCase):
    def test_hello_and_rounds(self):
        a = Agent()
        # The round may come before the reply to hello (the agent sends it at launch).
        a.say("round 3 0 2 0 0 2 0 127.0.0.1 4000 /p/")
        a.say("hello 1 inplace")
        self.assertEqual(a.ch.hello(inplace=True, timeout=10), "inplace")
        self.assertEqual(a.line(), "hello 1 inplace")
        self.assertTrue(a.ch.wait(lambda: a.ch.round is not None, 10))
        self.assertEqual(a.ch.round.number, 3)
        self.assertIsNone(a.ch.ended(3))
        a.say("abort 3 graceful")
        self.assertTrue(a.ch.wait(lambda: 3 in a.ch.aborted, 10))
        self.assertEqual(a.ch.ended(3), "graceful")
        a.say("round 4 1 2 0 1 2 0 127.0.0.1 4001 /p/")
        a.say("round 2 1 2 0 1 2 0 127.0.0.1 4001 /p/")  # an older round changes nothing
        a.say("garbage line")
        self.assertTrue(a.ch.wait(lambda: a.ch.round.number == 4, 10))
        a.say("stop")
        self.assertTrue(a.ch.wait(lambda: a.ch.stopping, 10))
        self.assertEqual(a.ch.round.number, 4)
        # A newer round without an abort ends the old one as lost.
        self.assertEqual(a.ch.ended(2), "lost")

    def test_version_mismatch(self):
        a = Agent()
        a.say("hello 2 inplace")
        with self.assertRaises(control.ProtocolError) as cm:
            a.ch.hello(inplace=True, timeout=10)
        msg = str(cm.exception)
        self.assertIn("version mismatch", msg)
        self.assertIn("agent speaks version 2", msg)
        self.assertIn("version 1", msg)
        self.assertNotIn("\n", msg)

    def test_no_answer(self):
        a = Agent()
        a.mine.shutdown(socket.SHUT_WR)  # the agent's end closes without a word
        with self.assertRaisesRegex(control.ProtocolError, "did not answer"):
            a.ch.hello(inplace=False, timeout=10)
        self.assertTrue(a.ch.closed)

    def test_reports(self):
        a = Agent()
        a.ch.set_phase("compute")
        a.ch.report_step(7, samples=56, loss=1.25)
        seen = set()
        a.lines_until(lambda ln: seen.add(ln) or {"phase compute", "step 7 samples 56 loss 1.25"}
                      <= seen)
        # The phase is repeated while nothing happens (the agent's heartbeat).
        t0 = time.monotonic()
        self.assertEqual(a.lines_until(lambda ln: ln == "phase compute")[-1], "phase compute")
        self.assertLess(time.monotonic() - t0, 5)
        a.ch.report_step(8, loss=float("nan"))  # a loss that is not finite is left out
        self.assertIn("step 8", a.lines_until(lambda ln: ln.startswith("step")))
        a.ch.peer_lost(3, "gloo: Connection reset\nby peer")
        self.assertIn("peer_lost 3 gloo: Connection reset by peer",
                      a.lines_until(lambda ln: ln.startswith("peer_lost")))
        a.ch.failed("x" * 5000)
        ln = a.lines_until(lambda ln: ln.startswith("failed"))[-1]
        self.assertLessEqual(len(ln) + 1, control.MAX_LINE)
        with self.assertRaises(ValueError):
            a.ch.set_phase("Bad Phase")
        a.ch.close()

    def test_from_env(self):
        os.environ.pop(control.ENV_FD, None)
        self.assertIsNone(control.Channel.from_env())
        os.environ[control.ENV_FD] = "not-a-number"
        with self.assertRaisesRegex(control.ProtocolError, "not an open control socket"):
            control.Channel.from_env()
        os.environ[control.ENV_FD] = "987"  # no such descriptor
        with self.assertRaisesRegex(control.ProtocolError, "not an open control socket"):
            control.Channel.from_env()
        del os.environ[control.ENV_FD]


class Importable(unittest.TestCase):
    def test_package_without_torch(self):
        """ductile and ductile.control import with the standard library alone."""
        r = subprocess.run([sys.executable, "-S", "-c",
                            "import sys; sys.path.insert(0, %r); import ductile.control, ductile;"
                            " print(ductile.__version__)" % os.path.join(HERE, "../../python")],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)


if __name__ == "__main__":
    unittest.main()
