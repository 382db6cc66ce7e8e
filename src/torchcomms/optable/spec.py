"""The op table's vocabulary: op names, argument kinds, sides, the ``Op`` entry and ``@op``.

``@op`` reads a declaration (``optable.methods``), pairs it with its check
(``optable.checks``) and adds the entry to ``OPS`` and ``BY_NAME``.  ``BATCH`` is the entry
of a batch of sends and receives, which has no method of its own.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

from torchcomms.optable import checks

__all__ = [
    "BATCH",
    "BOOLS",
    "BY_NAME",
    "INT",
    "INTS",
    "MANY",
    "ONE",
    "OPS",
    "OUT",
    "OUTS",
    "RED",
    "STACKED",
    "TENSOR",
    "TENSORS",
    "Op",
    "OpName",
    "Side",
    "op",
]


class OpName(enum.Enum):
    """Names of hookable operations, as upstream's Python ``OpName`` (plus ``batch_op_issue``)."""

    send = enum.auto()
    recv = enum.auto()
    broadcast = enum.auto()
    all_reduce = enum.auto()
    reduce = enum.auto()
    all_gather = enum.auto()
    all_gather_v = enum.auto()
    all_gather_single = enum.auto()
    reduce_scatter = enum.auto()
    reduce_scatter_v = enum.auto()
    reduce_scatter_single = enum.auto()
    all_to_all_single = enum.auto()
    all_to_all_v_single = enum.auto()
    all_to_all = enum.auto()
    barrier = enum.auto()
    scatter = enum.auto()
    gather = enum.auto()
    gather_single = enum.auto()
    split = enum.auto()
    new_window = enum.auto()
    finalize = enum.auto()
    batch_op_issue = enum.auto()


#: Argument kinds (before ``async_op``): a tensor read, a tensor written (in place or an
#: output), lists of either, an int (root or peer), a list of ints (split sizes), a list of
#: bools, a reduce op.  The compile layer turns each into schema types.
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

#: How an op's input or output side is recorded: one tensor, a list of tensors, or a list of
#: equal chunks that PyTorch's flight recorder shows as one ``[n, *chunk]`` buffer.
ONE, MANY, STACKED = "one", "many", "stacked"

#: ``(argument name, form)`` of an input or output side; ``None`` where the op has none.
Side = tuple[str, str] | None


@dataclass(frozen=True)
class Op:
    """One op of the table (see the module docstring)."""

    name: OpName
    names: tuple[str, ...]
    kinds: tuple[str, ...]
    inputs: Side
    outputs: Side
    #: The arguments in the order of the op's pre-hook argument class (``hook_args``).
    hook: tuple[str, ...]
    #: ``check(c, *args)`` raises upstream's error for invalid arguments; an op whose check
    #: normalises arguments (``normalizes``) returns them all, as the backend gets them.
    check: Callable[..., Any]
    normalizes: bool = False
    #: Sizes differ between ranks by design (the ``_v`` ops, ``all_to_all``).
    varying: bool = False
    #: Has a sync fast path (``CommCore._sync``): the small, latency-bound ops.
    hot: bool = False
    #: The argument whose shape every rank must agree on (the collective check compares
    #: it): one rank's part of the data.  ``None``: the first side that is one tensor.
    key: str | None = None

    @property
    def method(self) -> str:
        return self.name.name

    @property
    def rooted(self) -> bool:
        return "root" in self.names

    @property
    def reducing(self) -> bool:
        return RED in self.kinds

    @property
    def p2p(self) -> bool:
        return self.name in (OpName.send, OpName.recv, OpName.batch_op_issue)

    @property
    def peer(self) -> str | None:
        """The argument naming the other rank of a send or receive."""
        return self.names[1] if self.name in (OpName.send, OpName.recv) else None

    @property
    def rank_dependent_sizes(self) -> bool:
        """Whether ranks may pass differently sized buffers (varying, or root-only lists)."""
        return self.varying or (self.rooted and (TENSORS in self.kinds or OUTS in self.kinds))

    @property
    def hook_class_name(self) -> str:
        """Upstream's pre-hook argument class: ``AllReducePreHookArgs`` for ``all_reduce``."""
        return self.camel + "PreHookArgs"

    @property
    def camel(self) -> str:
        """The name as upstream's class names spell it: ``AllReduce`` for ``all_reduce``."""
        return "".join(w.capitalize() for w in self.method.split("_"))


OPS: list[Op] = []
BY_NAME: dict[OpName, Op] = {}

P = ParamSpec("P")
R = TypeVar("R")


def op(
    *kinds: str,
    inputs: str | Side,
    outputs: str | Side,
    hook: tuple[str, ...] | None = None,
    normalizes: bool = False,
    varying: bool = False,
    hot: bool = False,
    key: str | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Declare the decorated method an op (see the module docstring).

    The argument names come from its signature, the check is ``check_<name>`` of
    ``optable.checks``, a side given as a name is one tensor (``ONE``), and the pre-hook
    arguments are by default the input, the output, then the root or peer.  ``normalizes``:
    the check returns the arguments as the backend gets them (it copies split sizes)."""

    def declare(fn: Callable[P, R]) -> Callable[P, R]:
        params = list(inspect.signature(fn).parameters)[1:]
        if params[len(kinds) :] != ["async_op", "hints", "timeout"]:
            raise RuntimeError(f"optable: {fn.__name__} must end with async_op, hints, timeout")
        names = tuple(params[: len(kinds)])
        ins, outs = _side(inputs), _side(outputs)
        check = getattr(checks, f"check_{fn.__name__}", None)
        if check is None:
            raise RuntimeError(f"optable: {fn.__name__} has no checks.check_{fn.__name__}")
        if hook is None:
            sides = [s[0] for s in (ins, outs) if s is not None]
            ranks = [n for n, k in zip(names, kinds, strict=True) if k == INT]
            hooked = (*dict.fromkeys(sides), *ranks)
        else:
            hooked = hook
        _add(
            Op(
                OpName[fn.__name__],
                names,
                kinds,
                ins,
                outs,
                hooked,
                check,
                normalizes,
                varying,
                hot,
                key,
            )
        )
        return fn

    return declare


def _side(side: str | Side) -> Side:
    return (side, ONE) if isinstance(side, str) else side


def _add(entry: Op) -> None:
    OPS.append(entry)
    BY_NAME[entry.name] = entry


#: A batch of sends and receives (``batch_op_create().issue()``): issued by ``BatchSendRecv``,
#: not a method of its own; the compile layer sees its queued ops as four lists.
BATCH = Op(
    OpName.batch_op_issue,
    ("sends", "recvs", "is_recv", "peers"),
    (TENSORS, OUTS, BOOLS, INTS),
    None,
    None,
    (),
    checks.check_barrier,
    varying=True,
)
BY_NAME[BATCH.name] = BATCH
