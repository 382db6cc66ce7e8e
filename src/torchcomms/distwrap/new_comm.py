"""Process groups: ``init_process_group``, ``new_group``, ``split_group``, ``destroy_process_group``.

Upstream's ``new_comm``.  ``init_process_group(..., use_torchcomms=True)`` makes the world
with torch's own torchcomms switch (``torch.distributed.config.use_torchcomms``) turned on for
the world's lifetime: the default group is a ``_BackendWrapper`` over a ``TorchComm`` that
torch creates on its rendezvous store (with a flight recorder), so distwrap's calls and
torch.distributed's own (DDP, FSDP, a direct ``dist.all_reduce``) run on the same
communicator, in one issue order.  distwrap then gives that communicator the ``timeout``
torch does not pass on.  ``split_group`` splits the parent's communicator (``TorchComm.split``)
and registers the child as a ``_BackendWrapper`` group; ``new_group`` is refused, as upstream
refuses it.

Without torchcomms every call is torch.distributed's, except ``split_group`` where torch
cannot split (gloo, or no ``device_id``): then ``fallback.fallback_split_group_new_group``'s
way.  Every group distwrap makes is registered in ``pginfo``.

Everything is validated before any state changes, so a refused call leaves the process as
it was (and the world, if there is one, usable).
"""

from __future__ import annotations

import hashlib
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed import distributed_c10d as c10d_py

from torchcomms._backend_wrapper import _BackendWrapper
from torchcomms.device_mesh import _create_torchcomm_process_group
from torchcomms.distwrap import pginfo
from torchcomms.distwrap.fallback import _split_by_new_group
from torchcomms.distwrap.pginfo import (
    pg_info_create,
    pg_info_destroy,
    pg_info_get,
    pg_info_set_data,
)
from torchcomms.distwrap.utils import (
    _adopt,
    _dist_backend_string,
    _enable_torch_switch,
    _group_name,
    _pg_options_to_hints,
    _restore_torch_switch,
    _split_comms,
    eager_init_is_enabled,
    format_backend_string,
    get_rank_and_world_size,
    parse_backend_string,
    set_eager_init_enabled,
    set_torchcomms_enabled,
    torchcomms_is_enabled,
)


def _available(device_type: str) -> bool:
    if device_type == "cpu":
        return True
    module = getattr(torch, device_type, None)
    is_available = getattr(module, "is_available", None)
    return bool(is_available()) if callable(is_available) else False


def _check_torchcomms_devices(device_backends: dict[str, str]) -> None:
    for device_type, name in device_backends.items():
        if not _available(device_type):
            raise RuntimeError(
                f"init_process_group: use_torchcomms=True creates a communicator per device "
                f"type, but device type '{device_type}' (backend '{name}') is not available "
                "in this process"
            )
    if len(device_backends) > 1:
        raise RuntimeError(
            "init_process_group: use_torchcomms=True supports one device type per world in "
            f"this implementation, got {format_backend_string(device_backends)!r}"
        )


def _env_rendezvous() -> bool:
    """torch's ``env://`` can meet (it also knows torchrun's agent store): leave it to torch."""
    return "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ


def _shared_store(rank: int, world_size: int, timeout: timedelta | None) -> dist.Store:
    """Upstream's store for a torchcomms world with nowhere to meet: localhost:29500 defaults."""
    host = os.environ.get("MASTER_ADDR", "localhost")
    port = int(os.environ.get("MASTER_PORT", "29500"))
    kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    return dist.TCPStore(
        host_name=host,
        port=port,
        world_size=world_size,
        is_master=rank == 0,
        wait_for_workers=True,
        **kwargs,
    )


def _reset_state() -> None:
    """Forget every group, leave torchcomms mode and restore torch's switch."""
    pginfo._forget_all()
    set_torchcomms_enabled(False)
    set_eager_init_enabled(False)
    _restore_torch_switch()


def init_process_group(
    backend: str | dist.Backend | None = None,
    init_method: str | None = None,
    timeout: timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: dist.Store | None = None,
    group_name: str = "",
    pg_options: Any | None = None,
    device_id: torch.device | int | None = None,
    use_torchcomms: bool = False,
) -> None:
    """Initialize the default process group; ``use_torchcomms=True`` runs it on torchcomms.

    With torchcomms, ``device_id`` is ignored (torch's eager connect does not apply).
    """
    if backend is None:
        raise ValueError("backend must be specified")
    if dist.is_initialized():
        raise ValueError("trying to initialize the default process group twice!")
    device_backends = parse_backend_string(backend)
    rank, world_size = get_rank_and_world_size(rank, world_size)
    tc_store: dist.Store | None = None
    if use_torchcomms:
        _check_torchcomms_devices(device_backends)
        if not c10d_py._TORCHCOMM_AVAILABLE:
            raise RuntimeError(
                "init_process_group: torch.distributed did not load torchcomms at import "
                "(torch.distributed.distributed_c10d._TORCHCOMM_AVAILABLE is False)"
            )
        device_id = None
        if store is None and init_method is None and not _env_rendezvous():
            store = tc_store = _shared_store(rank, world_size, timeout)
        _enable_torch_switch()
    set_torchcomms_enabled(use_torchcomms)
    set_eager_init_enabled(device_id is not None)
    try:
        dist.init_process_group(
            backend=_dist_backend_string(str(backend), device_backends),
            init_method=init_method,
            timeout=timeout,
            world_size=world_size,
            rank=rank,
            store=store,
            group_name=group_name,
            pg_options=pg_options,
            device_id=device_id,
        )
        world = dist.group.WORLD
        if world is None:
            raise AssertionError("World process group is not initialized")
        pg_info_create(world, list(range(world_size)), group_name)
        pg_info_set_data(world, "device_backends", device_backends)
        if use_torchcomms:
            if not isinstance(world, _BackendWrapper):
                raise RuntimeError(
                    "init_process_group: torch did not build the world on torchcomms "
                    f"(default group is {type(world).__name__})"
                )
            comm = world.get_comm()
            if timeout is not None:
                comm.set_timeout(timeout)
                world._set_default_timeout(timeout)
            hints = _pg_options_to_hints(pg_options)
            if hints:
                comm.set_hints(hints)
            pg_info_set_data(world, "tc_store", tc_store)
            pg_info_set_data(world, "torchcomms", {comm.get_device().type: comm})
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()
        _reset_state()
        raise


def _require_init(op: str) -> ProcessGroup:
    world = dist.group.WORLD
    if not dist.is_initialized() or world is None:
        raise AssertionError(f"{op} called before init_process_group")
    return world


def new_group(
    ranks: list[int] | None = None,
    timeout: timedelta | None = None,
    backend: str | None = None,
    pg_options: Any | None = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
    device_id: torch.device | None = None,
) -> ProcessGroup:
    """torch.distributed's ``new_group`` (``backend`` required); refused with torchcomms."""
    _require_init("new_group")
    if torchcomms_is_enabled():
        raise AssertionError("new_group is not supported with torchcomms. Use split_group instead.")
    if backend is None:
        raise ValueError("backend must be specified")
    device_backends = parse_backend_string(backend)
    if ranks is None:
        ranks = list(range(dist.get_world_size()))
    pg = dist.new_group(
        ranks=ranks,
        timeout=timeout,
        backend=_dist_backend_string(backend, device_backends),
        pg_options=pg_options,
        use_local_synchronization=use_local_synchronization,
        group_desc=group_desc,
        device_id=device_id,
    )
    if pg is not dist.GroupMember.NON_GROUP_MEMBER:
        pg_info_create(pg, sorted(ranks), group_desc)
        pg_info_set_data(pg, "device_backends", device_backends)
    return pg


def _my_split(split_ranks: Any, size: int, me: int) -> list[int] | None:
    """Validate ``split_ranks`` (parent ranks) and return this rank's group, sorted."""
    if not isinstance(split_ranks, (list, tuple)) or not split_ranks:
        raise ValueError("split_ranks cannot be None or empty")
    seen: set[int] = set()
    mine: list[int] | None = None
    for ranks in split_ranks:
        ranks = list(ranks)
        if not ranks:
            raise ValueError("the split group cannot be empty")
        bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < size]
        if bad:
            raise ValueError(
                f"split_ranks: rank {bad[0]!r} is outside the parent group (size {size})"
            )
        if len(set(ranks)) != len(ranks) or seen & set(ranks):
            raise ValueError(f"split_ranks: ranks appear more than once in {list(split_ranks)}")
        seen |= set(ranks)
        if me in ranks:
            mine = sorted(ranks)
    return mine


def _device_backends_of(parent: ProcessGroup, backend: str | None) -> dict[str, str]:
    """The child's ``{device: backend}``: ``backend``'s (a subset of the parent's) or the parent's."""
    found = pg_info_get(parent)
    known: dict[str, str] = dict(found.data.get("device_backends", {})) if found else {}
    if backend is None:
        return known
    device_backends = parse_backend_string(backend)
    for device_type, name in device_backends.items():
        if known.get(device_type) not in (None, name) or (known and device_type not in known):
            raise ValueError(
                f"split_group: backend {name!r} for device {device_type!r} is not one of "
                f"the parent group's ({format_backend_string(known)})"
            )
    return device_backends


def split_group(
    parent_pg: ProcessGroup | None = None,
    split_ranks: list[list[int]] | None = None,
    timeout: timedelta | None = None,
    pg_options: Any | None = None,
    group_desc: str | None = None,
    backend: str | None = None,
) -> ProcessGroup | None:
    """This rank's group of ``split_ranks`` (ranks of ``parent_pg``, default the world).

    Every rank of the parent calls it.  A rank in none of the lists takes part, then gets
    ``ValueError`` (upstream's); ``backend`` keeps a subset of the parent's device backends.
    """
    world = _require_init("split_group")
    parent = parent_pg if parent_pg is not None else world
    _adopt(parent)
    me, size = dist.get_rank(parent), dist.get_world_size(parent)
    if me < 0:
        raise ValueError(f"split_group: this rank is not a member of the parent group {parent}")
    if split_ranks is None:
        split_ranks = [list(range(size))]
    mine = _my_split(split_ranks, size, me)
    device_backends = _device_backends_of(parent, backend)
    new_pg: ProcessGroup | None
    if torchcomms_is_enabled():
        new_pg = _split_torchcomms(parent, mine, timeout, pg_options, group_desc, device_backends)
    elif all(b != "gloo" for b in device_backends.values()) and eager_init_is_enabled():
        new_pg = dist.split_group(
            parent,
            split_ranks=split_ranks,
            timeout=timeout,
            pg_options=pg_options,
            group_desc=group_desc,
        )
    else:
        new_pg = _split_by_new_group(parent, mine, timeout, pg_options, group_desc)
    if mine is None or new_pg is None:
        raise ValueError(f"Rank {me} not found in any split_ranks group")
    if pg_info_get(new_pg) is None:
        to_global = list(dist.get_process_group_ranks(parent))
        pg_info_create(new_pg, [to_global[r] for r in mine], group_desc)
        pg_info_set_data(new_pg, "device_backends", device_backends)
    return new_pg


def _split_name(parent: ProcessGroup, count: int, ranks: list[int]) -> str:
    digest = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:12]
    return f"{_group_name(parent)}:split{count}:{digest}"


def _split_torchcomms(
    parent: ProcessGroup,
    mine: list[int] | None,
    timeout: timedelta | None,
    pg_options: Any,
    group_desc: str | None,
    device_backends: dict[str, str],
) -> ProcessGroup | None:
    """Split each of the parent's communicators kept by ``device_backends``; register the child."""
    found = pg_info_get(parent)
    if found is None or not found.data.get("torchcomms"):
        raise ValueError(
            f"split_group: No torchcomms instances found for parent process group {parent}"
        )
    # Every rank of the parent counts the same splits, so the child's name agrees.
    count = found.data["split_count"] = found.data.get("split_count", 0) + 1
    to_global = list(dist.get_process_group_ranks(parent))
    members = [to_global[r] for r in mine] if mine is not None else []
    name = _split_name(parent, count, members)
    children = _split_comms(
        parent, mine or [], name, _pg_options_to_hints(pg_options), timeout, device_backends
    )
    if mine is None or not children:
        return None
    device_type, comm = next(iter(children.items()))
    pg = _create_torchcomm_process_group(
        comm,
        name,
        backend_str=device_backends[device_type],
        global_ranks_mapping={g: i for i, g in enumerate(members)},
    )
    assert isinstance(pg, _BackendWrapper)
    pg._set_group_desc(group_desc or name)
    pg._set_default_timeout(comm.get_options().timeout)
    pg_info_create(pg, members, group_desc)
    pg_info_set_data(pg, "device_backends", dict(device_backends))
    pg_info_set_data(pg, "torchcomms", children)
    return pg


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Destroy ``group`` (default: the world and every group); finalizes its communicators."""
    world = dist.group.WORLD
    if group is None:
        group = world
    if group is None:
        raise AssertionError("Process group is not initialized")
    whole = group is world
    try:
        # torch finalizes the communicator of every _BackendWrapper group it destroys.
        dist.destroy_process_group(group)
    finally:
        if whole:
            _reset_state()
        else:
            pg_info_destroy(group)
