"""Fashion-MNIST with PyTorch DistributedDataParallel, rebuilt in place.

train.py with the ductile.torch helper (pip install ./python): under
ductile-agent --rebuild inplace a membership change (a pod lost, a node
leaving or joining) keeps these processes: the helper ends the step at its
boundary, builds the new round's group, sends the newest state (model,
optimizer, sampler position) to every rank and calls train() again.
No sample is skipped or trained twice, and nothing is reloaded. The
checkpoint is only for a restart of the whole job.

    ductile-agent --rdzv-endpoint ETCD --rdzv-id mnist --nnodes 1:4 --rebuild inplace -- \
        python3 train_elastic.py --data /usr/share/datasets/fashion-mnist --checkpoint ckpt.pt
"""
import argparse
import gzip
import os
import struct

import torch
import torch.nn as nn
import torch.nn.functional as F

import ductile.torch as dt


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

    state = dt.State(model, opt, sampler=dt.ElasticSampler(len(x), args.batch_size))
    state.load(args.checkpoint)

    def train(state):
        while state.sampler.epoch < args.epochs:
            for b in state.sampler:  # this rank's share of the step's samples
                loss = F.cross_entropy(state.ddp(x[b]), y[b], reduction="sum") / args.batch_size
                opt.zero_grad()
                loss.backward()
                opt.step()
                state.commit(loss=loss.item())
                if state.step % 100 == 0 and state.rank == 0:
                    print(f"step {state.step} epoch {state.sampler.epoch} "
                          f"world {state.world_size} loss {loss.item():.4f}", flush=True)
                    state.save(args.checkpoint)

    dt.run(train, state)
    if state.rank == 0:
        state.save(args.checkpoint)


if __name__ == "__main__":
    main()
