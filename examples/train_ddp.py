"""DDP training through torch.distributed, on torchcomms when the switch is on.

    TORCH_DISTRIBUTED_USE_TORCHCOMMS=1 torchrun --nproc-per-node 2 examples/train_ddp.py
    torchrun --nproc-per-node 2 examples/train_ddp.py          # plain gloo, same numbers

An unchanged torch.distributed program: init_process_group("gloo"), DDP, a sub-group,
destroy_process_group.  ``--out PATH`` writes rank 0's losses and final parameters (JSON).
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist
from _training import LR, batch, build_model, write_result
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DDP(build_model())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(args.steps):
        x, y = batch(step, rank)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        # The global loss: every rank's batch has the same size, so it is the mean of means.
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / world)

    backend = type(dist.group.WORLD).__name__
    if rank == 0:
        print(f"DDP on {backend}: {world} ranks, losses {[round(v, 6) for v in losses]}")
        if args.out:
            write_result(args.out, losses, model.module.state_dict())
    # Drop everything that holds the process group before destroying it: a gloo group
    # destroyed during interpreter teardown can abort the process (plain gloo, switch off).
    del model, opt
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
