"""What the observability tools read off one op: its tensors' shapes and dtypes, root/peer, reduce op.

Shared by the flight recorder, clog, the JSON event log and the collective check
(``torchcomms.hooks``), derived from each op's sides in the op table (``optable``) and its
pre-hook argument class (``hook_args``).  Everything here runs on the issuing thread while the op's pre-hook
args are alive (``OpRecord.args``/``call_args``), and keeps only shapes, dtypes and ints,
never tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from torchcomms import optable
from torchcomms.optable import OpName, hook_args
from torchcomms.types import ReduceOp

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


def _nothing(_: Any) -> tuple[Sizes, Dtypes]:
    return (), ()


_FORMS: dict[str, Callable[[Any], tuple[Sizes, Dtypes]]] = {
    optable.ONE: _one,
    optable.MANY: _many,
    optable.STACKED: _stacked,
}

#: An op side as observers read it: the pre-hook arguments' field and the side's form.
FieldSide = tuple[str, str] | None


def _field_side(entry: optable.Op, side: optable.Side) -> FieldSide:
    """The table's side (an argument of the method) as its pre-hook argument field."""
    if side is None:
        return None
    fields = [f.name for f in dataclasses.fields(hook_args.pre_hook_class(entry))]
    return fields[entry.hook.index(side[0])], side[1]


#: Each op's (input side, output side) as its pre-hook fields, from the op table.
IO: dict[OpName, tuple[FieldSide, FieldSide]] = {
    e.name: (_field_side(e, e.inputs), _field_side(e, e.outputs)) for e in optable.OPS
}
P2P_OPS = frozenset(n for n, e in optable.BY_NAME.items() if e.p2p)


def _recorded(name: OpName) -> tuple[FieldSide, FieldSide]:
    inputs, outputs = IO[name]
    if name in P2P_OPS:  # c10d records a send's or receive's one tensor on both sides
        inputs = outputs = inputs or outputs
    return inputs, outputs


#: Each op's sides as the flight recorder shows them.
SIDES: dict[OpName, tuple[FieldSide, FieldSide]] = {n: _recorded(n) for n in IO}


def _shapes_of(sides: tuple[FieldSide, FieldSide]) -> Callable[[Any], Shapes]:
    (i_field, i_form), (o_field, o_form) = (s or ("", "") for s in sides)
    i_of, o_of = _FORMS.get(i_form, _nothing), _FORMS.get(o_form, _nothing)

    def shapes_of(a: Any) -> Shapes:
        return (
            *i_of(getattr(a, i_field) if i_field else None),
            *o_of(getattr(a, o_field) if o_field else None),
        )

    return shapes_of


SHAPES: dict[OpName, Callable[[Any], Shapes]] = {n: _shapes_of(s) for n, s in SIDES.items()}


def shapes(name: OpName, args: Any) -> Shapes:
    """Input/output shapes and dtypes of one op from its pre-hook args (empty if unknown)."""
    fn = SHAPES.get(name)
    if fn is None or args is None:
        return _EMPTY
    try:
        return fn(args)
    except Exception:
        return _EMPTY


def _tensors(args: Any, side: FieldSide) -> list[torch.Tensor]:
    if side is None:
        return []
    value = getattr(args, side[0])
    return [value] if side[1] == optable.ONE else list(value)


def inputs_outputs(name: OpName, args: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The op's input and output tensors (in-place ops: the same tensor on both sides)."""
    sides = IO.get(name)
    if args is None or sides is None:
        return [], []
    return _tensors(args, sides[0]), _tensors(args, sides[1])


def _key(entry: optable.Op) -> FieldSide:
    """The table's ``key`` as a pre-hook field, else the op's first one-tensor side."""
    if entry.key is not None:
        return _field_side(entry, (entry.key, optable.ONE))
    return next((s for s in IO[entry.name] if s is not None and s[1] == optable.ONE), None)


#: Each collective's key tensor (``key_tensor``), as a pre-hook field.
KEYS: dict[OpName, FieldSide] = {e.name: _key(e) for e in optable.OPS if not e.p2p}


def key_tensor(name: OpName, args: Any) -> tuple[torch.Tensor | None, bool]:
    """The tensor whose shape every rank must agree on (``KEYS``), and whether its shape must
    agree (not where sizes vary by design; then only its dtype counts).  An op whose sides
    are lists offers the first input; point-to-point none."""
    if name not in KEYS:
        return None, False
    key = KEYS[name]
    if key is not None:
        return getattr(args, key[0]), not optable.BY_NAME[name].varying
    inputs = IO[name][0]
    listed = getattr(args, inputs[0]) if inputs is not None else None
    return (listed[0] if listed else None), False


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


#: Collectives that read and write one tensor in place (broadcast, all_reduce, reduce).
IN_PLACE_OPS = frozenset(n for n, (i, o) in IO.items() if i is not None and i == o)
#: Ops whose pre-hook arguments hold their one tensor as ``tensor`` (in place, send, recv).
ONE_TENSOR_OPS = frozenset(n for n, (i, o) in IO.items() if (i or o) == ("tensor", optable.ONE))
