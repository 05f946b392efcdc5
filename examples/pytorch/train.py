"""Fashion-MNIST with PyTorch DistributedDataParallel: a plain torchrun-style script.

It knows nothing of ductile: init_process_group reads RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT (env://), and it resumes from its own
checkpoint. Under ductile-agent --rebuild restart (or torchrun) every
membership change stops it everywhere and starts it again with the new
ranks; it goes on from its last checkpoint, redoing the steps since.
train_elastic.py is this script with the ductile.torch helper (rebuilt in
place, nothing redone): `diff train.py train_elastic.py` shows all it takes.

    ductile-agent --rdzv-endpoint ETCD --rdzv-id mnist --nnodes 1:4 -- \
        python3 train.py --data /usr/share/datasets/fashion-mnist --checkpoint ckpt.pt
"""
import argparse
import gzip
import os
import struct

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def idx(path, limit):
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    t = torch.frombuffer(bytearray(data[4 + 4 * ndim:]), dtype=torch.uint8).reshape(dims)
    return t[:limit]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--limit", type=int, default=60000, help="train on the first N samples")
    args = p.parse_args()
    x = idx(os.path.join(args.data, "train-images-idx3-ubyte.gz"), args.limit)
    x = x.float().div(255).flatten(1)
    y = idx(os.path.join(args.data, "train-labels-idx1-ubyte.gz"), args.limit).long()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    step, epoch, pos = 0, 0, 0
    if os.path.exists(args.checkpoint):
        ck = torch.load(args.checkpoint)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step, epoch, pos = ck["step"], ck["epoch"], ck["pos"]
    ddp = DDP(model)

    while epoch < args.epochs:
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        while pos < len(x):
            n = min(world * args.batch_size, len(x) - pos)  # this step's samples, all ranks
            b = order[pos + n * rank // world:pos + n * (rank + 1) // world]
            loss = F.cross_entropy(ddp(x[b]), y[b], reduction="sum") / args.batch_size
            opt.zero_grad()
            loss.backward()
            opt.step()
            step, pos = step + 1, pos + n
            if step % 100 == 0 and rank == 0:
                print(f"step {step} epoch {epoch} world {world} loss {loss.item():.4f}", flush=True)
                tmp = args.checkpoint + ".tmp"
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                            "epoch": epoch, "pos": pos}, tmp)
                os.replace(tmp, args.checkpoint)
        epoch, pos = epoch + 1, 0
    if rank == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                    "epoch": epoch, "pos": pos}, args.checkpoint)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
