"""torch.distributed gloo allreduce, timed the way bench_allreduce times ours.

    python torch_gloo.py --ranks W [--min-bytes B] [--max-bytes B]

Starts W processes on 127.0.0.1 (TCP store on a free port), allreduces a
float32 tensor at sizes doubling from min to max bytes (2 warm-up ops, then
enough ops for about half a second of traffic, at least 5), and prints on
rank 0 the same columns: bytes seconds_per_op algbw_GBps busbw_GBps.
One intra-op thread per rank, like the ring (one thread per rank).
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../tests/harness"))
from testlib import free_port  # noqa: E402


def run(rank, world, port, lo, hi):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    buf = torch.ones(hi // 4, dtype=torch.float32)
    size = lo
    while size <= hi:
        t = buf[: size // 4]
        iters = min(200, max(5, (512 << 20) // size))
        for _ in range(2):
            dist.all_reduce(t)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        dist.barrier()
        dt = (time.perf_counter() - t0) / iters
        alg = size / dt / 1e9
        if rank == 0:
            print(f"{size} {dt:.9f} {alg:.4f} {alg * 2 * (world - 1) / world:.4f}", flush=True)
        size *= 2
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, required=True)
    ap.add_argument("--min-bytes", type=int, default=4096)
    ap.add_argument("--max-bytes", type=int, default=64 << 20)
    a = ap.parse_args()
    if a.ranks < 2 or a.min_bytes < 4 or a.max_bytes < a.min_bytes:
        sys.exit("torch_gloo.py: need --ranks >= 2 and 4 <= min <= max bytes")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(run, args=(a.ranks, free_port(), a.min_bytes, a.max_bytes),
                       nprocs=a.ranks, join=True, start_method="fork")


if __name__ == "__main__":
    main()
