"""FSDP2 (``fully_shard``) training on a DeviceMesh, on torchcomms when the switch is on.

    TORCH_DISTRIBUTED_USE_TORCHCOMMS=1 torchrun --nproc-per-node 2 examples/train_fsdp.py
    TORCH_DISTRIBUTED_USE_TORCHCOMMS=1 torchrun --nproc-per-node 4 examples/train_fsdp.py --tp 2

With ``--tp K`` the mesh is 2-D (``dp`` x ``tp``, K ranks per tensor-parallel group): fc1 is
column-parallel and fc2 row-parallel over ``tp`` (DTensor), and FSDP shards over ``dp``.
With ``--mesh-from-comms`` there is no init_process_group at all: the mesh is built from
torchcomms communicators (a world comm split into the mesh's rows and columns) with
``torchcomms.device_mesh.init_device_mesh``.
``--out PATH`` writes rank 0's losses and full final parameters (JSON).
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist
from _training import LR, batch, build_model, write_result
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)


def mesh_from_comms(tp: int) -> DeviceMesh:
    """A (dp, tp) mesh, or a 1-D dp mesh when tp == 1, built from torchcomms communicators."""
    from torchcomms import new_comm
    from torchcomms.device_mesh import init_device_mesh as init_mesh_from_comms

    world = new_comm("gloo", torch.device("cpu"), name="world")
    rank, size = world.get_rank(), world.get_size()
    if tp == 1:
        return init_mesh_from_comms((world,), ("dp",))
    rows = [list(range(r * tp, (r + 1) * tp)) for r in range(size // tp)]
    cols = [list(range(c, size, tp)) for c in range(tp)]
    # Every rank joins every split (as a member of exactly one group per dimension).
    tp_comm = world.split(rows[rank // tp], f"tp{rank // tp}")
    dp_comm = world.split(cols[rank % tp], f"dp{rank % tp}")
    assert tp_comm is not None and dp_comm is not None
    return init_mesh_from_comms((dp_comm, tp_comm), ("dp", "tp"), _global_comm=world)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (2-D mesh)")
    parser.add_argument("--mesh-from-comms", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    model = build_model()
    if args.mesh_from_comms:
        mesh = mesh_from_comms(args.tp)
    else:
        dist.init_process_group("gloo")
        world = dist.get_world_size()
        shape = (world // args.tp, args.tp) if args.tp > 1 else (world,)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp")[: len(shape)])
    if args.tp > 1:
        parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        dp_mesh = mesh["dp"]
    else:
        dp_mesh = mesh
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
    # Drop everything that holds the process group before destroying it: a gloo group
    # destroyed during interpreter teardown can abort the process (plain gloo, switch off).
    del model, opt, mesh, dp_mesh
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
