"""distwrap's mode, backend strings, rank and size, and the lookups every routed call makes.

Upstream's ``utils``:

* the mode: ``set_torchcomms_enabled`` / ``torchcomms_is_enabled`` (whether the world was made
  with ``use_torchcomms=True``) and ``set_eager_init_enabled`` / ``eager_init_is_enabled``
  (whether ``init_process_group`` got a ``device_id``);
* ``parse_backend_string`` (``"gloo"`` or ``"cpu:gloo,cuda:nccl"`` into ``{device: backend}``)
  and its inverse ``format_backend_string``;
* ``get_rank_and_world_size``: ``-1`` arguments from the environment, in upstream's order
  (Open MPI, torchrun, Slurm, PMI);
* ``get_group``, ``get_torchcomms_instance``, ``get_group_rank``, ``get_backend_for_device``:
  a group's communicator for a device, global-to-group ranks and backend names, from the
  group's ``pginfo`` record, with upstream's errors;
* ``torchcomms_create_split_group``: a registered group's communicators, split from its
  parent's.

Besides those, the private helpers the routed calls share: turning torch's own torchcomms
switch on for a torchcomms world's lifetime, adopting a ``_BackendWrapper`` group that torch
made on such a world (``torch.distributed.new_group``, DeviceMesh) so distwrap routes it too,
and the same lookups with the calling op's name in their errors.

State is process-global, like ``torch.distributed``'s, and driven from one thread.
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
from torchcomms.comm import TorchComm
from torchcomms.distwrap.pginfo import (
    _has_data,
    pg_info_create,
    pg_info_get,
    pg_info_get_data,
    pg_info_get_global_ranks,
    pg_info_get_rank_map,
    pg_info_set_data,
)

# -- the mode --------------------------------------------------------------------------------

_use_torchcomms: bool = False
_eager_init_enabled: bool = False
#: ``dist.config.use_torchcomms`` as it was before a torchcomms world turned it on.
_saved_torch_switch: bool | None = None


def set_torchcomms_enabled(enabled: bool) -> None:
    """Route distwrap's calls to communicators (``True``) or to torch.distributed."""
    global _use_torchcomms
    _use_torchcomms = bool(enabled)


def torchcomms_is_enabled() -> bool:
    """Whether the current world was created with ``use_torchcomms=True``."""
    return _use_torchcomms


def set_eager_init_enabled(enabled: bool) -> None:
    """Record whether ``init_process_group`` got a ``device_id`` (torch connects eagerly)."""
    global _eager_init_enabled
    _eager_init_enabled = bool(enabled)


def eager_init_is_enabled() -> bool:
    """Whether ``init_process_group`` got a ``device_id``."""
    return _eager_init_enabled


def _enable_torch_switch() -> None:
    """Turn on torch's own torchcomms switch for this world's lifetime (restored at the end)."""
    global _saved_torch_switch
    if _saved_torch_switch is None:
        _saved_torch_switch = bool(dist.config.use_torchcomms)
    dist.config.use_torchcomms = True


def _restore_torch_switch() -> None:
    global _saved_torch_switch
    if _saved_torch_switch is not None:
        dist.config.use_torchcomms = _saved_torch_switch
        _saved_torch_switch = None


# -- backend strings -------------------------------------------------------------------------

#: Bare backend names and the device type each one serves (upstream's table).
_BACKEND_DEFAULT_DEVICES: dict[str, str] = {
    "nccl": "cuda",
    "ncclx": "cuda",
    "rccl": "cuda",
    "rcclx": "cuda",
    "gloo": "cpu",
    "hccl": "mtia",
}

#: Backend names torch.distributed does not know, and the name it knows them by.
_BACKEND_RENAME_FOR_DIST: dict[str, str] = {"ncclx": "nccl", "rcclx": "rccl"}


def _check_device_key(key: str, backend: str) -> None:
    try:
        device = torch.device(key)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type != key:
        raise ValueError(
            f"Invalid device type '{key}' in backend string '{backend}': each part must be "
            "'<device type>:<backend>' with a torch device type such as 'cpu' or 'cuda' "
            "(e.g. 'cpu:gloo,cuda:nccl')"
        )


def parse_backend_string(backend: str) -> dict[str, str]:
    """``{device type: backend name}`` for a bare (``"gloo"``) or merged backend string.

    A bare name maps to its default device (``gloo``: cpu; ``nccl``, ``ncclx``, ``rccl``,
    ``rcclx``: cuda; ``hccl``: mtia); an unknown bare name, a part without exactly one colon,
    a device key that is not a torch device type, or a device named twice is a ``ValueError``.
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    text = str(backend).strip()
    if ":" not in text:
        name = text.lower()
        if name not in _BACKEND_DEFAULT_DEVICES:
            raise ValueError(
                f"Unknown backend: '{text}'. Known backends are: "
                f"{', '.join(sorted(_BACKEND_DEFAULT_DEVICES))}"
            )
        return {_BACKEND_DEFAULT_DEVICES[name]: name}
    device_backends: dict[str, str] = {}
    for part in text.split(","):
        pieces = part.split(":")
        if len(pieces) != 2:
            raise ValueError(
                f"Invalid backend format: '{part}'. Each part in merged form must have exactly "
                f"one colon (e.g., 'cpu:gloo,cuda:nccl'), got {len(pieces) - 1} colons."
            )
        device_type, name = (p.strip() for p in pieces)
        _check_device_key(device_type, text)
        if not name:
            raise ValueError(f"Invalid backend format: '{part}': the backend name is empty")
        if device_type in device_backends:
            raise ValueError(
                f"Invalid backend string '{text}': device type '{device_type}' appears twice"
            )
        device_backends[device_type] = name.lower()
    return device_backends


def format_backend_string(device_backends: dict[str, str]) -> str:
    """The merged form of ``device_backends`` (the inverse of ``parse_backend_string``)."""
    return ",".join(f"{device}:{name}" for device, name in device_backends.items())


def _dist_backend_string(backend: str, device_backends: dict[str, str]) -> str:
    """What torch.distributed is given: the caller's string, unless a name needs renaming."""
    renamed = {d: _BACKEND_RENAME_FOR_DIST.get(b, b) for d, b in device_backends.items()}
    if renamed == device_backends:
        return str(backend)  # torch's own parsing of the caller's string, bit for bit
    return format_backend_string(renamed)


# -- rank and world size ---------------------------------------------------------------------

#: (rank variable, size variable) pairs, in the order they are looked up.
_RANK_ENV_PAIRS: tuple[tuple[str, str], ...] = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("RANK", "WORLD_SIZE"),
    ("SLURM_PROCID", "SLURM_NTASKS"),
    ("PMI_RANK", "PMI_SIZE"),
)


def _env_int(var: str) -> int:
    raw = os.environ[var]
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {var} must be an integer, got {raw!r}") from None


def get_rank_and_world_size(rank: int, world_size: int) -> tuple[int, int]:
    """``rank`` and ``world_size``, each ``-1`` taken from the first variable of its kind set.

    ``AssertionError`` if one stays unknown; ``ValueError`` for a size below 1 or a rank
    outside the world.
    """
    if rank == -1:
        for rank_var, _ in _RANK_ENV_PAIRS:
            if rank_var in os.environ:
                rank = _env_int(rank_var)
                break
    if world_size == -1:
        for _, size_var in _RANK_ENV_PAIRS:
            if size_var in os.environ:
                world_size = _env_int(size_var)
                break
    if rank == -1:
        raise AssertionError(
            "rank must be specified either as a parameter or via environment "
            "variables (RANK, OMPI_COMM_WORLD_RANK, SLURM_PROCID, or PMI_RANK)"
        )
    if world_size == -1:
        raise AssertionError(
            "world_size must be specified either as a parameter or via environment "
            "variables (WORLD_SIZE, OMPI_COMM_WORLD_SIZE, SLURM_NTASKS, or PMI_SIZE)"
        )
    if world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world: expected 0 <= rank < {world_size}")
    return rank, world_size


# -- pg_options as hints ---------------------------------------------------------------------


def _public_values(obj: Any) -> dict[str, str]:
    found: dict[str, str] = {}
    for attr in dir(obj):
        if attr.startswith("_") or attr in ("config", "hints"):
            continue
        try:
            value = getattr(obj, attr)
        except Exception:  # a property that cannot be read on this build: not a hint
            continue
        if not callable(value):
            found[attr] = str(value)
    return found


def _pg_options_to_hints(pg_options: Any) -> dict[str, str] | None:
    """A ``pg_options`` object as hints: its public plain attributes (and ``config``'s), as str.

    A dict is taken as hints; an options object that carries ``hints`` (torchcomms' own)
    contributes them as they are.
    """
    if pg_options is None:
        return None
    if isinstance(pg_options, dict):
        return {str(k): str(v) for k, v in pg_options.items()} or None
    hints = _public_values(pg_options)
    config = getattr(pg_options, "config", None)
    if config is not None:
        hints.update(_public_values(config))
    own = getattr(pg_options, "hints", None)
    if isinstance(own, dict):
        hints.update({str(k): str(v) for k, v in own.items()})
    return hints or None


# -- lookups ---------------------------------------------------------------------------------


def get_group(group: ProcessGroup | None) -> ProcessGroup:
    """``group``, or the world for ``None`` (``AssertionError`` if there is none)."""
    if group is not None:
        return group
    world = dist.group.WORLD
    if world is None:
        raise AssertionError("dist.group.WORLD is not initialized")
    return world


def get_torchcomms_instance(
    group: ProcessGroup,
    device_type: str | None = None,
    tensor: torch.Tensor | None = None,
) -> Any:
    """The group's communicator for ``device_type`` (default: ``tensor``'s device type).

    ``ValueError`` if neither is given or the group has no communicator for that device type;
    ``AssertionError`` if the group is not registered or has no communicators.
    """
    if device_type is None:
        if tensor is None:
            raise ValueError("Either device_type or tensor must be provided")
        device_type = tensor.device.type
    comms = pg_info_get_data(group, "torchcomms")
    if not comms:
        raise AssertionError(f"No torchcomms instances found for process group {group}")
    if device_type not in comms:
        raise ValueError(
            f"No torchcomms instance for device type '{device_type}'. "
            f"Available: {', '.join(sorted(comms))}"
        )
    return comms[device_type]


def get_group_rank(group: ProcessGroup, global_rank: int) -> int:
    """``global_rank``'s rank in ``group`` (``ValueError`` if it is not a member)."""
    group_rank = pg_info_get_rank_map(group).get(global_rank)
    if group_rank is None:
        raise ValueError(
            f"Global rank {global_rank} is not in process group. "
            f"Group ranks: {pg_info_get_global_ranks(group)}"
        )
    return group_rank


def get_backend_for_device(group: ProcessGroup, device_type: str) -> str:
    """The backend name ``group`` uses for ``device_type`` (``AssertionError`` if none)."""
    device_backends = pg_info_get_data(group, "device_backends")
    assert device_backends is not None, f"No device_backends found for process group {group}"
    assert device_type in device_backends, (
        f"Device type '{device_type}' not found in device_backends. "
        f"Available: {', '.join(sorted(device_backends))}"
    )
    return str(device_backends[device_type])


def _adopt(pg: ProcessGroup) -> None:
    """Register a live ``_BackendWrapper`` group distwrap did not make (torch's new_group)."""
    if pg_info_get(pg) is not None or not isinstance(pg, _BackendWrapper):
        return
    if pg not in c10d_py._world.pg_group_ranks:
        return
    comm = pg.get_comm()
    device_type = comm.get_device().type
    pg_info_create(pg, list(dist.get_process_group_ranks(pg)), pg.group_desc)
    pg_info_set_data(pg, "device_backends", {device_type: comm.get_backend()})
    pg_info_set_data(pg, "torchcomms", {device_type: comm})


def _resolve_group(group: ProcessGroup | None) -> ProcessGroup:
    """``get_group``, with torch's own groups on a torchcomms world adopted."""
    pg = get_group(group)
    _adopt(pg)
    return pg


def _group_name(pg: ProcessGroup) -> str:
    try:
        return str(pg.group_name)
    except RuntimeError:
        return repr(pg)


def _check_routable(pg: ProcessGroup, op: str) -> None:
    if not _has_data(pg, "torchcomms"):
        raise AssertionError(
            f"{op}: No torchcomms instances found for process group {_group_name(pg)!r}: it "
            "was not created by torchcomms.distwrap on a use_torchcomms=True world (create "
            "sub-groups with distwrap.split_group)"
        )


def _comm_for(
    pg: ProcessGroup,
    op: str,
    tensor: torch.Tensor | None = None,
    device_type: str | None = None,
) -> TorchComm:
    """``get_torchcomms_instance``, with ``op`` named in its errors."""
    if device_type is None and tensor is not None and not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: expected a torch.Tensor, got {type(tensor).__name__}")
    _check_routable(pg, op)
    try:
        comm: TorchComm = get_torchcomms_instance(pg, device_type=device_type, tensor=tensor)
    except ValueError as exc:
        raise ValueError(f"{op}: {exc}") from None
    return comm


def _default_comm(pg: ProcessGroup, op: str) -> TorchComm:
    """For calls without a tensor (barrier, objects): the only comm, else CPU's, else the first."""
    _check_routable(pg, op)
    comms: dict[str, TorchComm] = pg_info_get_data(pg, "torchcomms")
    if not comms:
        raise AssertionError(f"{op}: No torchcomms instances found for process group {pg}")
    if len(comms) > 1 and "cpu" in comms:
        return comms["cpu"]
    return next(iter(comms.values()))


def _group_rank(pg: ProcessGroup, global_rank: int, op: str) -> int:
    """``get_group_rank``, with ``op`` named in its errors."""
    if not isinstance(global_rank, int) or isinstance(global_rank, bool):
        raise TypeError(f"{op}: a rank must be an int, got {type(global_rank).__name__}")
    try:
        return get_group_rank(pg, global_rank)
    except ValueError as exc:
        raise ValueError(f"{op}: {exc}") from None


def _resolve_peer(
    pg: ProcessGroup,
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
        return _group_rank(pg, peer, op)
    if peer is not None:
        raise ValueError(f"{op}: Cannot specify both {what} and {group_what}")
    return group_peer


def _backend_for_device(pg: ProcessGroup, device_type: str) -> str:
    """``get_backend_for_device``; for a group distwrap did not make, torch's answer."""
    found = pg_info_get(pg)
    if found is not None and device_type in found.data.get("device_backends", {}):
        return get_backend_for_device(pg, device_type)
    name = str(dist.get_backend(pg))
    if ":" in name:
        return parse_backend_string(name).get(device_type, "")
    return name


# -- splitting communicators -----------------------------------------------------------------


def _split_comms(
    parent_pg: ProcessGroup,
    ranks: list[int],
    name: str,
    hints: dict[str, str] | None,
    timeout: timedelta | None,
    device_backends: dict[str, str],
) -> dict[str, TorchComm]:
    """Split each of the parent's communicators that ``device_backends`` keeps.

    ``ranks`` are parent ranks (``[]`` on a rank in no group: it takes part, gets nothing).
    """
    parent_comms: dict[str, TorchComm] = pg_info_get_data(parent_pg, "torchcomms")
    if not parent_comms:
        raise AssertionError(f"No torchcomms instances found for parent process group {parent_pg}")
    children: dict[str, TorchComm] = {}
    for device_type, parent_comm in parent_comms.items():
        if device_type not in device_backends:
            continue
        child_timeout = timeout or parent_comm.get_options().timeout
        child = parent_comm.split(list(ranks), name, hints=hints, timeout=child_timeout)
        if child is not None:
            children[device_type] = child
    return children


def torchcomms_create_split_group(
    pg: ProcessGroup,
    parent_pg: ProcessGroup,
    split_ranks: list[list[int]],
    group_desc: str,
    pg_options: dict[str, Any] | None,
    device_backends: dict[str, str],
) -> None:
    """Give the registered group ``pg`` communicators split from ``parent_pg``'s.

    Every rank of ``parent_pg`` calls it with the same ``split_ranks`` (lists of parent
    ranks); each parent communicator whose device type ``device_backends`` names is split
    into this rank's list (named ``group_desc``, hints from ``pg_options``), and the results
    are kept as ``pg``'s ``"torchcomms"``.  A rank in no list takes part and keeps nothing.
    """
    if not pg_info_get_data(parent_pg, "torchcomms"):
        raise AssertionError(f"No torchcomms instances found for parent process group {parent_pg}")
    me = dist.get_rank(parent_pg)
    ranks: list[int] = next((list(r) for r in split_ranks if me in r), [])
    name = group_desc
    if not name:  # a communicator needs a name; the same on every member
        to_global = list(dist.get_process_group_ranks(parent_pg))
        digest = hashlib.sha1(",".join(str(to_global[r]) for r in ranks).encode()).hexdigest()
        name = f"{_group_name(parent_pg)}:split:{digest[:12]}"
    children = _split_comms(
        parent_pg, ranks, name, _pg_options_to_hints(pg_options), None, device_backends
    )
    pg_info_set_data(pg, "torchcomms", children)
