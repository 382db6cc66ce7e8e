"""The op table: every communicator op declared once, everything per-op derived from it.

An op is one declaration in ``OpMethods``: its typed signature (what users and type
checkers see on ``TorchComm``) under an ``@op(...)`` that states what the signature cannot:
each argument's kind (read, written, a list, a rank, a reduce op, split sizes), which
arguments are the op's input and output sides and how the flight recorder shows them,
the pre-hook arguments' order, whether sizes differ per rank by design, whether the op has
a sync fast path (the lane), and the function that validates its arguments (``_check_*``
below, upstream's error texts).  ``OPS`` lists the ops in declaration order.

Derived from it, elsewhere: the ``TorchComm`` methods (``comm_ops`` generates each
from its declaration), the backend contract and the CPU, fake and plug-in backends' cold
ops (``backends.contract.fill_ops``), the compile layer's custom ops and autograd
(``functional.table``), what observers read off an op (``opinfo``: shapes, inputs and
outputs, key tensor), clog's signature, the collective check's fingerprint and the flight
recorder tool's rank-dependent ops.  Adding an op is one declaration here (plus a member of
``OpName``) and its algorithm in each transport (``CpuOps``).

A leaf module: it imports nothing from ``torchcomms``; the types in the declarations are
annotations only.  The declarations' bodies never run: ``comm_ops`` replaces them.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, ParamSpec, TypeVar

if TYPE_CHECKING:
    from datetime import timedelta

    import torch

    from torchcomms.types import ReduceOp
    from torchcomms.validation import Checker
    from torchcomms.work import TorchWork


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
        return "".join(w.capitalize() for w in self.method.split("_")) + "PreHookArgs"


OPS: list[Op] = []
BY_NAME: dict[OpName, Op] = {}

P = ParamSpec("P")
R = TypeVar("R")


def op(
    *kinds: str,
    inputs: str | Side,
    outputs: str | Side,
    hook: tuple[str, ...] | None = None,
    varying: bool = False,
    hot: bool = False,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Declare the decorated method an op (see the module docstring).

    The argument names come from its signature, the check is ``_check_<name>`` of this
    module, a side given as a name is one tensor (``ONE``), and the pre-hook arguments are
    by default the input, the output, then the root or peer."""

    def declare(fn: Callable[P, R]) -> Callable[P, R]:
        params = list(inspect.signature(fn).parameters)[1:]
        if params[len(kinds) :] != ["async_op", "hints", "timeout"]:
            raise RuntimeError(f"optable: {fn.__name__} must end with async_op, hints, timeout")
        names = tuple(params[: len(kinds)])
        ins, outs = _side(inputs), _side(outputs)
        check = globals().get(f"_check_{fn.__name__}")
        if check is None:
            raise RuntimeError(f"optable: {fn.__name__} has no _check_{fn.__name__}")
        if hook is None:
            sides = [s[0] for s in (ins, outs) if s is not None]
            ranks = [n for n, k in zip(names, kinds, strict=True) if k == INT]
            hooked = (*dict.fromkeys(sides), *ranks)
        else:
            hooked = hook
        normalizes = inspect.signature(check).return_annotation != "None"
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
            )
        )
        return fn

    return declare


def _side(side: str | Side) -> Side:
    return (side, ONE) if isinstance(side, str) else side


def _add(entry: Op) -> None:
    OPS.append(entry)
    BY_NAME[entry.name] = entry


def _declared() -> NoReturn:
    raise RuntimeError("optable: a declaration runs only until comm_ops replaces it")


# -- argument checks: upstream's rules and error texts, in upstream's order -----------------------
def _check_send(c: Checker, tensor: Any, dst: Any) -> None:
    c.tensor(tensor)
    c.peer("dst", dst, "send to")


def _check_recv(c: Checker, tensor: Any, src: Any) -> None:
    c.tensor(tensor)
    c.peer("src", src, "recv from")


def _check_broadcast(c: Checker, tensor: Any, root: Any) -> None:
    c.tensor(tensor)
    c.rank_arg("root", root)


def _check_all_reduce(c: Checker, tensor: Any, op: Any) -> None:
    c.tensor(tensor)
    c.reduce_op(op, tensor.dtype)


def _check_reduce(c: Checker, tensor: Any, root: Any, op: Any) -> None:
    c.tensor(tensor)
    c.rank_arg("root", root)
    c.reduce_op(op, tensor.dtype)


def _check_all_gather(c: Checker, tensor_list: Any, tensor: Any) -> None:
    c.tensor(tensor)
    outs = c.tensor_list(tensor_list, "tensor_list")
    c.list_len(outs, "tensor_list size must equal comm_size for all_gather")
    for t in outs:
        c.numel_eq(
            t.numel(),
            tensor.numel(),
            "All tensors in tensor_list must have same size as input tensor",
        )
    c.same_dtype(tensor, outs)


def _check_all_gather_v(c: Checker, tensor_list: Any, tensor: Any) -> None:
    c.tensor(tensor)
    outs = c.tensor_list(tensor_list, "tensor_list")
    c.list_len(outs, "tensor_list size must equal comm_size for all_gather_v")
    c.numel_eq(
        outs[c.rank].numel(),
        tensor.numel(),
        f"tensor_list[{c.rank}] must have the same size as this rank's input tensor",
    )
    c.same_dtype(tensor, outs)


def _times_size(what: str, big: str) -> Callable[..., None]:
    """``output``/``input`` where the ``big`` one holds comm_size times the other's elements."""
    small_name = "input" if big == "output" else "output"
    message = f"{big.capitalize()} tensor size must be {small_name}_size * comm_size for {what}"
    big_first = big == "output"

    def check(c: Checker, output: Any, input: Any, *op: Any) -> None:
        c.tensor(output, "output")
        c.tensor(input, "input")
        large, small = (output, input) if big_first else (input, output)
        c.numel_eq(large.numel(), small.numel() * c.size, message)
        c.same_dtype(small, [large])
        if op:
            c.reduce_op(op[0], output.dtype)

    return check


_check_all_gather_single = _times_size("all_gather_single", "output")
_check_reduce_scatter_single = _times_size("reduce_scatter_single", "input")


def _check_reduce_scatter(c: Checker, output: Any, input_list: Any, op: Any) -> None:
    c.tensor(output, "output")
    ins = c.tensor_list(input_list, "input_list")
    c.list_len(ins, "input_list size must equal comm_size for reduce_scatter")
    for t in ins:
        c.numel_eq(
            t.numel(), output.numel(), "All input tensors must have same size as output tensor"
        )
    c.same_dtype(output, ins)
    c.reduce_op(op, output.dtype)


def _check_reduce_scatter_v(c: Checker, output: Any, input_list: Any, op: Any) -> None:
    c.tensor(output, "output")
    ins = c.tensor_list(input_list, "input_list")
    c.list_len(ins, "input_list size must equal comm_size for reduce_scatter_v")
    c.numel_eq(
        ins[c.rank].numel(),
        output.numel(),
        f"input_list[{c.rank}] must have the same size as this rank's output tensor",
    )
    c.same_dtype(output, ins)
    c.reduce_op(op, output.dtype)


def _check_all_to_all_single(c: Checker, output: Any, input: Any) -> None:
    c.tensor(output, "output")
    c.tensor(input, "input")
    c.numel_eq(
        output.numel(),
        input.numel(),
        "Input and output tensors must have same size for all_to_all_single",
    )
    if input.numel() % c.size != 0:
        raise c.fail(
            "Tensor size must be divisible by comm_size for all_to_all_single "
            f"(got {input.numel()}, comm_size {c.size})"
        )
    c.same_dtype(input, [output])


def _check_all_to_all_v_single(
    c: Checker, output: Any, input: Any, output_split_sizes: Any, input_split_sizes: Any
) -> tuple[Any, ...]:
    c.tensor(output, "output")
    c.tensor(input, "input")
    out_splits = c.split_sizes(output_split_sizes, "output_split_sizes", output)
    in_splits = c.split_sizes(input_split_sizes, "input_split_sizes", input)
    if output.dim() > 1 or input.dim() > 1:
        out_row = output.shape[1:].numel() if output.dim() > 0 else 1
        in_row = input.shape[1:].numel() if input.dim() > 0 else 1
        if out_row != in_row:
            raise c.fail(
                "input and output rows must have the same number of elements for "
                f"all_to_all_v_single (got {in_row} and {out_row})"
            )
    c.same_dtype(input, [output])
    return output, input, out_splits, in_splits


def _check_all_to_all(c: Checker, output_tensor_list: Any, input_tensor_list: Any) -> None:
    outs = c.tensor_list(output_tensor_list, "output_tensor_list")
    ins = c.tensor_list(input_tensor_list, "input_tensor_list")
    if len(outs) != c.size or len(ins) != c.size:
        raise c.fail(
            "Tensor list sizes must equal comm_size for all_to_all "
            f"(got {len(outs)} outputs and {len(ins)} inputs, expected {c.size})"
        )
    c.same_dtype(ins[0], ins[1:] + outs)


def _check_barrier(c: Checker) -> None:
    pass


def _check_scatter(c: Checker, output_tensor: Any, input_tensor_list: Any, root: Any) -> None:
    c.tensor(output_tensor, "output_tensor")
    c.rank_arg("root", root)
    if c.rank == root:
        ins = c.tensor_list(input_tensor_list, "input_tensor_list")
        c.list_len(ins, "input_tensor_list size must equal comm_size for scatter")
        for t in ins:
            c.numel_eq(
                t.numel(),
                output_tensor.numel(),
                "All input tensors must have same size as output tensor for scatter",
            )
        c.same_dtype(output_tensor, ins)


def _check_gather(c: Checker, output_tensor_list: Any, input_tensor: Any, root: Any) -> None:
    c.tensor(input_tensor, "input_tensor")
    c.rank_arg("root", root)
    if c.rank == root:
        outs = c.tensor_list(output_tensor_list, "output_tensor_list")
        c.list_len(outs, "output_tensor_list size must equal comm_size for gather")
        for t in outs:
            c.numel_eq(
                t.numel(),
                input_tensor.numel(),
                "All output tensors must have same size as input tensor for gather",
            )
        c.same_dtype(input_tensor, outs)


def _check_gather_single(c: Checker, output: Any, input: Any, root: Any) -> None:
    c.tensor(input, "input")
    c.rank_arg("root", root)
    if c.rank == root:
        c.tensor(output, "output")
        c.numel_eq(
            output.numel(),
            input.numel() * c.size,
            "Output tensor size must be input_size * comm_size for gather_single",
        )
        c.same_dtype(input, [output])


# -- the declarations ----------------------------------------------------------------------------
#: Sides and pre-hook orders that differ from the defaults (``op``).
_A2A_IN: Side = ("input_tensor_list", MANY)
_A2A_OUT: Side = ("output_tensor_list", MANY)
_A2AV_HOOK = ("input", "output", "input_split_sizes", "output_split_sizes")
_SCATTER_HOOK = ("output_tensor", "input_tensor_list", "root")


class OpMethods:
    """The ops of a ``TorchComm``, declared (``TorchComm`` inherits them; see the module)."""

    # -- point-to-point
    @op(TENSOR, INT, inputs="tensor", outputs=None, hot=True)
    def send(
        self,
        tensor: torch.Tensor,
        dst: int,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        """Send ``tensor`` to rank ``dst``."""
        _declared()

    @op(OUT, INT, inputs=None, outputs="tensor", hot=True)
    def recv(
        self,
        tensor: torch.Tensor,
        src: int,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        """Receive into ``tensor`` from rank ``src``."""
        _declared()

    # -- collectives
    @op(OUT, INT, inputs="tensor", outputs="tensor", hot=True)
    def broadcast(
        self,
        tensor: torch.Tensor,
        root: int,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        """Every rank's ``tensor`` becomes ``root``'s."""
        _declared()

    @op(OUT, RED, inputs="tensor", outputs="tensor", hot=True)
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        """Every rank's ``tensor`` becomes the reduction of all of them, in place."""
        _declared()

    @op(OUT, INT, RED, inputs="tensor", outputs="tensor", hot=True)
    def reduce(
        self,
        tensor: torch.Tensor,
        root: int,
        op: ReduceOp,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        """``root``'s ``tensor`` becomes the reduction of every rank's."""
        _declared()

    @op(OUTS, TENSOR, inputs="tensor", outputs=("tensor_list", STACKED))
    def all_gather(
        self,
        tensor_list: list[torch.Tensor],
        tensor: torch.Tensor,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        """``tensor_list[r]`` becomes rank r's ``tensor`` (all of equal size)."""
        _declared()

    @op(OUTS, TENSOR, inputs="tensor", outputs=("tensor_list", MANY), varying=True)
    def all_gather_v(
        self,
        tensor_list: list[torch.Tensor],
        tensor: torch.Tensor,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        """``tensor_list[r]`` becomes rank r's ``tensor`` (sizes may differ per rank)."""
        _declared()

    @op(OUT, TENSOR, inputs="input", outputs="output")
    def all_gather_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        """``output`` becomes every rank's ``input``, concatenated in rank order."""
        _declared()

    @op(OUT, TENSORS, RED, inputs=("input_list", STACKED), outputs="output")
    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: ReduceOp,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        """``output`` becomes the reduction of every rank's ``input_list[rank]``."""
        _declared()

    @op(OUT, TENSORS, RED, inputs=("input_list", MANY), outputs="output", varying=True)
    def reduce_scatter_v(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: ReduceOp,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        """As ``reduce_scatter``, with a size per rank."""
        _declared()

    @op(OUT, TENSOR, RED, inputs="input", outputs="output")
    def reduce_scatter_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        """``output`` becomes the reduction of every rank's chunk ``rank`` of ``input``."""
        _declared()

    @op(OUT, TENSOR, inputs="input", outputs="output")
    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        """Chunk r of ``input`` goes to rank r; chunk r of ``output`` comes from rank r."""
        _declared()

    @op(OUT, TENSOR, INTS, INTS, inputs="input", outputs="output", hook=_A2AV_HOOK, varying=True)
    def all_to_all_v_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        """As ``all_to_all_single``, with rows per peer given by the split sizes."""
        _declared()

    @op(OUTS, TENSORS, inputs=_A2A_IN, outputs=_A2A_OUT, varying=True)
    def all_to_all(
        self,
        output_tensor_list: list[torch.Tensor],
        input_tensor_list: list[torch.Tensor],
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        """``input_tensor_list[r]`` goes to rank r, ``output_tensor_list[r]`` comes from it."""
        _declared()

    @op(inputs=None, outputs=None, hot=True)
    def barrier(
        self,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        """Returns once every rank entered it."""
        _declared()

    @op(OUT, TENSORS, INT, inputs=_A2A_IN, outputs="output_tensor", hook=_SCATTER_HOOK)
    def scatter(
        self,
        output_tensor: torch.Tensor,
        input_tensor_list: list[torch.Tensor],
        root: int,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        """Rank r's ``output_tensor`` becomes ``root``'s ``input_tensor_list[r]``."""
        _declared()

    @op(OUTS, TENSOR, INT, inputs="input_tensor", outputs=_A2A_OUT)
    def gather(
        self,
        output_tensor_list: list[torch.Tensor],
        input_tensor: torch.Tensor,
        root: int,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        """``root``'s ``output_tensor_list[r]`` becomes rank r's ``input_tensor``."""
        _declared()

    @op(OUT, TENSOR, INT, inputs="input", outputs="output")
    def gather_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        root: int,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        """``root``'s ``output`` becomes every rank's ``input``, concatenated in rank order."""
        _declared()


#: A batch of sends and receives (``batch_op_create().issue()``): issued by ``BatchSendRecv``,
#: not a method of its own; the compile layer sees its queued ops as four lists.
BATCH = Op(
    OpName.batch_op_issue,
    ("sends", "recvs", "is_recv", "peers"),
    (TENSORS, OUTS, BOOLS, INTS),
    None,
    None,
    (),
    _check_barrier,
    varying=True,
)
BY_NAME[BATCH.name] = BATCH
