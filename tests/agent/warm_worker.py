"""warm_worker.py: the Python worker of test_warm.py's warm_spare case.

    python3 [-B] warm_worker.py ARGS...

Writes what a script can see of how it was started (pid, sys.argv,
sys.path[0], __name__, its round's variables, whether warm_marker was
imported before it ran) to $AGENT_TEST_DIR/ww.<pid>.json, then waits for
"exit N" in $AGENT_TEST_DIR/cmd.all or cmd.<pid> and exits N. With
WARM_WORKER_PLAIN=1 it prints the record on stdout and exits 0 instead:
the plain run the case compares with.
"""
import json
import os
import sys
import time


def fd_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def main():
    rec = {"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv, "path0": sys.path[0],
           "name": __name__, "dont_write_bytecode": sys.flags.dont_write_bytecode,
           "marker": "warm_marker" in sys.modules, "ctl_open": fd_open(3), "fd4_open": fd_open(4)}
    for k in ("RANK", "WORLD_SIZE", "DUCTILE_ROUND", "WARM_MARKER_STALE",
              "DUCTILE_PRELOAD_MODULES", "DUCTILE_CONTROL_FD"):
        rec[k] = os.environ.get(k)
    if os.environ.get("WARM_WORKER_PLAIN") == "1":
        print(json.dumps(rec))
        return 0
    d = os.environ["AGENT_TEST_DIR"]
    path = os.path.join(d, "ww.%d.json" % os.getpid())
    with open(path + ".tmp", "w") as f:
        json.dump(rec, f)
    os.rename(path + ".tmp", path)
    print("warm worker %d in round %s" % (os.getpid(), rec["DUCTILE_ROUND"]), flush=True)
    while True:
        for name in ("cmd.all", "cmd.%d" % os.getpid()):
            try:
                with open(os.path.join(d, name)) as f:
                    words = f.read().split()
            except FileNotFoundError:
                continue
            if len(words) == 2 and words[0] == "exit":
                sys.exit(int(words[1]))
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
