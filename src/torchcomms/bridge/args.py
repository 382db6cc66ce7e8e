"""How c10d's calling conventions map onto ``TorchComm``'s: the ``_BackendWrapper``'s helpers.

Reduce ops (c10d's ``ReduceOp``, ``RedOpType`` and PREMUL_SUM, to ours and back), the
c10d options objects built from the bindings' loose positional arguments, the one-tensor
and one-list shapes of c10d's tensor arguments, even ``alltoall`` split sizes, the
hints carrying a point-to-point tag, and ``ReconfigureOptions`` as reconfigure's arguments.  Pure functions, run on the thread issuing the call.

Import rule (as ``_backend_wrapper``): PyTorch imports this while ``torch.distributed`` is
half-initialised, so at module level only ``torch``, ``torch._C._distributed_c10d``, the
standard library and ``torchcomms.types``.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
from torch._C import _distributed_c10d as c10d

from torchcomms.types import RedOpType, ReduceOp


def _reduce_op(op: Any) -> ReduceOp:
    """The TorchComm ``ReduceOp`` for a c10d ``ReduceOp`` / ``RedOpType`` (incl. PREMUL_SUM)."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, RedOpType):
        return ReduceOp(op) if op is not RedOpType.PREMUL_SUM else ReduceOp.PREMUL_SUM(1.0)
    # A c10d ReduceOp carries its kind in ``.op``; a bare ``dist.ReduceOp.SUM`` is the kind.
    kind = op.op if isinstance(op, c10d.ReduceOp) and hasattr(op, "op") else op
    name = getattr(kind, "name", None)
    if name is None:
        raise TypeError(f"unsupported reduce op {op!r}")
    if name == "PREMUL_SUM":
        factor = getattr(op, "factor", None)
        if factor is None:
            raise RuntimeError("PREMUL_SUM reduce op has no factor")
        return ReduceOp.PREMUL_SUM(factor)
    return ReduceOp(RedOpType[name])


def _single(tensors: Any, what: str) -> torch.Tensor:
    if isinstance(tensors, torch.Tensor):
        return tensors
    if len(tensors) != 1:
        raise RuntimeError(f"Only single tensor supported, but got {len(tensors)} tensors")
    t = tensors[0]
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a tensor, got {type(t).__name__}")
    return t


def _aliased(outputs: Sequence[torch.Tensor]) -> bool:
    return (
        len(outputs) > 1
        and outputs[0].numel() > 0
        and outputs[0].data_ptr() == outputs[1].data_ptr()
    )


def _is_reduce_op(value: Any) -> bool:
    return isinstance(value, (c10d.ReduceOp, ReduceOp)) or type(value).__name__ == "RedOpType"


def _c10d_op(op: Any) -> Any:
    """``op`` (c10d's or ours) as a c10d ``ReduceOp``; None stays None (the default, SUM)."""
    if op is None or isinstance(op, c10d.ReduceOp):
        return op
    ours = _reduce_op(op)
    if ours.type is RedOpType.PREMUL_SUM:
        return c10d._make_nccl_premul_sum(ours.factor_value())
    return c10d.ReduceOp(getattr(c10d.ReduceOp.RedOpType, ours.type.name))


def _options(cls: Any, opts: Any, timeout: Any, **fields: Any) -> Any:
    """c10d options from either an options object or the binding's loose arguments.

    A ``timedelta`` in the ``opts`` position is the positional ``timeout`` of the
    convenience overloads; ``fields`` set to ``None`` keep the options' defaults.
    """
    if isinstance(opts, timedelta):
        opts, timeout = None, opts
    if opts is None:
        opts = cls()
    elif not isinstance(opts, cls):
        raise TypeError(f"expected {cls.__name__}, got {type(opts).__name__}")
    if isinstance(timeout, timedelta):
        opts.timeout = timeout
    for name, value in fields.items():
        if value is not None:
            setattr(opts, name, value)
    return opts


def _tag(tag: int) -> dict[str, str]:
    return {"tag": str(int(tag))}


def _single_list(lists: Any) -> list[torch.Tensor]:
    if len(lists) != 1:
        raise RuntimeError(f"Only single tensor supported, but got {len(lists)} tensors")
    return list(lists[0])


def _even_splits(t: torch.Tensor, n: int) -> list[int]:
    rows = t.shape[0] if t.dim() > 0 else 0
    if rows % n:
        raise RuntimeError(f"alltoall_base: {rows} rows cannot be split evenly across {n} ranks")
    return [rows // n] * n


def _reconfigure_args(
    opts: Any,
) -> tuple[int, list[str] | set[str], timedelta | None, dict[str, str] | None]:
    """c10d's ``ReconfigureOptions`` as ``TorchComm.reconfigure``'s arguments: a list of
    handles stays a list (rank = position), a set a set; no timeout or hints: None."""
    handles = opts.handles
    members: list[str] | set[str] = set(handles) if isinstance(handles, set) else list(handles)
    timeout = getattr(opts, "timeout", None) or None
    hints = {str(k): str(v) for k, v in dict(getattr(opts, "hints", None) or {}).items()}
    return int(opts.uuid), members, timeout, hints or None
