"""What upstream's distwrap integration tests read from their environment.

``TEST_BACKEND`` (required) names the backend, ``USE_TORCHCOMMS`` (required, ``1`` = on)
the routing mode, ``TEST_DEVICE`` (optional) the device; rank and size come from the
launcher's variables in distwrap's own order (Open MPI, torchrun, Slurm, PMI).  Run, e.g.::

    TEST_BACKEND=gloo TEST_DEVICE=cpu USE_TORCHCOMMS=1 torchrun --nproc-per-node 4 test.py
"""

from __future__ import annotations

import os

import torch

from torchcomms import distwrap as dist
from torchcomms.distwrap.utils import _RANK_ENV_PAIRS

_DTYPE_NAMES = {
    torch.half: "Half",
    torch.float: "Float",
    torch.bfloat16: "BFloat16",
    torch.double: "Double",
    torch.int: "Int",
    torch.int8: "SignedChar",
}


def get_dtype_name(dtype: torch.dtype) -> str:
    """A short name for ``dtype`` (for test case names)."""
    return _DTYPE_NAMES.get(dtype, "Unknown")


def get_op_name(op: object) -> str:
    """A short name for a torch.distributed reduce op (for test case names)."""
    names = {
        dist.ReduceOp.SUM: "Sum",
        dist.ReduceOp.PRODUCT: "Product",
        dist.ReduceOp.MIN: "Min",
        dist.ReduceOp.MAX: "Max",
        dist.ReduceOp.BAND: "BAnd",
        dist.ReduceOp.BOR: "BOr",
        dist.ReduceOp.BXOR: "BXor",
        dist.ReduceOp.AVG: "Avg",
    }
    return names.get(op, f"Unknown: {op}")  # type: ignore[call-overload]


def get_rank_and_size() -> tuple[int, int]:
    """(rank, size) from the first launcher that set both of its variables."""
    for rank_var, size_var in _RANK_ENV_PAIRS:
        rank, size = os.environ.get(rank_var), os.environ.get(size_var)
        if rank is not None and size is not None:
            return int(rank), int(size)
    raise RuntimeError("Could not determine rank or world size from environment variables.")


def get_device(rank: int) -> torch.device:
    """``TEST_DEVICE``, else this rank's CUDA device if there is one, else CPU."""
    named = os.environ.get("TEST_DEVICE")
    if named:
        return torch.device(named)
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.device(f"cuda:{rank % torch.cuda.device_count()}")
    return torch.device("cpu")


def get_backend() -> str:
    backend = os.environ.get("TEST_BACKEND")
    if backend is None:
        raise RuntimeError("TEST_BACKEND environment variable is not set")
    return backend


def use_torchcomms() -> bool:
    value = os.environ.get("USE_TORCHCOMMS")
    if value is None:
        raise RuntimeError("USE_TORCHCOMMS environment variable is not set")
    return value == "1"


def get_pg_options(backend: str) -> object | None:
    """Backend-specific process group options, or None where the backend has none."""
    if backend in ("nccl", "ncclx") and hasattr(dist, "ProcessGroupNCCL"):
        return dist.ProcessGroupNCCL.Options()
    if backend == "gloo":
        return dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    return None
