"""torchcomms.device_mesh: DeviceMesh built from communicators, without init_process_group.

Run on real ranks: each dimension's group must be our wrapper over the right comm, carry the
right global ranks, be reachable by name (DTensor resolves groups by name), and move data.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import RankContext, run_ranks


def _mesh_2x2(ctx: RankContext) -> dict[str, object]:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    from torchcomms import ReduceOp, new_comm
    from torchcomms.device_mesh import (
        _create_torchcomm_process_group,
        _flatten_with_comm,
        init_device_mesh,
    )

    cpu = torch.device("cpu")
    world = new_comm("gloo", cpu, name="world", store=ctx.store)
    rank = world.get_rank()
    tp_comm = world.split([2 * (rank // 2), 2 * (rank // 2) + 1], f"tp{rank // 2}")
    dp_comm = world.split([rank % 2, rank % 2 + 2], f"dp{rank % 2}")
    assert tp_comm is not None and dp_comm is not None
    try:
        with pytest.raises(RuntimeError, match="no global comm"):
            init_device_mesh((dp_comm, tp_comm), ("dp", "tp"))
        with pytest.raises(ValueError, match="2 comms but 1 mesh_dim_names"):
            init_device_mesh((dp_comm, tp_comm), ("dp",), _global_comm=world)
        if rank in (1, 2):  # swapping the dimensions moves exactly these two ranks
            with pytest.raises(ValueError, match="global comm is rank"):
                init_device_mesh((tp_comm, dp_comm), ("tp", "dp"), _global_comm=world)

        mesh = init_device_mesh((dp_comm, tp_comm), ("dp", "tp"), _global_comm=world)
        assert mesh.mesh.tolist() == [[0, 1], [2, 3]]
        assert mesh.get_rank() == rank
        assert tuple(mesh.get_coordinate()) == (rank // 2, rank % 2)
        dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
        assert type(dp).__name__ == "_BackendWrapper"
        assert (dp.group_name, tp.group_name) == ("dp", "tp")
        assert dp.get_comm() is dp_comm and tp.get_comm() is tp_comm
        assert _resolve_process_group("tp") is tp
        assert dist.get_process_group_ranks(dp) == [rank % 2, rank % 2 + 2]
        assert dist.get_process_group_ranks(tp) == [2 * (rank // 2), 2 * (rank // 2) + 1]
        assert dist.is_initialized() and dist.get_rank() == rank
        assert mesh["tp"].get_group() is tp and mesh["dp"].size() == 2

        # Data moves through each dimension and through torch.distributed's API.
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=tp)
        assert t.item() == float(4 * (rank // 2) + 1), t
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=mesh.get_group("dp"))
        assert t.item() == float(2 * (rank % 2) + 2), t

        flat = _flatten_with_comm(mesh, "dp_tp", world, list(range(4)), mesh._layout)
        assert flat.get_group().get_comm() is world
        assert flat.mesh.flatten().tolist() == [0, 1, 2, 3]
        assert mesh._flatten("dp_tp") is flat
        t = torch.ones(2)
        dist.all_reduce(t, group=flat.get_group())
        assert t.tolist() == [4.0, 4.0]

        with pytest.raises(RuntimeError, match="already exists"):
            _create_torchcomm_process_group(world, "dp")
        # The comm works as before, beside its process group.
        x = torch.ones(1)
        world.all_reduce(x, ReduceOp.SUM, False)
        assert x.item() == 4.0
        return {"ok": True}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()  # finalizes every wrapped comm
        for comm in (tp_comm, dp_comm, world):
            if not comm._finalized:
                comm.finalize()


def _mesh_1d(ctx: RankContext) -> str:
    import torch.distributed as dist

    from torchcomms import new_comm
    from torchcomms.device_mesh import init_device_mesh

    comm = new_comm("gloo", torch.device("cpu"), name="main", store=ctx.store)
    try:
        mesh = init_device_mesh((comm,), ("main",))
        group = mesh.get_group()
        assert group is dist.group.WORLD
        out = torch.empty(ctx.world_size)
        dist.all_gather_into_tensor(out, torch.tensor([float(ctx.rank)]), group=group)
        assert out.tolist() == [float(r) for r in range(ctx.world_size)]
        # The group's store is shared by its ranks (not a process-local HashStore).
        shared = group.get_group_store()
        if ctx.rank == 0:
            shared.set("hello", "from rank 0")
        shared.wait(["hello"])
        assert shared.get("hello") == b"from rank 0"
        # Rank 0 serves the comm's store: nobody finalizes before every rank has read it.
        comm.barrier(False)
        return str(group.group_name)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if not comm._finalized:
            comm.finalize()


def test_two_dimensional_mesh_from_split_comms() -> None:
    assert run_ranks(_mesh_2x2, 4, timeout=120.0) == [{"ok": True}] * 4


def test_one_dimensional_mesh_names_its_group_after_the_dimension() -> None:
    assert run_ranks(_mesh_1d, 2, timeout=90.0) == ["main", "main"]
