"""DeviceMesh from communicators: FSDP2 / TP / DTensor on torchcomms without init_process_group.

``init_device_mesh((dp_comm, tp_comm), ("dp", "tp"), _global_comm=world)`` wraps each comm in
a ``_BackendWrapper`` process group, registers it in ``torch.distributed``'s group tables
under the dimension's name (so name-based lookups such as DTensor's functional collectives
resolve to it), makes the global comm's group the default group if none exists, and returns
a ``DeviceMesh`` whose dimension groups are those wrappers.

Not imported by ``torchcomms/__init__`` (it imports ``torch.distributed`` at module level).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d_py
from torch.distributed.device_mesh import DeviceMesh

from torchcomms._backend_wrapper import _BackendWrapper
from torchcomms.comm import TorchComm, new_comm

BACKEND_STR = "torchcomm"


def _ensure_backend_registered(device_type: str) -> None:
    """Make ``"torchcomm"`` a known ``torch.distributed`` backend name (DeviceMesh checks it)."""
    if BACKEND_STR.upper() in dist.Backend._plugins or BACKEND_STR in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND_STR, new_comm, devices=[device_type])


def _create_torchcomm_process_group(
    comm: TorchComm,
    group_name: str,
    backend_str: str = BACKEND_STR,
    global_ranks_mapping: dict[int, int] | None = None,
) -> dist.ProcessGroup:
    """A process group over ``comm``, registered in torch.distributed as ``group_name``.

    ``global_ranks_mapping`` maps global rank -> rank in this group (default: identity).
    """
    if group_name in c10d_py._world.pg_names.values():
        raise RuntimeError(
            f"_create_torchcomm_process_group: a process group named {group_name!r} already "
            "exists in this process"
        )
    pg = _BackendWrapper(comm)
    pg._set_group_name(group_name)
    pg._set_group_desc(group_name)
    mapping = (
        dict(global_ranks_mapping)
        if global_ranks_mapping is not None
        else {r: r for r in range(comm.get_size())}
    )
    c10d_py._register_pg_in_world(
        pg,
        backend_name=backend_str,
        store=pg.get_group_store(),
        group_name=c10d_py.GroupName(group_name),
        backend_config=f"{comm.get_device().type}:{backend_str}",
        rank_mapping=mapping,
    )
    return pg


def init_device_mesh(
    mesh_dim_comms: Sequence[TorchComm],
    mesh_dim_names: Sequence[str],
    _global_comm: TorchComm | None = None,
) -> DeviceMesh:
    """A DeviceMesh with one dimension per communicator (row-major rank layout).

    Dimension ``d``'s group is ``mesh_dim_comms[d]`` and is named ``mesh_dim_names[d]``;
    a rank's global rank is its index in ``arange(prod(sizes)).view(sizes)``.
    """
    comms = tuple(mesh_dim_comms)
    names = tuple(mesh_dim_names)
    if not comms:
        raise ValueError("init_device_mesh: mesh_dim_comms must not be empty")
    if len(comms) != len(names):
        raise ValueError(f"init_device_mesh: {len(comms)} comms but {len(names)} mesh_dim_names")
    if len(set(names)) != len(names):
        raise ValueError(f"init_device_mesh: mesh_dim_names must be unique, got {names}")
    if len(comms) > 1 and _global_comm is None:
        raise RuntimeError(
            "More than one torch comm objects are passed but no global comm(_global_comm) is "
            "provided. Please pass the communicator spanning every rank of the mesh as "
            "_global_comm."
        )
    device_type = comms[0].get_device().type
    sizes = tuple(c.get_size() for c in comms)
    mesh = torch.arange(math.prod(sizes), dtype=torch.int).view(sizes)
    coords = tuple(c.get_rank() for c in comms)
    global_rank = int(mesh[coords])
    global_comm = _global_comm if _global_comm is not None else comms[0]
    if global_comm.get_size() != mesh.numel() or global_comm.get_rank() != global_rank:
        raise ValueError(
            f"init_device_mesh: the global comm is rank {global_comm.get_rank()} of "
            f"{global_comm.get_size()}, but the dimension comms place this rank at {coords} of "
            f"a {sizes} mesh (global rank {global_rank} of {mesh.numel()})"
        )
    _ensure_backend_registered(device_type)

    dim_groups: list[dist.ProcessGroup] = []
    for dim, (comm, name) in enumerate(zip(comms, names, strict=True)):
        index: list[Any] = list(coords)
        index[dim] = slice(None)
        members = mesh[tuple(index)].flatten().tolist()
        mapping = {g: i for i, g in enumerate(members)}
        dim_groups.append(_create_torchcomm_process_group(comm, name, global_ranks_mapping=mapping))

    if not dist.is_initialized():
        if _global_comm is None:
            world = dim_groups[0]
        else:
            world = _create_torchcomm_process_group(_global_comm, _global_comm.get_name())
        c10d_py._update_default_pg(world)

    device_mesh = DeviceMesh(
        device_type, mesh, mesh_dim_names=names, _init_backend=False, _rank=global_rank
    )
    device_mesh._dim_group_names = [pg.group_name for pg in dim_groups]
    for pg in dim_groups:
        device_mesh._pg_registry[pg.group_name] = pg
    return device_mesh


def _flatten_with_comm(
    mesh: DeviceMesh,
    mesh_dim_name: str,
    comm: TorchComm,
    global_ranks: Sequence[int],
    layout: Any,
) -> DeviceMesh:
    """Register ``comm`` as the flattened dimension ``mesh_dim_name`` of ``mesh``'s root.

    ``global_ranks`` are the global ranks of ``comm`` in its rank order; ``layout`` is the
    ``_MeshLayout`` of the dimensions being flattened (collapsed to one dimension here).
    """
    root = mesh._get_root_mesh()
    existing = root._flatten_mapping.get(mesh_dim_name)
    if existing is not None:
        return existing
    pg = _create_torchcomm_process_group(
        comm, mesh_dim_name, global_ranks_mapping={g: i for i, g in enumerate(global_ranks)}
    )
    flat_layout = layout.collapse() if hasattr(layout, "collapse") else layout.coalesce()
    layout_cls = type(layout)
    flat = DeviceMesh(
        root._device_type,
        _layout=layout_cls([flat_layout]) if len(layout) > 1 else layout,
        _rank_map=root._rank_map,
        mesh_dim_names=(mesh_dim_name,),
        _root_mesh=root,
        _init_backend=False,
        _rank=root._rank,
    )
    flat._dim_group_names = [pg.group_name]
    root._flatten_mapping[mesh_dim_name] = flat
    root._pg_registry[pg.group_name] = pg
    return flat
