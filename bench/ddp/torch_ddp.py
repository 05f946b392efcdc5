"""torch_ddp.py: the baseline for bench/ddp: the same MLP, data and batch
sizes in PyTorch on CPU, with torch.distributed's gloo backend.

usage: torch_ddp.py --world W --batch B --steps N --hidden 256,128 [--no-overlap]
       [--threads T] [--data DIR] [--helper]

Each rank trains `steps` steps of `batch` samples (rank r's slice of each
global batch of a seeded permutation, as ductile-train does), SGD with
momentum 0.9. With DDP (bucket_cap_mb 25, as ours) gradients are all-reduced
during backward; --no-overlap instead all-reduces one flat gradient buffer
after backward. The first 10 steps are warm-up and not timed. Prints one
JSON line: {"samples_per_s": ..., "world": ..., ...} from rank 0.

--helper trains the same steps through the ductile.torch helper (python/):
its group, DDP and a commit (with its one-integer vote) per step; each rank
talks to a stand-in for the agent on a socketpair (hello, one round). The
ratio to the plain run is what the helper costs per step.
"""
import argparse
import gzip
import json
import os
import struct
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../tests/harness"))
from testlib import free_port  # noqa: E402

WARMUP = 10


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    magic, = struct.unpack(">I", data[:4])
    ndim = magic & 0xFF
    dims = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load(data_dir):
    x = read_idx(os.path.join(data_dir, "train-images-idx3-ubyte.gz")).astype(np.float32)
    y = read_idx(os.path.join(data_dir, "train-labels-idx1-ubyte.gz")).astype(np.int64)
    x = (x.reshape(len(x), -1) / 255.0 - 0.2860) / 0.3530
    return torch.from_numpy(x), torch.from_numpy(y)


def mlp(hidden):
    layers, size = [], 784
    for h in hidden:
        layers += [nn.Linear(size, h), nn.ReLU()]
        size = h
    layers.append(nn.Linear(size, 10))
    return nn.Sequential(*layers)


def batches(perm, rank, world, b):
    """Rank r's slice of each global batch of perm, from its start again
    when a whole global batch no longer fits."""
    pos = 0
    while True:
        if pos + world * b > len(perm):
            pos = 0
        yield perm[pos + rank * b: pos + (rank + 1) * b]
        pos += world * b


def helper_worker(rank, args, port, out):
    """The same steps through ductile.torch, with a stand-in agent."""
    import socket
    import threading
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../python"))
    import ductile.torch as dt
    world = args.world
    agent, mine = socket.socketpair()
    os.environ["DUCTILE_CONTROL_FD"] = str(mine.fileno())

    def stand_in():
        for line in agent.makefile("r"):
            if line.startswith("hello"):
                agent.sendall(b"hello 1 inplace\n")
                agent.sendall(("round 1 %d %d %d 0 1 0 127.0.0.1 %d /bench/\n" %
                               (rank, world, rank, port)).encode())
    threading.Thread(target=stand_in, daemon=True).start()
    torch.manual_seed(1)
    x, y = load(args.data)
    model = mlp([int(h) for h in args.hidden.split(",")])
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = dt.State(model, opt, ddp_kwargs={"bucket_cap_mb": 25})
    loss_fn = nn.CrossEntropyLoss()
    perm = torch.from_numpy(np.random.default_rng(1).permutation(len(x)))
    b = args.batch

    def train(state):
        t0, it = None, batches(perm, rank, world, b)
        for step in range(WARMUP + args.steps):
            if step == WARMUP:
                dist.barrier()
                t0 = time.perf_counter()
            ids = next(it)
            opt.zero_grad(set_to_none=False)
            loss = loss_fn(state.ddp(x[ids]), y[ids])
            loss.backward()
            opt.step()
            state.commit(samples=b)
        dist.barrier()
        return time.perf_counter() - t0, loss.item()
    seconds, loss = dt.run(train, state)
    if rank == 0:
        out.put({"samples_per_s": args.steps * b * world / seconds, "seconds": seconds,
                 "world": world, "batch": b, "steps": args.steps, "loss": loss,
                 "helper": True, "torch": torch.__version__})


def worker(rank, args, port, out):
    torch.set_num_threads(args.threads)
    if args.helper:
        return helper_worker(rank, args, port, out)
    world = args.world
    if world > 1:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(1)
    x, y = load(args.data)
    model = mlp([int(h) for h in args.hidden.split(",")])
    if world > 1 and not args.no_overlap:
        model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
    elif world > 1:
        for p in model.parameters():  # the broadcast DDP would do
            dist.broadcast(p.data, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    perm = torch.from_numpy(np.random.default_rng(1).permutation(len(x)))
    b = args.batch
    params = list(model.parameters())
    it = batches(perm, rank, world, b)
    for step in range(WARMUP + args.steps):
        if step == WARMUP:
            if world > 1:
                dist.barrier()
            t0 = time.perf_counter()
        ids = next(it)
        opt.zero_grad(set_to_none=False)
        loss = loss_fn(model(x[ids]), y[ids])
        loss.backward()
        if world > 1 and args.no_overlap:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat)
            flat /= world
            off = 0
            for p in params:
                n = p.numel()
                p.grad.copy_(flat[off:off + n].view_as(p.grad))
                off += n
        opt.step()
    if world > 1:
        dist.barrier()
    seconds = time.perf_counter() - t0
    if rank == 0:
        out.put({"samples_per_s": args.steps * b * world / seconds, "seconds": seconds,
                 "world": world, "batch": b, "steps": args.steps, "loss": loss.item(),
                 "overlap": not args.no_overlap, "torch": torch.__version__})
    if world > 1:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--hidden", default="256,128")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--helper", action="store_true", help="through ductile.torch")
    args = ap.parse_args()
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args, port, out)) for r in range(args.world)]
    for p in procs:
        p.start()
    result = out.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
