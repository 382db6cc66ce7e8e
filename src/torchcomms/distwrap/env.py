"""What ``init_process_group`` reads before it touches anything: backend strings, rank, size.

* ``parse_backend_string``: ``"gloo"`` or ``"cpu:gloo,cuda:nccl"`` into ``{device: backend}``,
  as upstream parses it (a bare name maps to its default device), with a clear error for an
  unknown bare name, a malformed part, or a device key that is not a torch device type;
* ``dist_backend_string``: the string handed to ``torch.distributed`` (``ncclx``/``rcclx``
  renamed to ``nccl``/``rccl``, which is all torch does not understand);
* ``get_rank_and_world_size``: ``-1`` arguments resolved from the environment, in upstream's
  order (Open MPI, torchrun, Slurm, PMI);
* ``pg_options_to_hints``: a ``pg_options`` object as communicator hints (string values).

Pure functions of their arguments and ``os.environ``; no state.
"""

from __future__ import annotations

import os
from typing import Any

import torch

#: Bare backend names and the device type each one serves (upstream's table).
BACKEND_DEFAULT_DEVICES: dict[str, str] = {
    "nccl": "cuda",
    "ncclx": "cuda",
    "rccl": "cuda",
    "rcclx": "cuda",
    "gloo": "cpu",
    "hccl": "mtia",
}

#: Backend names torch.distributed does not know, and the name it knows them by.
RENAME_FOR_DIST: dict[str, str] = {"ncclx": "nccl", "rcclx": "rccl"}

#: (rank variable, size variable) pairs, in the order they are looked up.
RANK_ENV_PAIRS: tuple[tuple[str, str], ...] = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("RANK", "WORLD_SIZE"),
    ("SLURM_PROCID", "SLURM_NTASKS"),
    ("PMI_RANK", "PMI_SIZE"),
)


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


def parse_backend_string(backend: Any) -> dict[str, str]:
    """``{device type: backend name}`` for a bare (``"gloo"``) or merged backend string."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    text = str(backend).strip()
    if ":" not in text:
        name = text.lower()
        if name not in BACKEND_DEFAULT_DEVICES:
            raise ValueError(
                f"Unknown backend: '{text}'. Known backends are: "
                f"{', '.join(sorted(BACKEND_DEFAULT_DEVICES))}"
            )
        return {BACKEND_DEFAULT_DEVICES[name]: name}
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


def dist_backend_string(backend: str, device_backends: dict[str, str]) -> str:
    """What torch.distributed is given: the caller's string, unless a name needs renaming."""
    renamed = {d: RENAME_FOR_DIST.get(b, b) for d, b in device_backends.items()}
    if renamed == device_backends:
        return str(backend)  # torch's own parsing of the caller's string, bit for bit
    return format_backend_string(renamed)


def _env_int(var: str) -> int:
    raw = os.environ[var]
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {var} must be an integer, got {raw!r}") from None


def get_rank_and_world_size(rank: int, world_size: int) -> tuple[int, int]:
    """``rank`` and ``world_size``, each ``-1`` taken from the first variable of its kind set."""
    if rank == -1:
        for rank_var, _ in RANK_ENV_PAIRS:
            if rank_var in os.environ:
                rank = _env_int(rank_var)
                break
    if world_size == -1:
        for _, size_var in RANK_ENV_PAIRS:
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


def pg_options_to_hints(pg_options: Any) -> dict[str, str] | None:
    """A ``pg_options`` object as hints: its public plain attributes (and ``config``'s), as str.

    An options object that carries ``hints`` (torchcomms' own) contributes them as they are.
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
