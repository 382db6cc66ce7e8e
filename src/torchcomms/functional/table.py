"""The one table of communicator ops the compile layer knows: each op's arguments, by kind.

Everything per-op in the compile layer is derived from ``OPS``: the custom ops' names
(upstream's, ``torchcomm_<method>_`` in place and ``torchcomm_<method>`` functional), schemas
and eager kernels (``ops``), what a traced call emits (``traced``), which ops have autograd
formulas (``DIFFERENTIABLE``; the formulas are in ``autograd``) and the methods of the opaque
communicator that Dynamo inlines (``opaque``).  Adding an op is one row here.

A row is the ``TorchComm`` method's name and the kinds of its arguments before
``async_op``; the argument names are read from the method's signature, so a traced call
binds positional and keyword arguments exactly as the eager method does.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torchcomms.comm import TorchComm

#: Argument kinds: how each becomes schema types (``RED`` is a reduce op, flattened to three).
TENSOR, OUT, TENSORS, OUTS, INT, INTS, BOOLS, RED = (
    "tensor",
    "out",
    "tensors",
    "outs",
    "int",
    "ints",
    "bools",
    "red",
)
_SCHEMA = {
    TENSOR: "Tensor {}",
    OUT: "Tensor(a!) {}",
    TENSORS: "Tensor[] {}",
    OUTS: "Tensor(a!)[] {}",
    INT: "int {}",
    INTS: "int[] {}",
    BOOLS: "bool[] {}",
    RED: "int red, float? factor, Tensor? factor_tensor",
}
#: How many schema arguments one argument of a kind becomes.
WIDTH = {kind: 3 if kind == RED else 1 for kind in _SCHEMA}


@dataclass(frozen=True)
class OpSpec:
    """One communicator op: its method, its custom op's name, its arguments' names and kinds."""

    method: str
    names: tuple[str, ...]
    kinds: tuple[str, ...]

    @property
    def functional(self) -> str:
        """The functional op's name, upstream's: ``torchcomm_all_reduce`` (returns new tensors)."""
        return PREFIX + self.method

    @property
    def op(self) -> str:
        """The in-place op's name, upstream's: ``torchcomm_all_reduce_``; ``ops.async_name``
        gives the form an ``async_op=True`` call emits (``torchcomm_all_reduce_async``)."""
        return self.functional + "_"

    @property
    def differentiable(self) -> bool:
        """Whether the op has an autograd formula (``torchcomms.functional.autograd``)."""
        return self.method in DIFFERENTIABLE

    def functional_returns(self) -> str:
        """The functional op's return types: a new order token, then each written argument."""
        outs = ["Tensor" if k == OUT else "Tensor[]" for k in self.kinds if k in (OUT, OUTS)]
        return "(" + ", ".join(["Tensor", *outs]) + ")"

    def schema(self) -> str:
        """The op's own arguments as schema text (the common head and tail are added by ``ops``)."""
        return ", ".join(_SCHEMA[k].format(n) for n, k in zip(self.names, self.kinds, strict=True))

    def mutated(self) -> tuple[int, ...]:
        """Positions, among the flattened arguments, of the tensors the op writes."""
        out, at = [], 0
        for kind in self.kinds:
            if kind in (OUT, OUTS):
                out.append(at)
            at += WIDTH[kind]
        return tuple(out)


#: The prefix of every op's name (upstream's: the class name, lower case).
PREFIX = "torchcomm_"
#: The ops with autograd formulas, as upstream defines them (the rest write outside autograd).
DIFFERENTIABLE = frozenset(
    {
        "all_reduce",
        "all_gather",
        "all_gather_single",
        "reduce_scatter",
        "reduce_scatter_single",
        "all_to_all_single",
        "all_to_all_v_single",
    }
)

#: method -> the kinds of its arguments before ``async_op``.
_ROWS: dict[str, tuple[str, ...]] = {
    "all_reduce": (OUT, RED),
    "reduce": (OUT, INT, RED),
    "broadcast": (OUT, INT),
    "all_gather": (OUTS, TENSOR),
    "all_gather_v": (OUTS, TENSOR),
    "all_gather_single": (OUT, TENSOR),
    "reduce_scatter": (OUT, TENSORS, RED),
    "reduce_scatter_v": (OUT, TENSORS, RED),
    "reduce_scatter_single": (OUT, TENSOR, RED),
    "all_to_all": (OUTS, TENSORS),
    "all_to_all_single": (OUT, TENSOR),
    "all_to_all_v_single": (OUT, TENSOR, INTS, INTS),
    "scatter": (OUT, TENSORS, INT),
    "gather": (OUTS, TENSOR, INT),
    "gather_single": (OUT, TENSOR, INT),
    "send": (TENSOR, INT),
    "recv": (OUT, INT),
    "barrier": (),
}


def _spec(method: str, kinds: tuple[str, ...]) -> OpSpec:
    params = list(inspect.signature(getattr(TorchComm, method)).parameters)[1:]
    if params[len(kinds)] != "async_op":
        raise RuntimeError(f"torchcomms.functional.table: {method}'s arguments are not {kinds}")
    return OpSpec(method, tuple(params[: len(kinds)]), kinds)


OPS: tuple[OpSpec, ...] = tuple(_spec(m, k) for m, k in _ROWS.items())
#: A batch of sends and receives (``batch_op_create().issue()``), in the order they were queued.
BATCH = OpSpec(
    "batch_op_issue", ("sends", "recvs", "is_recv", "peers"), (TENSORS, OUTS, BOOLS, INTS)
)
