"""torch_cuda.py: the GPU baseline for tests/gpu/run.sh: the MLP or the CNN
that ductile-train trains, in PyTorch eager mode, DistributedDataParallel
over NCCL, one process per GPU (torch_ddp.py is the CPU/gloo baseline of
bench/ddp; this one reuses its data loading, MLP and batch slicing).

usage: torch_cuda.py --world W --model mlp|cnn [--batch B] [--steps N]
       [--warmup K] [--data DIR] [--timeout S]

The models are ductile-train's defaults: MLP 784-256-128-10; CNN two blocks
of 5x5 convolution (same padding) + ReLU + 2x2 max-pool, 16 then 32
channels, then 1568-128-10. Rank r trains on GPU r (of the devices
CUDA_VISIBLE_DEVICES leaves) with its slice of each global batch of a seeded
permutation, SGD with momentum 0.9, DDP with bucket_cap_mb 25. Plain FP32:
TF32 is turned off for matmuls and convolutions (ductile-train's cuBLAS calls
are FP32). Each step gathers the batch on the host into one of two pinned
buffers and copies it to the GPU without blocking, as ductile-train does;
unlike ductile-train (which reads each step's loss back) it never waits for
the GPU within the loop. The first K steps (10) are warm-up; the next N
(300) are timed between a CUDA sync and a barrier at each end. Prints one
JSON line from rank 0: {"samples_per_s": ..., "world": ..., ...}.
Exit 1 when a rank fails or the run takes over --timeout seconds (600).
"""
import argparse
import json
import os
import queue
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_ddp import batches, load, mlp  # noqa: E402
from testlib import free_port  # noqa: E402  (torch_ddp put tests/harness on the path)


def cnn():
    return nn.Sequential(
        nn.Conv2d(1, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))


def worker(rank, args, port, out):
    world = args.world
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if world > 1:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("nccl", rank=rank, world_size=world)
    torch.manual_seed(1)
    x, y = load(args.data)
    shape = (-1, 1, 28, 28) if args.model == "cnn" else (-1, 28 * 28)
    model = (cnn() if args.model == "cnn" else mlp([256, 128])).to(dev)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[rank], bucket_cap_mb=25)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    perm = torch.from_numpy(np.random.default_rng(1).permutation(len(x)))
    b = args.batch
    # Two pinned staging buffers: one is filled while the other's copy may
    # still be in flight; a buffer is refilled only once its copy is done.
    hx = [torch.empty((b, x.shape[1]), dtype=x.dtype).pin_memory() for _ in range(2)]
    hy = [torch.empty(b, dtype=y.dtype).pin_memory() for _ in range(2)]
    copied = [torch.cuda.Event() for _ in range(2)]
    it = batches(perm, rank, world, b)

    def sync():
        torch.cuda.synchronize()
        if world > 1:
            dist.barrier(device_ids=[rank])
            torch.cuda.synchronize()

    t0 = None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            sync()
            t0 = time.perf_counter()
        s = step % 2
        copied[s].synchronize()
        ids = next(it)
        torch.index_select(x, 0, ids, out=hx[s])
        torch.index_select(y, 0, ids, out=hy[s])
        xb = hx[s].to(dev, non_blocking=True).view(shape)
        yb = hy[s].to(dev, non_blocking=True)
        copied[s].record()
        opt.zero_grad(set_to_none=False)
        loss = loss_fn(model(xb), yb)
        loss.backward()
        opt.step()
    sync()
    seconds = time.perf_counter() - t0
    if rank == 0:
        out.put({"samples_per_s": args.steps * b * world / seconds, "seconds": seconds,
                 "world": world, "model": args.model, "batch": b, "steps": args.steps,
                 "loss": loss.item(), "device": torch.cuda.get_device_name(dev),
                 "torch": torch.__version__})
    if world > 1:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--model", choices=("mlp", "cnn"), default="mlp")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    if args.world < 1 or args.steps < 1 or args.warmup < 0 or args.batch < 1:
        sys.exit("torch_cuda: --world, --steps and --batch must be positive, --warmup >= 0")
    if not torch.cuda.is_available() or torch.cuda.device_count() < args.world:
        sys.exit("torch_cuda: %d ranks but torch sees %d CUDA devices" %
                 (args.world, torch.cuda.device_count() if torch.cuda.is_available() else 0))
    if args.world > 1 and not dist.is_nccl_available():
        sys.exit("torch_cuda: this torch has no NCCL")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")  # bootstrap on 127.0.0.1 only
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args, port, out)) for r in range(args.world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout
    result, why = None, None
    while result is None and why is None:
        try:
            result = out.get(timeout=1)
        except queue.Empty:
            dead = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                why = "rank %d exited %s" % dead[0]
            elif time.monotonic() > deadline:
                why = "no result within %.0f s" % args.timeout
    for p in procs:
        p.join(timeout=60 if why is None else 5)
        if p.is_alive():
            p.kill()
            p.join()
    if why:
        sys.exit("torch_cuda: " + why)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
