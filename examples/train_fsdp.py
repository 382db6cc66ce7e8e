"""FSDP2 (``fully_shard``) training on a DeviceMesh, on torchcomms when the switch is on.

    TORCH_DISTRIBUTED_USE_TORCHCOMMS=1 torchrun --nproc-per-node 2 examples/train_fsdp.py
    TORCH_DISTRIBUTED_USE_TORCHCOMMS=1 torchrun --nproc-per-node 4 examples/train_fsdp.py --tp 2

With ``--tp K`` the mesh is 2-D (``dp`` × ``tp``, K ranks per tensor-parallel group): fc1 is
column-parallel and fc2 row-parallel over ``tp`` (DTensor), and FSDP shards over ``dp``.
``--out PATH`` writes rank 0's losses and full final parameters (JSON).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from _training import LR, batch, build_model, write_result
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (2-D mesh)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    model = build_model()
    if args.tp > 1:
        mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        dp_mesh = mesh["dp"]
    else:
        dp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    fully_shard(model.fc1, mesh=dp_mesh)
    fully_shard(model.fc2, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    dp_rank, dp_size = dp_mesh.get_local_rank(), dp_mesh.size()
    losses = []
    for step in range(args.steps):
        x, y = batch(step, dp_rank)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, group=dp_mesh.get_group())
        losses.append(global_loss.item() / dp_size)

    full = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach()
        for k, v in model.state_dict().items()
    }
    if dist.get_rank() == 0:
        kind = f"{dp_size}x{args.tp} (dp x tp)" if args.tp > 1 else f"{dp_size} ranks"
        backend = type(dist.group.WORLD).__name__
        print(f"FSDP2 on {backend}: {kind}, losses {[round(v, 6) for v in losses]}")
        if args.out:
            write_result(args.out, losses, full)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
