"""What a communicator call becomes while torch.compile traces it (Dynamo inlines this).

Each function here has an eager method's signature, flattens its arguments into the
schema types of ``torchcomms.functional.ops`` and emits that op (its ``_async`` form for
``async_op=True``).  The ops run under
``torch.no_grad()``: an eager call writes its outputs outside autograd (a leaf that
requires grad may be written, a non-leaf keeps its ``grad_fn``), and so does the graph;
gradients therefore pass through a collective and its wait as through the identity.

A call returns a ``TracedWork`` whose ``wait()`` emits the ``wait_`` op on the call's
output tensors; ``batch_op_create()`` returns a ``TracedBatch`` that queues sends and
receives in Python (at trace time) and emits one ``batch_issue_`` op.  Only code that
runs at trace time lives here: when the graph executes, only the ops' kernels run.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

from torchcomms.comm_ops import BatchSendRecv
from torchcomms.functional.ops import ORDER_TOKEN, async_name
from torchcomms.types import UNSET_BATCH_TIMEOUT, BatchP2POptions, RedOpType, ReduceOp
from torchcomms.work import TorchWork

_Tail = tuple[bool, list[str], list[str], "float | None", int]
_call_ids = itertools.count()


def _ops() -> Any:
    return torch.ops.torchcomms


def _op(name: str, async_op: bool) -> Any:
    """The sync op ``name``, or its async form (see ``torchcomms.functional.ops``)."""
    return getattr(torch.ops.torchcomms, async_name(name) if async_op else name)


@torch.compiler.assume_constant_result
def _seconds(timeout: timedelta) -> float:
    """Evaluated once at trace time (Dynamo cannot trace ``timedelta``); a graph constant."""
    return timeout.total_seconds()


@torch.compiler.assume_constant_result
def _new_call_id() -> int:
    """A number for one call site of one trace (a graph constant): its async work's key."""
    return next(_call_ids)


def _tail(async_op: bool, hints: dict[str, str] | None, timeout: timedelta | None) -> _Tail:
    keys: list[str] = []
    values: list[str] = []
    if hints:
        for key, value in hints.items():
            keys.append(key)
            values.append(value)
    seconds = None if timeout is None else _seconds(timeout)
    return bool(async_op), keys, values, seconds, _new_call_id()


def _red(op: ReduceOp) -> tuple[int, float | None, torch.Tensor | None]:
    kind = op.type
    if kind is RedOpType.PREMUL_SUM:
        factor = op.factor
        if isinstance(factor, torch.Tensor):
            return kind.value, None, factor
        return kind.value, factor, None
    return kind.value, None, None


class TracedWork(TorchWork):
    """The work a traced call returns; ``wait()`` is the graph's ``wait_`` op."""

    def __init__(self, tensors: Sequence[torch.Tensor], call_id: int) -> None:
        super().__init__()
        self._tensors = list(tensors)
        self._call_id = call_id

    def wait(self) -> None:
        with torch.no_grad():
            _ops().wait_(ORDER_TOKEN, self._tensors, self._call_id)

    def is_completed(self) -> bool:
        return True


class TracedBatch(BatchSendRecv):
    """``batch_op_create()`` while tracing: sends and receives queued, issued as one op.

    ``ops`` stays empty: the queue is kept as flat lists, the form the op takes.
    """

    def __init__(self, comm: Any) -> None:
        super().__init__(comm)
        self._sends: list[torch.Tensor] = []
        self._recvs: list[torch.Tensor] = []
        self._is_recv: list[bool] = []
        self._peers: list[int] = []

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self._sends.append(tensor)
        self._is_recv.append(False)
        self._peers.append(dst)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        self._recvs.append(tensor)
        self._is_recv.append(True)
        self._peers.append(src)

    def issue(self, async_op: bool, options: BatchP2POptions | None = None) -> TracedWork:
        hints = None if options is None else options.hints
        timeout = None
        if options is not None and options.timeout is not UNSET_BATCH_TIMEOUT:
            timeout = options.timeout
        tail = _tail(async_op, hints, timeout)
        with torch.no_grad():
            _op("batch_issue_", async_op)(
                self._comm,
                ORDER_TOKEN,
                self._sends,
                self._recvs,
                self._is_recv,
                self._peers,
                *tail,
            )
        return TracedWork(self._recvs, tail[-1])


# -- one function per communicator op -----------------------------------------------------------
def all_reduce(
    comm: Any, tensor: torch.Tensor, op: ReduceOp, async_op: bool, hints: Any, timeout: Any
) -> TracedWork:
    tail = _tail(async_op, hints, timeout)
    with torch.no_grad():
        _op("all_reduce_", async_op)(comm, ORDER_TOKEN, tensor, *_red(op), *tail)
    return TracedWork([tensor], tail[-1])


def reduce(
    comm: Any,
    tensor: torch.Tensor,
    root: int,
    op: ReduceOp,
    async_op: bool,
    hints: Any,
    timeout: Any,
) -> TracedWork:
    tail = _tail(async_op, hints, timeout)
    with torch.no_grad():
        _op("reduce_", async_op)(comm, ORDER_TOKEN, tensor, root, *_red(op), *tail)
    return TracedWork([tensor], tail[-1])


def broadcast(
    comm: Any, tensor: torch.Tensor, root: int, async_op: bool, hints: Any, timeout: Any
) -> TracedWork:
    tail = _tail(async_op, hints, timeout)
    with torch.no_grad():
        _op("broadcast_", async_op)(comm, ORDER_TOKEN, tensor, root, *tail)
    return TracedWork([tensor], tail[-1])


def all_gather(
    comm: Any,
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    async_op: bool,
    hints: Any,
    timeout: Any,
) -> TracedWork:
    tail = _tail(async_op, hints, timeout)
    with torch.no_grad():
        _op("all_gather_", async_op)(comm, ORDER_TOKEN, tensor_list, tensor, *tail)
    return TracedWork(tensor_list, tail[-1])


def all_gather_v(
    comm: Any,
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    async_op: bool,
    hints: Any,
    timeout: Any,
) -> TracedWork:
    tail = _tail(async_op, hints, timeout)
    with torch.no_grad():
        _op("all_gather_v_", async_op)(comm, ORDER_TOKEN, tensor_list, tensor, *tail)
    return TracedWork(tensor_list, tail[-1])


def all_gather_single(
    comm: Any, output: torch.Tensor, input: torch.Tensor, async_op: bool, hints: Any, timeout: Any
) -> TracedWork:
    tail = _tail(async_op, hints, timeout)
    with torch.no_grad():
        _op("all_gather_single_", async_op)(comm, ORDER_TOKEN, output, input, *tail)
    return TracedWork([output], tail[-1])


def reduce_scatter(
    comm: Any,
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: ReduceOp,
    async_op: bool,
    hints: Any,
    timeout: Any,
) -> TracedWork:
    tail = _tail(async_op, hints, timeout)
    with torch.no_grad():
        _op("reduce_scatter_", async_op)(comm, ORDER_TOKEN, output, input_list, *_red(op), *tail)
    return TracedWork([output], tail[-1])


def reduce_scatter_v(
    comm: Any,
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: ReduceOp,
    async_op: bool,
    hints: Any,
    timeout: Any,
) -> TracedWork:
    tail = _tail(async_op, hints, timeout)
    with torch.no_grad():
        _op("reduce_scatter_v_", async_op)(comm, ORDER_TOKEN, output, input_list, *_red(op), *tail)
    return TracedWork([output], tail[-1])


def reduce_scatter_single(
    comm: Any,
    output: torch.Tensor,
    input: torch.Tensor,
    op: ReduceOp,
    async_op: bool,
    hints: Any,
    timeout: Any,
) -> TracedWork:
    tail = _tail(async_op, hints, timeout)
    with torch.no_grad():
        _op("reduce_scatter_single_", async_op)(comm, ORDER_TOKEN, output, input, *_red(op), *tail)
    return TracedWork([output], tail[-1])


def all_to_all(
    comm: Any,
    output_list: list[torch.Tensor],
    input_list: list[torch.Tensor],
    async_op: bool,
    hints: Any,
    timeout: Any,
) -> TracedWork:
    tail = _tail(async_op, hints, timeout)
    with torch.no_grad():
        _op("all_to_all_", async_op)(comm, ORDER_TOKEN, output_list, input_list, *tail)
    return TracedWork(output_list, tail[-1])


def all_to_all_single(
    comm: Any, output: torch.Tensor, input: torch.Tensor, async_op: bool, hints: Any, timeout: Any
) -> TracedWork:
    tail = _tail(async_op, hints, timeout)
    with torch.no_grad():
        _op("all_to_all_single_", async_op)(comm, ORDER_TOKEN, output, input, *tail)
    return TracedWork([output], tail[-1])


def all_to_all_v_single(
    comm: Any,
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int],
    input_split_sizes: list[int],
    async_op: bool,
    hints: Any,
    timeout: Any,
) -> TracedWork:
    tail = _tail(async_op, hints, timeout)
    with torch.no_grad():
        _op("all_to_all_v_single_", async_op)(
            comm,
            ORDER_TOKEN,
            output,
            input,
            list(output_split_sizes),
            list(input_split_sizes),
            *tail,
        )
    return TracedWork([output], tail[-1])


def scatter(
    comm: Any,
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    root: int,
    async_op: bool,
    hints: Any,
    timeout: Any,
) -> TracedWork:
    tail = _tail(async_op, hints, timeout)
    with torch.no_grad():
        _op("scatter_", async_op)(comm, ORDER_TOKEN, output, input_list, root, *tail)
    return TracedWork([output], tail[-1])


def gather(
    comm: Any,
    output_list: list[torch.Tensor],
    input: torch.Tensor,
    root: int,
    async_op: bool,
    hints: Any,
    timeout: Any,
) -> TracedWork:
    tail = _tail(async_op, hints, timeout)
    with torch.no_grad():
        _op("gather_", async_op)(comm, ORDER_TOKEN, output_list, input, root, *tail)
    return TracedWork(output_list, tail[-1])


def gather_single(
    comm: Any,
    output: torch.Tensor,
    input: torch.Tensor,
    root: int,
    async_op: bool,
    hints: Any,
    timeout: Any,
) -> TracedWork:
    tail = _tail(async_op, hints, timeout)
    with torch.no_grad():
        _op("gather_single_", async_op)(comm, ORDER_TOKEN, output, input, root, *tail)
    return TracedWork([output], tail[-1])


def send(
    comm: Any, tensor: torch.Tensor, dst: int, async_op: bool, hints: Any, timeout: Any
) -> TracedWork:
    tail = _tail(async_op, hints, timeout)
    with torch.no_grad():
        _op("send_", async_op)(comm, ORDER_TOKEN, tensor, dst, *tail)
    return TracedWork([], tail[-1])


def recv(
    comm: Any, tensor: torch.Tensor, src: int, async_op: bool, hints: Any, timeout: Any
) -> TracedWork:
    tail = _tail(async_op, hints, timeout)
    with torch.no_grad():
        _op("recv_", async_op)(comm, ORDER_TOKEN, tensor, src, *tail)
    return TracedWork([tensor], tail[-1])


def barrier(comm: Any, async_op: bool, hints: Any, timeout: Any) -> TracedWork:
    tail = _tail(async_op, hints, timeout)
    with torch.no_grad():
        _op("barrier_", async_op)(comm, ORDER_TOKEN, *tail)
    return TracedWork([], tail[-1])
