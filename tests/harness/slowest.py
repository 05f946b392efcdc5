#!/usr/bin/env python3
"""The ten slowest tests of the last ctest run: slowest.py LastTest.log."""
import re
import sys


def main():
    if len(sys.argv) != 2:
        print("usage: slowest.py BUILD/Testing/Temporary/LastTest.log", file=sys.stderr)
        return 2
    try:
        with open(sys.argv[1], encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError as e:
        print("slowest: %s" % e, file=sys.stderr)
        return 0  # no run to report on is not a failure of the tests
    rows, name = [], None
    for line in text.splitlines():
        m = re.match(r"\d+/\d+ Testing: (\S+)", line)
        if m:
            name = m.group(1)
            continue
        m = re.match(r"Test time =\s*([\d.]+) sec", line)
        if m and name:
            rows.append((float(m.group(1)), name))
            name = None
    rows = sorted(rows, reverse=True)[:10]
    print("the ten slowest tests:")
    for t, name in rows:
        print("  %8.1f s  %s" % (t, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
