#!/usr/bin/env python3
"""torchrun_train.py: a training script as torchrun runs one, standard library only.

test_torchrun.py's cases run it with PyTorch's own torchrun command
lines. It checks the environment torchrun promises (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and its sys.argv,
meets every rank at MASTER_ADDR:MASTER_PORT (rank 0 listens there, as
torch's TCPStore does), writes what it saw to AGENT_TEST_DIR/py.RANK.RESTART
.json and prints a line to stdout and stderr. TEST_FAIL: "once" makes rank 1
fail the first attempt; "error" makes it write torch's @record error file
and exit 1.
"""
import json
import os
import socket
import sys
import time


def fail(why):
    print("torchrun_train: " + why, file=sys.stderr, flush=True)
    sys.exit(7)


def meet(rank, world, addr, port):
    """Every rank connects to rank 0, which answers once all are there."""
    deadline = time.monotonic() + 60
    if rank == 0:
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((addr, port))
        srv.listen(world)
        srv.settimeout(60)
        peers = [srv.accept()[0] for _ in range(world - 1)]
        for p in peers:
            p.sendall(b"ok")
            p.close()
        srv.close()
        return
    while True:
        try:
            with socket.create_connection((addr, port), timeout=60) as s:
                if s.recv(2) != b"ok":
                    fail("rank 0 did not answer")
                return
        except OSError:
            if time.monotonic() > deadline:
                fail("cannot reach rank 0 at %s:%d" % (addr, port))
            time.sleep(0.1)


def main():
    env = os.environ
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local, local_world = int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"])
        addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    except (KeyError, ValueError) as e:
        fail("torchrun's environment is incomplete: %r" % e)
    if not (0 <= rank < world and 0 <= local < local_world and addr and 0 < port < 65536):
        fail("inconsistent: RANK %d WORLD_SIZE %d LOCAL_RANK %d LOCAL_WORLD_SIZE %d" %
             (rank, world, local, local_world))
    want = env.get("TEST_ARGV")
    if want is not None and json.loads(want) != sys.argv[1:]:
        fail("sys.argv[1:] is %r, want %s" % (sys.argv[1:], want))
    restart = env.get("TORCHELASTIC_RESTART_COUNT", "")
    record = {k: env.get(k) for k in (
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
        "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE")}
    record["argv"] = sys.argv
    path = os.path.join(env["AGENT_TEST_DIR"], "py.%d.%s.json" % (rank, restart))
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.rename(path + ".tmp", path)
    print("stdout of rank %d" % rank, flush=True)
    print("stderr of rank %d" % rank, file=sys.stderr, flush=True)
    mode = env.get("TEST_FAIL", "")
    if rank == 1 and (mode == "error" or (mode == "once" and restart == "0")):
        if mode == "error":
            with open(env["TORCHELASTIC_ERROR_FILE"], "w") as f:
                json.dump({"message": {"message": "RuntimeError: rank 1 gave up\nsecond line",
                                       "extraInfo": {"py_callstack": "Traceback ...",
                                                     "timestamp": str(int(time.time()))}}}, f)
        sys.exit(1)
    meet(rank, world, addr, port)


if __name__ == "__main__":
    main()
