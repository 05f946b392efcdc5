"""torch_elastic.py: a PyTorch DDP script with the ductile.torch helper, for the tests.

It trains a small MLP on a seeded synthetic data set and writes what the
tests check to $AGENT_TEST_DIR/t.<pid>.log, one line each:

  sync ROUND STEP RANK WORLD HASH   the state agreed for ROUND (at STEP) and
                                    a hash of the parameters and optimizer
                                    state (bit-equal ranks hash equal)
  fetch ROUND STEP RANK EPOCH I,J,...  the indices this rank trains in step
                                    STEP (written before the gradients leave)
  done STEP                         training ended

With --plain it uses no helper: torchrun's env:// and a checkpoint-free
loop (the agent must restart it). TORCH_TEST_STEP_S sleeps that long in
each step, so a test can act in the middle of training.
"""
import argparse
import hashlib
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

LOG = os.path.join(os.environ.get("AGENT_TEST_DIR", "."), "t.%d.log" % os.getpid())


def record(line):
    with open(LOG, "a") as f:
        f.write(line + "\n")


def digest(model, opt):
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().cpu().numpy().tobytes())
    for s in opt.state_dict()["state"].values():
        for v in s.values():
            if torch.is_tensor(v):
                h.update(v.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def data(n):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 32, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return x, y


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=960)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--plain", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    step_s = float(os.environ.get("TORCH_TEST_STEP_S", "0"))
    x, y = data(a.samples)
    torch.manual_seed(int(os.environ.get("RANK", "0")) + 100)  # ranks start unequal
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    if a.plain:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        ddp = nn.parallel.DistributedDataParallel(model)
        record("sync %s 0 %d %d %s" % (os.environ.get("DUCTILE_ROUND"), rank, world,
                                       digest(model, opt)))
        for step in range(1, 10 ** 6):
            b = torch.arange(a.batch) + rank * a.batch
            loss = F.cross_entropy(ddp(x[b]), y[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
            print("step %d world %d" % (step, world), flush=True)
            time.sleep(step_s)
            if step >= a.epochs * a.samples // (a.batch * world):
                break
        record("done %d" % step)
        return

    import ductile.torch as dt
    state = dt.State(model, opt, sampler=dt.ElasticSampler(a.samples, a.batch, seed=3))

    def train(state):
        record("sync %d %d %d %d %s" % (state.round, state.step, state.rank, state.world_size,
                                        digest(model, opt)))
        while state.sampler.epoch < a.epochs:
            for idx in state.sampler:
                record("fetch %d %d %d %d %s" % (state.round, state.step + 1, state.rank,
                                                 state.sampler.epoch,
                                                 ",".join(str(i) for i in idx.tolist())))
                out = state.ddp(x[idx])
                loss = F.cross_entropy(out, y[idx], reduction="sum") / a.batch
                opt.zero_grad()
                loss.backward()
                opt.step()
                time.sleep(step_s)
                state.commit(loss=loss.item())
                print("step %d world %d" % (state.step, state.world_size), flush=True)
        return state.step

    done = dt.run(train, state)
    if done is None:
        record("stopped %d" % state.step)
        return
    record("done %d" % done)


if __name__ == "__main__":
    sys.exit(main())
