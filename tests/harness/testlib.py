"""testlib: what the Python test drivers and benches share.

Standard library only: a failure type, a check, a wait with a deadline and
a free loopback port.
"""
import socket
import time


class Fail(Exception):
    pass


def check(cond, what):
    if not cond:
        raise Fail(what)


def wait_for(pred, timeout, what, step=0.05):
    """pred's first true value, polled every step seconds until timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(step)
    raise Fail("timed out after %.0f s waiting for %s" % (timeout, what))


def free_port():
    """A loopback port that was free a moment ago."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p
