"""What the observability tools read off one op: its tensors' shapes and dtypes, root/peer, reduce op.

Shared by the flight recorder, clog, the JSON event log and the collective check
(``torchcomms.hooks``).  A vocabulary module about ops: it imports only ``torch`` and
``torchcomms.types``.  Everything here runs on the issuing thread while the op's pre-hook
args are alive (``OpRecord.args``/``call_args``), and keeps only shapes, dtypes and ints,
never tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchcomms.types import OpName, ReduceOp

Sizes = tuple[torch.Size, ...]
Dtypes = tuple[torch.dtype, ...]
# (input shapes, input dtypes, output shapes, output dtypes)
Shapes = tuple[Sizes, Dtypes, Sizes, Dtypes]

_EMPTY: Shapes = ((), (), (), ())

# PyTorch's flight recorder writes c10 scalar-type names.
C10_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "Float",
    torch.float64: "Double",
    torch.float16: "Half",
    torch.bfloat16: "BFloat16",
    torch.int8: "Char",
    torch.uint8: "Byte",
    torch.int16: "Short",
    torch.int32: "Int",
    torch.int64: "Long",
    torch.bool: "Bool",
    torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble",
}

# clog's short dtype names.
SHORT_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "bool",
}


def c10_dtype_name(dtype: torch.dtype) -> str:
    return C10_DTYPE_NAMES.get(dtype) or str(dtype).removeprefix("torch.")


def _one(t: torch.Tensor) -> tuple[Sizes, Dtypes]:
    return (t.shape,), (t.dtype,)


def _many(ts: list[torch.Tensor]) -> tuple[Sizes, Dtypes]:
    return tuple(t.shape for t in ts), tuple(t.dtype for t in ts)


def _stacked(ts: list[torch.Tensor]) -> tuple[Sizes, Dtypes]:
    # PyTorch flattens a list of equal chunks into one [n, *chunk] buffer and records that.
    if not ts:
        return (), ()
    return (torch.Size((len(ts), *ts[0].shape)),), (ts[0].dtype,)


def _inplace(a: Any) -> Shapes:
    s, d = _one(a.tensor)
    return s, d, s, d


def _single(a: Any) -> Shapes:
    return (*_one(a.input), *_one(a.output))


def _all_gather(a: Any) -> Shapes:
    return (*_one(a.input), *_stacked(a.output))


def _list_out(a: Any) -> Shapes:
    return (*_one(a.input), *_many(a.output))


def _reduce_scatter(a: Any) -> Shapes:
    return (*_stacked(a.input), *_one(a.output))


def _list_in(a: Any) -> Shapes:
    return (*_many(a.input), *_one(a.output))


def _all_to_all(a: Any) -> Shapes:
    return (*_many(a.input), *_many(a.output))


def _scatter(a: Any) -> Shapes:
    return (*_many(a.input), *_one(a.output))


def _gather(a: Any) -> Shapes:
    return (*_one(a.input), *_many(a.output))


def _gather_single(a: Any) -> Shapes:
    # Non-root ranks may pass any placeholder output; only the root's is real.
    return (*_one(a.input), *_one(a.output))


def _none(a: Any) -> Shapes:
    return _EMPTY


SHAPES: dict[OpName, Callable[[Any], Shapes]] = {
    OpName.send: _inplace,
    OpName.recv: _inplace,
    OpName.broadcast: _inplace,
    OpName.all_reduce: _inplace,
    OpName.reduce: _inplace,
    OpName.all_gather: _all_gather,
    OpName.all_gather_v: _list_out,
    OpName.all_gather_single: _single,
    OpName.reduce_scatter: _reduce_scatter,
    OpName.reduce_scatter_v: _list_in,
    OpName.reduce_scatter_single: _single,
    OpName.all_to_all_single: _single,
    OpName.all_to_all_v_single: _single,
    OpName.all_to_all: _all_to_all,
    OpName.barrier: _none,
    OpName.scatter: _scatter,
    OpName.gather: _gather,
    OpName.gather_single: _gather_single,
}


def shapes(name: OpName, args: Any) -> Shapes:
    """Input/output shapes and dtypes of one op from its pre-hook args (empty if unknown)."""
    fn = SHAPES.get(name)
    if fn is None or args is None:
        return _EMPTY
    try:
        return fn(args)
    except Exception:
        return _EMPTY


def inputs_outputs(name: OpName, args: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The op's input and output tensors (in-place ops: the same tensor on both sides)."""
    if args is None:
        return [], []
    if name in (OpName.broadcast, OpName.all_reduce, OpName.reduce):
        return [args.tensor], [args.tensor]
    if name is OpName.send:
        return [args.tensor], []
    if name is OpName.recv:
        return [], [args.tensor]
    inp = getattr(args, "input", None)
    out = getattr(args, "output", None)
    ins = list(inp) if isinstance(inp, (list, tuple)) else ([inp] if inp is not None else [])
    outs = list(out) if isinstance(out, (list, tuple)) else ([out] if out is not None else [])
    return ins, outs


def reduce_op(record_call_args: tuple[Any, ...]) -> ReduceOp | None:
    """The ``ReduceOp`` among the backend call's arguments, if the op reduces."""
    for a in record_call_args:
        if isinstance(a, ReduceOp):
            return a
    return None


def root_or_peer(args: Any) -> int | None:
    root = getattr(args, "root", None)
    if root is not None:
        return int(root)
    peer = getattr(args, "peer", None)
    return None if peer is None else int(peer)


P2P_OPS = frozenset({OpName.send, OpName.recv, OpName.batch_op_issue})
