"""Reductions of rows of contributions, with torch kernels, as every CPU transport does them.

``reduce_rows`` reduces ``[ranks, n]`` rows (rank order) into one ``[n]`` result: the shm
transport reduces the peers' slots with it, the tcp path the payloads of its header call.
bool follows logical semantics (SUM/MAX/BOR: any; PRODUCT/MIN/BAND: all; BXOR: parity).
``BINARY`` / ``BINARY_BOOL`` are the two-operand forms (the two-rank large all_reduce).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from torchcomms.types import RedOpType, ReduceOp

_ANY = (RedOpType.SUM, RedOpType.MAX, RedOpType.BOR, RedOpType.AVG, RedOpType.PREMUL_SUM)
_ALL = (RedOpType.PRODUCT, RedOpType.MIN, RedOpType.BAND)


# Two-operand forms of the reductions (the two-rank large all_reduce); PREMUL_SUM is absent.
BINARY: dict[RedOpType, Callable[..., torch.Tensor]] = {
    RedOpType.SUM: torch.add,
    RedOpType.AVG: torch.add,
    RedOpType.PRODUCT: torch.mul,
    RedOpType.MIN: torch.minimum,
    RedOpType.MAX: torch.maximum,
    RedOpType.BAND: torch.bitwise_and,
    RedOpType.BOR: torch.bitwise_or,
    RedOpType.BXOR: torch.bitwise_xor,
}
BINARY_BOOL: dict[RedOpType, Callable[..., torch.Tensor]] = {
    RedOpType.SUM: torch.logical_or,
    RedOpType.AVG: torch.logical_or,
    RedOpType.MAX: torch.logical_or,
    RedOpType.BOR: torch.logical_or,
    RedOpType.PRODUCT: torch.logical_and,
    RedOpType.MIN: torch.logical_and,
    RedOpType.BAND: torch.logical_and,
    RedOpType.BXOR: torch.logical_xor,
}


def reduce_rows(rows: torch.Tensor, out: torch.Tensor, op: ReduceOp) -> None:
    """Reduce ``rows`` ([ranks, n], rank order) into ``out`` ([n]) with ``op``."""
    t = op.type
    if out.dtype is torch.bool:
        if t in _ANY:
            torch.any(rows, 0, out=out)
        elif t in _ALL:
            torch.all(rows, 0, out=out)
        else:
            _fold(rows, out, torch.bitwise_xor)
        return
    if t in (RedOpType.SUM, RedOpType.AVG, RedOpType.PREMUL_SUM):
        torch.sum(rows, 0, dtype=out.dtype, out=out)
    elif t is RedOpType.MAX:
        torch.amax(rows, 0, out=out)
    elif t is RedOpType.MIN:
        torch.amin(rows, 0, out=out)
    elif t is RedOpType.PRODUCT:
        torch.prod(rows, 0, dtype=out.dtype, out=out)
    elif t is RedOpType.BAND:
        _fold(rows, out, torch.bitwise_and)
    elif t is RedOpType.BOR:
        _fold(rows, out, torch.bitwise_or)
    elif t is RedOpType.BXOR:
        _fold(rows, out, torch.bitwise_xor)
    else:  # pragma: no cover - every RedOpType is handled above
        raise RuntimeError(f"reduce op {t.name} is not implemented by the shm transport")


def _fold(rows: torch.Tensor, out: torch.Tensor, fn: object) -> None:
    out.copy_(rows[0])
    for i in range(1, rows.shape[0]):
        fn(out, rows[i], out=out)  # type: ignore[operator]
