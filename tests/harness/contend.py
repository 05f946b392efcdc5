#!/usr/bin/env python3
"""contend.py: run a command while busy processes load every core.

    contend.py [--per-core K] -- COMMAND ARGS...

Starts K (default 1) CPU-bound processes per online core, runs COMMAND, stops
them and exits with COMMAND's status. Tests that must not depend on an idle
machine run once more under it: the scheduler then delays any thread at any
point, which is what a loaded CI machine or a busy node does.
"""
import os
import signal
import subprocess
import sys


def spin():
    os.setsid()
    x = 0
    while True:  # bounded by the parent: killed when COMMAND ends
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF


def main():
    argv = sys.argv[1:]
    per_core = 1
    if argv[:1] == ["--per-core"]:
        per_core = int(argv[1])
        argv = argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv or per_core < 1:
        print("usage: contend.py [--per-core K] -- COMMAND ARGS...", file=sys.stderr)
        return 2
    busy = []
    try:
        for _ in range((os.cpu_count() or 1) * per_core):
            pid = os.fork()
            if pid == 0:
                try:
                    spin()
                finally:
                    os._exit(0)
            busy.append(pid)
        print("contend: %d busy processes on %d cores" % (len(busy), os.cpu_count() or 1),
              flush=True)
        return subprocess.call(argv)
    finally:
        for pid in busy:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass


if __name__ == "__main__":
    sys.exit(main())
