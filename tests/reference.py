"""The reduction model shared by the collective tests: dtypes, reduce ops, inputs, results.

Inputs are integer-valued and small, so every reduction over up to 4 ranks is exact in every
dtype; ``reduce_ref`` computes the expected result independently of the library (int64 /
float64, then cast), so a transport is checked against arithmetic, not against another path.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from torchcomms import ReduceOp

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INT_DTYPES = (torch.int8, torch.uint8, torch.int32, torch.int64)
ALL_DTYPES = (*FLOAT_DTYPES, *INT_DTYPES, torch.bool)

#: Reduce ops by name; the two PREMUL_SUM variants differ in how the factor is given.
PREMUL_FLOAT = "PREMUL_SUM(2.0)"
PREMUL_TENSOR = "PREMUL_SUM(tensor[0.5])"
PREMUL_FACTORS = {PREMUL_FLOAT: 2.0, PREMUL_TENSOR: 0.5}
BITWISE = ("BAND", "BOR", "BXOR")
ALL_REDS = ("SUM", "PRODUCT", "MIN", "MAX", *BITWISE, "AVG", PREMUL_FLOAT, PREMUL_TENSOR)

#: Float comparison tolerances (rtol, atol): only AVG is inexact (a division by world size).
FLOAT_TOL = {
    torch.float32: (1e-6, 1e-6),
    torch.float64: (1e-12, 1e-12),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1e-2, 1e-2),
}


def reds_for(dtype: torch.dtype) -> tuple[str, ...]:
    """Every reduce op the API accepts on ``dtype`` (the others are validation errors)."""
    if dtype.is_floating_point:
        return tuple(red for red in ALL_REDS if red not in BITWISE)
    if dtype is torch.bool:
        return tuple(red for red in ALL_REDS if red not in (PREMUL_FLOAT, PREMUL_TENSOR, "AVG"))
    return tuple(red for red in ALL_REDS if red not in (PREMUL_FLOAT, PREMUL_TENSOR))


def make_reduce_op(name: str) -> ReduceOp:
    if name == PREMUL_FLOAT:
        return ReduceOp.PREMUL_SUM(PREMUL_FACTORS[name])
    if name == PREMUL_TENSOR:
        # A 1-element bf16 tensor on the comm device, as upstream's tests pass it.
        return ReduceOp.PREMUL_SUM(torch.tensor([PREMUL_FACTORS[name]], dtype=torch.bfloat16))
    op = getattr(ReduceOp, name)
    assert isinstance(op, ReduceOp)
    return op


def rank_data(
    rank: int, n: int, dtype: torch.dtype, red: str | None = None, offset: int = 0
) -> torch.Tensor:
    """Elements ``offset .. offset+n-1`` of rank ``rank``'s input.

    Arithmetic data is in [-2, 2] ([0, 3] for uint8) so a sum or product over 4 ranks stays
    exact in int8/uint8/float16/bfloat16; bitwise data spans 4 bits (signed: [-8, 7]).
    For a fixed element, ranks 0..3 get distinct values (except bool), so a value identifies
    its source rank.
    """
    idx = torch.arange(offset, offset + n, dtype=torch.int64)
    if dtype is torch.bool:
        return (rank + idx) % 3 != 0
    signed = dtype is not torch.uint8
    if red in BITWISE:
        v = (5 * rank + 3 * idx + 1) % 16 - (8 if signed else 0)
    else:
        v = (3 * rank + 2 * idx + 1) % (5 if signed else 4) - (2 if signed else 0)
    return v.to(dtype)


def reduce_ref(inputs: Sequence[torch.Tensor], red: str, dtype: torch.dtype) -> torch.Tensor:
    """The reduction of ``inputs`` (one per rank) computed in int64/float64, cast to ``dtype``."""
    size = len(inputs)
    if dtype is torch.bool:
        stacked = torch.stack(list(inputs))
        if red in ("SUM", "MAX", "BOR"):
            return stacked.any(0)
        if red in ("PRODUCT", "MIN", "BAND"):
            return stacked.all(0)
        assert red == "BXOR", red
        return stacked.to(torch.int64).sum(0) % 2 == 1
    wide_dtype = torch.float64 if dtype.is_floating_point else torch.int64
    wide = torch.stack([t.to(wide_dtype) for t in inputs])
    if red == "SUM":
        out = wide.sum(0)
    elif red == "PRODUCT":
        out = wide.prod(0)
    elif red == "MIN":
        out = wide.amin(0)
    elif red == "MAX":
        out = wide.amax(0)
    elif red in BITWISE:
        fn = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[red]
        out = functools.reduce(fn, list(wide))
    elif red == "AVG":
        # Integer AVG truncates toward zero (upstream: SUM, then truncating division).
        total = wide.sum(0)
        out = (
            total / size
            if dtype.is_floating_point
            else torch.div(total, size, rounding_mode="trunc")
        )
    else:
        out = (wide * PREMUL_FACTORS[red]).sum(0)
    return out.to(dtype)
