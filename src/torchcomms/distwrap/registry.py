"""Which mode distwrap is in, and what it knows about each process group.

The registry maps a ``ProcessGroup`` to a ``GroupInfo``: its global ranks, its description,
the ``{device type: backend}`` it was created for and, with ``use_torchcomms=True``, its
``{device type: TorchComm}``.  A ``_BackendWrapper`` group that distwrap did not create (a
``torch.distributed.new_group`` or DeviceMesh group while torchcomms is on) is routed to the
communicator it wraps.

The lookups every routed call makes live here: the group (``None`` is the world), the
communicator for a tensor's device, the default communicator of a group (CPU first, for
calls without a tensor), and global-to-group rank translation with upstream's error texts.

State is process-global, like ``torch.distributed``'s, and driven from one thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d_py

from torchcomms._backend_wrapper import _BackendWrapper
from torchcomms.comm import TorchComm


@dataclass
class GroupInfo:
    """What distwrap keeps for one process group."""

    global_ranks: list[int]
    group_desc: str
    device_backends: dict[str, str]
    comms: dict[str, TorchComm] = field(default_factory=dict)
    #: How many times this group was split (names its children alike on every member).
    splits: int = 0


@dataclass
class _Mode:
    use_torchcomms: bool = False
    eager_init: bool = False
    #: ``dist.config.use_torchcomms`` before a torchcomms world turned it on.
    saved_config: bool | None = None


_mode = _Mode()
_groups: dict[dist.ProcessGroup, GroupInfo] = {}


def torchcomms_is_enabled() -> bool:
    """Whether the current world was created with ``use_torchcomms=True``."""
    return _mode.use_torchcomms


def set_mode(use_torchcomms: bool, eager_init: bool) -> None:
    _mode.use_torchcomms = use_torchcomms
    _mode.eager_init = eager_init


def eager_init_is_enabled() -> bool:
    """Whether ``init_process_group`` got a ``device_id`` (torch then connects eagerly)."""
    return _mode.eager_init


def enable_torch_switch() -> None:
    """Turn on torch's own torchcomms switch for this world's lifetime (restored at the end)."""
    if _mode.saved_config is None:
        _mode.saved_config = bool(dist.config.use_torchcomms)
    dist.config.use_torchcomms = True


def restore_torch_switch() -> None:
    if _mode.saved_config is not None:
        dist.config.use_torchcomms = _mode.saved_config
        _mode.saved_config = None


def register(pg: dist.ProcessGroup, info: GroupInfo) -> None:
    _groups[pg] = info


def forget(pg: dist.ProcessGroup) -> None:
    _groups.pop(pg, None)


def forget_all() -> None:
    _groups.clear()


def info(pg: dist.ProcessGroup) -> GroupInfo | None:
    """The group's entry; a live torchcomms group distwrap did not create gets one on first use."""
    found = _groups.get(pg)
    if found is None and isinstance(pg, _BackendWrapper) and pg in c10d_py._world.pg_group_ranks:
        comm = pg.get_comm()
        found = GroupInfo(
            global_ranks=list(dist.get_process_group_ranks(pg)),
            group_desc=pg.group_desc,
            device_backends={comm.get_device().type: comm.get_backend()},
            comms={comm.get_device().type: comm},
        )
        _groups[pg] = found
    return found


def get_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """``group``, or the world for ``None``."""
    if group is not None:
        return group
    world = dist.group.WORLD
    if world is None:
        raise ValueError(
            "Default process group has not been initialized, please make sure to call "
            "init_process_group."
        )
    return world


def _name(pg: dist.ProcessGroup) -> str:
    try:
        return str(pg.group_name)
    except RuntimeError:
        return repr(pg)


def _comms(pg: dist.ProcessGroup, op: str) -> dict[str, TorchComm]:
    found = info(pg)
    if found is None or not found.comms:
        raise ValueError(
            f"{op}: No torchcomms instances found for process group {_name(pg)!r}: it was not "
            "created by torchcomms.distwrap with use_torchcomms=True (create sub-groups with "
            "distwrap.split_group)"
        )
    return found.comms


def comm_for(
    pg: dist.ProcessGroup,
    op: str,
    tensor: torch.Tensor | None = None,
    device_type: str | None = None,
) -> TorchComm:
    """The group's communicator for ``device_type`` (default: ``tensor``'s device)."""
    if device_type is None:
        if tensor is None:
            raise ValueError(f"{op}: Either device_type or tensor must be provided")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{op}: expected a torch.Tensor, got {type(tensor).__name__}")
        device_type = tensor.device.type
    comms = _comms(pg, op)
    if device_type not in comms:
        raise ValueError(
            f"{op}: No torchcomms instance for device type '{device_type}'. "
            f"Available: {', '.join(sorted(comms))}"
        )
    return comms[device_type]


def default_comm(pg: dist.ProcessGroup, op: str) -> TorchComm:
    """For calls without a tensor (barrier, objects): the only comm, else CPU's, else the first."""
    comms = _comms(pg, op)
    if len(comms) > 1 and "cpu" in comms:
        return comms["cpu"]
    return next(iter(comms.values()))


def global_ranks(pg: dist.ProcessGroup) -> list[int]:
    found = info(pg)
    if found is not None:
        return list(found.global_ranks)
    return list(dist.get_process_group_ranks(pg))


def group_rank(pg: dist.ProcessGroup, global_rank: int, op: str) -> int:
    """``global_rank``'s rank in ``pg``."""
    ranks = global_ranks(pg)
    if not isinstance(global_rank, int) or isinstance(global_rank, bool):
        raise TypeError(f"{op}: a rank must be an int, got {type(global_rank).__name__}")
    if global_rank not in ranks:
        raise ValueError(
            f"{op}: Global rank {global_rank} is not in process group. Group ranks: {ranks}"
        )
    return ranks.index(global_rank)


def resolve_peer(
    pg: dist.ProcessGroup,
    peer: int | None,
    group_peer: int | None,
    names: tuple[str, str],
    op: str,
    default: int | None = None,
) -> int:
    """The group rank meant by ``peer`` (global) or ``group_peer``; exactly one is given.

    ``default`` (a global rank) stands in when neither is, as torch does for the rooted
    calls that default to global rank 0 (scatter, gather and three object collectives).
    """
    what, group_what = names
    if group_peer is None and peer is None and default is not None:
        peer = default
    if group_peer is None:
        if peer is None:
            raise ValueError(f"{op}: Either {what} or {group_what} must be specified")
        return group_rank(pg, peer, op)
    if peer is not None:
        raise ValueError(f"{op}: Cannot specify both {what} and {group_what}")
    return group_peer
