"""torch_mlp.py: the PyTorch DDP twin of ductile-train's MLP for bench/recovery.

Run by torchrun (env:// init, gloo on CPU): MLP 784-256-128-10 on the first
--limit-train Fashion-MNIST samples, per-rank batch --batch, SGD with
momentum; rank r takes its slice of each global batch of a seeded
permutation, as ductile-train does. Rank 0 saves a checkpoint (model,
optimizer, step, position) every --checkpoint-every steps and every
process resumes from it when torchrun restarts the workers. Every rank
prints "step N world W" after each step, which the bench timestamps.

With --inplace it uses the ductile.torch helper instead (ductile-agent
--rebuild inplace): the same model, data and batches, kept in the same
process across membership changes; "world W resumed at step S" is printed
after each rebuild.
"""
import argparse
import datetime
import gzip
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn


def idx(path):
    with gzip.open(path) as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, np.uint8, offset=4 + 4 * dims).reshape(shape)


def load(a):
    x = idx(os.path.join(a.data, "train-images-idx3-ubyte.gz"))[:a.limit_train]
    y = idx(os.path.join(a.data, "train-labels-idx1-ubyte.gz"))[:a.limit_train]
    x = torch.from_numpy(x.reshape(len(x), -1).astype(np.float32) / 255.0)
    return x, torch.from_numpy(y.astype(np.int64))


def mlp():
    return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
                         nn.Linear(128, 10))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--limit-train", type=int, default=6000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--epochs", type=int, default=1000)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--inplace", action="store_true", help="rebuild in place (ductile.torch)")
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.inplace:
        return inplace(a)
    # A generous connect deadline: on 2 busy cores a restarted peer can take
    # several seconds to import torch and listen.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = load(a)
    n = len(x)
    torch.manual_seed(a.seed)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step, pos, epoch = 0, 0, 0
    if os.path.exists(a.checkpoint):
        ck = torch.load(a.checkpoint, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step, pos, epoch = ck["step"], ck["pos"], ck["epoch"]
    ddp = nn.parallel.DistributedDataParallel(model)
    print("world %d resumed at step %d" % (world, step), flush=True)
    loss_fn = nn.CrossEntropyLoss()
    while epoch < a.epochs:
        perm = torch.from_numpy(np.random.default_rng(a.seed + epoch).permutation(n))
        while pos < n:
            gb = min(world * a.batch, n - pos)
            lo = pos + gb * rank // world
            hi = pos + gb * (rank + 1) // world
            ids = perm[lo:hi]
            opt.zero_grad()
            loss = loss_fn(ddp(x[ids]), y[ids])
            loss.backward()
            opt.step()
            step += 1
            pos += gb
            print("step %d world %d" % (step, world), flush=True)
            if rank == 0 and step % a.checkpoint_every == 0:
                tmp = a.checkpoint + ".tmp"
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                            "pos": pos, "epoch": epoch}, tmp)
                os.replace(tmp, a.checkpoint)
        pos = 0
        epoch += 1
    dist.destroy_process_group()


def inplace(a):
    import ductile.torch as dt
    x, y = load(a)
    torch.manual_seed(a.seed)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = dt.State(model, opt, sampler=dt.ElasticSampler(len(x), a.batch, seed=a.seed))
    loss_fn = nn.CrossEntropyLoss(reduction="sum")

    def train(state):
        print("world %d resumed at step %d" % (state.world_size, state.step), flush=True)
        while state.sampler.epoch < a.epochs:
            for ids in state.sampler:
                opt.zero_grad()
                loss = loss_fn(state.ddp(x[ids]), y[ids]) / a.batch
                loss.backward()
                opt.step()
                state.commit()
                print("step %d world %d" % (state.step, state.world_size), flush=True)
    dt.run(train, state, timeout=300)


if __name__ == "__main__":
    main()
