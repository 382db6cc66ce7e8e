"""The compile layer's view of the op table (``torchcomms.optable``): names and schemas.

Everything per-op in the compile layer is derived from ``OPS``, one ``OpSpec`` per op of
the table: the custom ops' names (upstream's, ``torchcomm_<method>_`` in place and
``torchcomm_<method>`` functional), schemas and eager kernels (``ops``), what a traced call
emits (``traced``) and the methods of the opaque communicator that Dynamo inlines
(``opaque``).  An op is differentiable when ``autograd`` has a formula for it.  The argument
names and kinds are the table's, so a traced call binds positional and keyword arguments
exactly as the eager method does.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchcomms import optable
from torchcomms.optable import BOOLS, INT, INTS, OUT, OUTS, RED, TENSOR, TENSORS

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

OPS: tuple[OpSpec, ...] = tuple(OpSpec(e.method, e.names, e.kinds) for e in optable.OPS)
#: A batch of sends and receives (``batch_op_create().issue()``), in the order they were queued.
BATCH = OpSpec(optable.BATCH.method, optable.BATCH.names, optable.BATCH.kinds)
