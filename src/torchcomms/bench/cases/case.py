"""What one benchmarked op is: ``OpSpec`` (sizes, formulas, how to build a case), the
``Case`` one rank builds from ``CaseParams``, and the dtypes and reduce ops the bench knows.

Input patterns are small integers (at most 80, or powers of two for ``prod``), exact in
every supported dtype, so checks are bit-exact comparisons.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._C._distributed_c10d as c10d

from torchcomms import ReduceOp, TorchComm

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
}

# name -> (ours, raw c10d, how to combine two Python ints)
REDOPS: dict[str, tuple[ReduceOp, Any, Callable[[int, int], int]]] = {
    "sum": (ReduceOp.SUM, c10d.ReduceOp.SUM, lambda a, b: a + b),
    "prod": (ReduceOp.PRODUCT, c10d.ReduceOp.PRODUCT, lambda a, b: a * b),
    "min": (ReduceOp.MIN, c10d.ReduceOp.MIN, min),
    "max": (ReduceOp.MAX, c10d.ReduceOp.MAX, max),
}

_P2P_TAG = 7


@dataclass(frozen=True)
class CaseParams:
    """What one rank needs to build a case: ``count`` is the row's element count."""

    rank: int
    nranks: int
    count: int
    dtype: torch.dtype
    redop: str
    root: int
    in_place: bool
    #: ``--vs mpi`` asked for: only then are MPI's views built (mpi4py is imported only then).
    vs_mpi: bool = False


def _noop() -> None:
    return None


def _zero() -> int:
    return 0


@dataclass
class Case:
    """One rank's buffers for one (op, size, placement), with the calls that use them."""

    ours: Callable[[TorchComm], None]
    gloo: Callable[[Any], None]
    reset: Callable[[], None] = _noop  # restore inputs/outputs before a checked run
    wrong: Callable[[], int] = _zero  # elements of this rank's output that differ
    corrupt: Callable[[], None] = _noop  # test switch: damage this rank's output
    #: MPI's own operation on the same buffers (``--vs mpi``); None where MPI has none.
    mpi: Callable[[Any], None] | None = None


@dataclass(frozen=True)
class OpSpec:
    """A benchmarked op: sizes, formulas and how to build a case (see the module docstring)."""

    name: str
    factor_text: str  # nccl-tests busbw factor, as printed in the table header
    busbw_factor: Callable[[int], float]
    traffic_text: str  # memory traffic of the copy-in/copy-out model, in units of S
    traffic: Callable[[int], float] | None  # k(N): the model moves k * S bytes
    build: Callable[[CaseParams], Case]
    granularity: Callable[[int], int] = lambda n: 1  # count must be a multiple of this
    reduces: bool = False
    rooted: bool = False
    placements: tuple[bool, ...] = (False, True)  # in_place values it runs
    min_ranks: int = 1
    sized: bool = True  # barrier: one row, no payload
    time_divisor: int = 1  # ping-pong: one-way time = round trip / 2
    checked_rank: Callable[[int, int], int | None] = lambda n, root: n - 1  # corrupt target
    aliases: tuple[str, ...] = field(default_factory=tuple)
    #: In-place APIs only: the traffic of the bench's own copy of the input into the output,
    #: which the out-of-place column times before the op (``2N``: every rank copies S).
    copy_in_text: str = "0"
    #: Every rank sends and receives at once (all_reduce, gathers, all_to_all): the wire
    #: ceiling is the duplex stream's; False (rooted ops, ping-pong, one-sided): simplex.
    exchange: bool = True

    def traffic_text_at(self, in_place: bool) -> str:
        """The model as printed for one placement: the out-of-place column adds the copy."""
        if in_place or self.copy_in_text == "0":
            return self.traffic_text
        return _spelled(_coefficients(self.traffic_text), _coefficients(self.copy_in_text))

    def traffic_at(self, nranks: int, in_place: bool) -> float | None:
        """``k(N)`` for one placement: the bytes the timed call moves, in units of S."""
        if self.traffic is None:
            return None
        a, b = _coefficients(self.copy_in_text)
        extra = 0 if in_place else a * nranks + b
        return self.traffic(nranks) + extra

    def count_for(self, nbytes: int, nranks: int, elem_size: int) -> int:
        """Elements a row of ``nbytes`` moves, rounded down as nccl-tests does."""
        if not self.sized:
            return 0
        g = self.granularity(nranks)
        return nbytes // elem_size // g * g


def _coefficients(text: str) -> tuple[int, int]:
    """``(a, b)`` of the model ``aN+b`` that ``text`` spells (``5N+1``, ``2N``, ``4``)."""
    slope, per_rank, rest = text.partition("N")
    return (int(slope or 1), int(rest or 0)) if per_rank else (0, int(slope))


def _spelled(*terms: tuple[int, int]) -> str:
    """The sum of models ``aN+b``, written as a ``traffic_text``."""
    a = sum(t[0] for t in terms)
    b = sum(t[1] for t in terms)
    slope = "" if a == 0 else ("N" if a == 1 else f"{a}N")
    if not slope:
        return str(b)
    return slope if b == 0 else f"{slope}+{b}"
