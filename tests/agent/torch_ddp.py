"""torch_ddp.py: a small, ordinary PyTorch DDP training script.

Nothing in it knows about ductile: it reads torchrun's environment through
init_process_group("gloo", init_method="env://"), trains a small regression
model with DistributedDataParallel on CPU, and checkpoints every step so a
restarted group resumes where the last one was. Used by test_torch.py's
torch_ddp case.

    python torch_ddp.py CKPT_DIR TOTAL_STEPS
"""
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    ckpt_dir, total = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    path = os.path.join(ckpt_dir, "ckpt.pt")
    step = 0
    if os.path.exists(path):
        state = torch.load(path)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        print("resumed at step %d, world size %d, restart %s" %
              (step, world, os.environ.get("TORCHELASTIC_RESTART_COUNT")), flush=True)
    ddp = DDP(model)
    w_true = torch.arange(8, dtype=torch.float32).unsqueeze(1) / 8
    while step < total:
        g = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(32, 8, generator=g)
        y = x @ w_true
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        print("step %d world %d loss %.5f" % (step, world, loss.item()), flush=True)
        if rank == 0:
            tmp = path + ".tmp"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, path)
            with open(os.path.join(ckpt_dir, "progress"), "a") as f:
                f.write("%d %d %s\n" % (step, world, os.environ.get("TORCHELASTIC_RESTART_COUNT")))
        time.sleep(0.05)
    dist.barrier()
    if rank == 0:
        with open(os.path.join(ckpt_dir, "done"), "w") as f:
            f.write("%d %d %.6f\n" % (step, world, loss.item()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
