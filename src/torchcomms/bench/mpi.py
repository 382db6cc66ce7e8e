"""MPI as a baseline (``--vs mpi``): MPI's own operations, through mpi4py, on the buffers ours
uses, in the same processes.

The job runs under ``mpirun`` (Open MPI or MPICH: ``pip install 'torchcomms-py[mpi]'`` installs
both mpi4py and Open MPI from PyPI); our communicator takes its ranks from the launcher's
environment and rank 0's store port travels by ``MPI_Bcast``.  mpi4py is imported only here, and
only when asked for: the rest of the benchmark never needs it.

A buffer is handed to MPI as a NumPy view of the tensor (no copy).  Reductions need a type MPI
knows; ``float16`` and ``bfloat16`` have none, so MPI sits those reductions out (``-`` in the
table), while data movement (broadcast, gathers, all-to-all, send/recv) goes as bytes.
"""

from __future__ import annotations

import os
from typing import Any

import torch

#: The launcher variables that say this process is a rank of an MPI job.
_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
_REDUCIBLE = {
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
}


def missing() -> str | None:
    """Why mpi4py cannot be used here (not installed), or None."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return (
            "mpi4py is not installed (pip install 'torchcomms-py[mpi]' installs mpi4py and "
            "Open MPI from PyPI)"
        )
    return None


def launched() -> bool:
    """Whether an MPI launcher (mpirun, mpiexec, srun with PMIx) started this process."""
    return any(os.environ.get(v) for v in _MPI_RANK_VARS)


LAUNCH_HINT = "run it under an MPI launcher: mpirun -n 2 python -m torchcomms.bench --vs mpi ..."


def world() -> Any:
    """``MPI.COMM_WORLD`` (initialises MPI on first use)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD


def share_port(port: int | None) -> int:
    """Rank 0's ``port`` on every rank (MPI_Bcast)."""
    return int(world().bcast(port, root=0))


def library() -> str:
    from mpi4py import MPI

    return MPI.Get_library_version().splitlines()[0].strip()


def buffer(t: torch.Tensor, reduce: bool) -> Any | None:
    """``t`` as an MPI buffer (a NumPy view), or None where MPI has no type for a reduction."""
    if reduce:
        return t.detach().numpy() if t.dtype in _REDUCIBLE else None
    from mpi4py import MPI

    return [t.detach().reshape(-1).view(torch.uint8).numpy(), MPI.BYTE]


def op(redop: str) -> Any:
    from mpi4py import MPI

    return {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}[redop]


def in_place() -> Any:
    from mpi4py import MPI

    return MPI.IN_PLACE
