"""What distwrap knows about each process group it made (upstream's ``pginfo``).

A process-global registry keyed by the ``ProcessGroup`` object: the group's global ranks (in
group-rank order, with the global-to-group map), its description, and a per-group ``data``
dictionary.  distwrap keeps under ``data``: ``"device_backends"`` (``{device type: backend
name}``, every group), ``"torchcomms"`` (``{device type: TorchComm}``, groups of a
``use_torchcomms=True`` world) and ``"tc_store"`` (the world's shared store, if distwrap made
one).

The accessors raise ``AssertionError`` for a group that is not registered, and
``pg_info_get_data`` for a key the group does not hold, as upstream's do.  Driven from one
thread, like torch.distributed's own group state.  Imports only ``torch.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch.distributed import ProcessGroup


@dataclass
class _PGInfo:
    global_ranks: list[int]
    group_desc: str
    rank_to_group_rank: dict[int, int] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)


_registry: dict[ProcessGroup, _PGInfo] = {}


def _registered(pg: ProcessGroup) -> _PGInfo:
    found = _registry.get(pg)
    if found is None:
        raise AssertionError(f"Process group {pg} not registered")
    return found


def pg_info_create(
    pg: ProcessGroup, global_ranks: list[int] | None, group_desc: str | None
) -> None:
    """Register ``pg`` with its global ranks (group-rank order) and description."""
    if pg in _registry:
        raise AssertionError(f"Process group {pg} already registered")
    ranks = list(global_ranks) if global_ranks is not None else []
    _registry[pg] = _PGInfo(
        global_ranks=ranks,
        group_desc=group_desc or "",
        rank_to_group_rank={g: i for i, g in enumerate(ranks)},
    )


def pg_info_destroy(pg: ProcessGroup) -> None:
    """Forget ``pg`` (nothing happens if it is not registered)."""
    _registry.pop(pg, None)


def pg_info_get(pg: ProcessGroup) -> _PGInfo | None:
    """``pg``'s record, or ``None`` if it is not registered."""
    return _registry.get(pg)


def pg_info_assert_registered(pg: ProcessGroup) -> None:
    """``AssertionError`` unless ``pg`` is registered."""
    assert pg in _registry, f"Process group {pg} not registered"


def pg_info_get_global_ranks(pg: ProcessGroup) -> list[int]:
    """``pg``'s global ranks, in group-rank order."""
    return _registered(pg).global_ranks


def pg_info_get_rank_map(pg: ProcessGroup) -> dict[int, int]:
    """``{global rank: group rank}`` for ``pg``'s members."""
    return _registered(pg).rank_to_group_rank


def pg_info_get_group_desc(pg: ProcessGroup) -> str:
    """The description ``pg`` was registered with (``""`` if none)."""
    return _registered(pg).group_desc


def pg_info_set_data(pg: ProcessGroup, key: str, data: Any) -> None:
    """Keep ``data`` under ``key`` for ``pg``."""
    _registered(pg).data[key] = data


def pg_info_get_data(pg: ProcessGroup, key: str) -> Any:
    """What ``pg`` keeps under ``key`` (``AssertionError`` if nothing)."""
    found = _registered(pg)
    assert key in found.data, f"Key '{key}' not found in process group {pg}"
    return found.data[key]


def _has_data(pg: ProcessGroup, key: str) -> bool:
    found = _registry.get(pg)
    return found is not None and key in found.data


def _forget_all() -> None:
    _registry.clear()
