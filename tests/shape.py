#!/usr/bin/env python3
"""The shape of the code (docs/design.md, "Reading the code"), checked.

A source file holds one concern and stays at or under 700 lines; a function
of the agent, the rendezvous, the trainer, the control protocol or a public
header fits a screen (80 lines, its signature to its closing brace). Prints
each file and function over its limit and exits 1; with --report, prints the
five largest files and every function over 80 lines and exits 0.

Within a folder of the product, calls between files go one way: two files
that each call a function the other defines are a circle, and listed (the
shared piece goes below both, or one side hands the other what it needs).
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILE_LIMIT = 700
FUNC_LIMIT = 80
SOURCE_DIRS = ("common", "control", "rendezvous", "agent", "trainer", "include", "tests",
               "bench", "python")
FUNC_DIRS = ("common", "control", "rendezvous", "agent", "trainer", "include")
CIRCLE_DIRS = ("common", "control", "rendezvous", "agent", "trainer")
COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*|\"(?:\\.|[^\"\\])*\"", re.S)
SUFFIXES = (".c", ".h", ".cu", ".py", ".sh")
# A function definition: a line at column 0 that names a function and does
# not end in ';' (a declaration), its body opened by '{' at the line's end or
# on the next line, closed by '}' at column 0.
SIGNATURE = re.compile(r"^[A-Za-z_][\w \*]*?\b(\w+)\s*\([^;]*$")


def sources():
    for top in SOURCE_DIRS:
        for base, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if not d.startswith((".", "build")) and d != "__pycache__"]
            for f in sorted(files):
                if f.endswith(SUFFIXES):
                    yield os.path.join(base, f)


def functions(lines):
    """(name, first line, length) of each C function definition."""
    i = 0
    while i < len(lines):
        m = SIGNATURE.match(lines[i])
        if not m or lines[i].startswith(("typedef", "struct", "enum", "union", "#")) or \
                m.group(1) in ("if", "for", "while", "switch", "return"):
            i += 1
            continue
        j = i
        while j < len(lines) and "{" not in lines[j] and not lines[j].rstrip().endswith(";"):
            j += 1
        if j >= len(lines) or "{" not in lines[j]:
            i += 1
            continue
        k = j
        while k < len(lines) and not lines[k].startswith("}"):
            k += 1
        if k < len(lines):
            yield m.group(1), i + 1, k - i + 1
        i = k + 1


def circles():
    """Pairs of files of one folder that call each other's functions."""
    found = []
    for top in CIRCLE_DIRS:
        d = os.path.join(ROOT, top)
        if not os.path.isdir(d):
            continue
        texts, defined = {}, {}
        for f in sorted(os.listdir(d)):
            if not f.endswith((".c", ".cu")):
                continue
            with open(os.path.join(d, f), encoding="utf-8", errors="replace") as fh:
                text = fh.read()
            texts[f] = COMMENT.sub(" ", text)
            lines = text.split("\n")
            for name, first, _ in functions(lines):
                if not lines[first - 1].startswith("static"):
                    defined.setdefault(name, f)
        calls = set()
        for f, text in texts.items():
            for name, g in defined.items():
                if g != f and re.search(r"\b%s\s*\(" % re.escape(name), text):
                    calls.add((f, g))
        for a, b in sorted(calls):
            if a < b and (b, a) in calls:
                found.append("%s: %s and %s call each other" % (top, a, b))
    return found


def main():
    report = "--report" in sys.argv[1:]
    sizes, long_funcs, bad = [], [], []
    for path in sources():
        rel = os.path.relpath(path, ROOT)
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().split("\n")
        n = len(lines) - 1 if lines and lines[-1] == "" else len(lines)
        sizes.append((n, rel))
        if n > FILE_LIMIT:
            bad.append("%s: %d lines (at most %d: split it along a seam)" % (rel, n, FILE_LIMIT))
        if rel.split(os.sep)[0] in FUNC_DIRS and path.endswith((".c", ".cu", ".h")):
            for name, first, length in functions(lines):
                if length > FUNC_LIMIT:
                    long_funcs.append((length, "%s:%d %s" % (rel, first, name)))
                    bad.append("%s:%d: %s is %d lines (at most %d)" %
                               (rel, first, name, length, FUNC_LIMIT))
    circle = circles()
    bad += circle
    if report:
        sizes.sort(reverse=True)
        print("five largest files: " + ", ".join("%s %d" % (r, n) for n, r in sizes[:5]))
        long_funcs.sort(reverse=True)
        print("functions over %d lines: %d" % (FUNC_LIMIT, len(long_funcs)))
        for length, where in long_funcs:
            print("  %s: %d" % (where, length))
        print("circles: %d" % len(circle))
        for line in circle:
            print("  " + line)
        return 0
    for line in bad:
        print(line)
    print("shape: %d files checked, %d over a limit" % (len(sizes), len(bad)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
