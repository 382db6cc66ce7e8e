"""DDP training written for torch.distributed, moved to torchcomms by one import.

    torchrun --nproc-per-node 2 examples/distwrap_ddp.py                    # on torchcomms
    USE_TORCHCOMMS=0 torchrun --nproc-per-node 2 examples/distwrap_ddp.py   # torch's own gloo

``examples/train_ddp.py`` with ``import torch.distributed as dist`` replaced by
``from torchcomms import distwrap as dist`` and ``use_torchcomms=`` given to
``init_process_group`` (upstream's distwrap switch; ``USE_TORCHCOMMS`` here).  DDP and the
loss all_reduce run on the world's TorchComm; with ``USE_TORCHCOMMS=0`` every call is
torch.distributed's own.  ``--out PATH`` writes rank 0's losses and final parameters (JSON).
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
from _training import LR, batch, build_model, write_result
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from torchcomms import distwrap as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    dist.init_process_group("gloo", use_torchcomms=os.environ.get("USE_TORCHCOMMS", "1") == "1")
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
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / world)

    backend = type(dist.group.WORLD).__name__
    if rank == 0:
        print(f"distwrap DDP on {backend}: {world} ranks, losses {[round(v, 6) for v in losses]}")
        if args.out:
            write_result(args.out, losses, model.module.state_dict())
    del model, opt
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
