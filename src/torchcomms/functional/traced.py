"""What a communicator call becomes while torch.compile traces it (Dynamo inlines this).

``call`` takes an eager method's arguments (one row of ``torchcomms.functional.table``),
flattens them into the schema types of ``torchcomms.functional.ops`` and emits that op: the
in-place ``torchcomm_<method>_`` (its ``_async`` form for ``async_op=True``), run under
``torch.no_grad()`` as an eager call writes its outputs outside autograd; or, for a row with
an autograd formula whose input requires grad (grad mode on, a linear reduction), the
functional ``torchcomm_<method>``, whose results are copied into the outputs under autograd
(``_differentiable``), so the graph records the formula and its backward collective.

A call returns a ``TracedWork`` whose ``wait()`` emits ``torchcomm_wait_`` on the call's
output tensors; a batch's ``issue()`` (``opaque.TraceableBatch``, whose queue is Python state
at trace time) emits one ``torchcomm_batch_op_issue_`` op through ``issue_batch``.  Only code
that runs at trace time lives here: when the graph executes, only the ops' kernels run.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

from torchcomms.functional import table
from torchcomms.functional.ops import ORDER_TOKEN, WAIT, async_name, hints_text
from torchcomms.runtime.work import TorchWork
from torchcomms.types import (
    UNSET_BATCH_TIMEOUT,
    BatchP2POptions,
    P2POp,
    P2POpType,
    RedOpType,
    ReduceOp,
)

_Tail = tuple[bool, list[str], list[str], "float | None", int]
#: The reductions with a gradient formula (autograd.py): the linear ones.
_LINEAR = (RedOpType.SUM, RedOpType.AVG, RedOpType.PREMUL_SUM)
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
def _hints_text(keys: tuple[str, ...], values: tuple[str, ...]) -> str:
    """The hints as one string (the functional ops' form), evaluated at trace time."""
    return hints_text(keys, values)


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
    """The work a traced call returns; ``wait()`` is the graph's ``torchcomm_wait_`` op (none
    for a call that completed in its own op: ``done``)."""

    def __init__(self, tensors: Sequence[torch.Tensor], call_id: int, done: bool = False) -> None:
        super().__init__()
        self._tensors = list(tensors)
        self._call_id = call_id
        self._done = done

    def wait(self) -> None:
        if self._done:
            return
        with torch.no_grad():
            getattr(_ops(), WAIT)(ORDER_TOKEN, self._tensors, self._call_id)

    def is_completed(self) -> bool:
        return True

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The tensors the call writes."""
        return self._tensors


def issue_batch(
    comm: Any, queued: Sequence[P2POp], async_op: bool, options: BatchP2POptions | None
) -> TracedWork:
    """A batch's ``issue()`` while tracing: one op over its sends and receives, in queue order.

    The receives are the tensors the op writes (its ``wait()`` waits on them)."""
    sends: list[torch.Tensor] = []
    recvs: list[torch.Tensor] = []
    is_recv: list[bool] = []
    peers: list[int] = []
    for op in queued:
        recv = op.type is P2POpType.RECV
        (recvs if recv else sends).append(op.tensor)
        is_recv.append(recv)
        peers.append(op.peer)
    hints = None if options is None else options.hints
    timeout = None
    if options is not None and options.timeout is not UNSET_BATCH_TIMEOUT:
        timeout = options.timeout
    tail = _tail(async_op, hints, timeout)
    with torch.no_grad():
        _op(table.BATCH.op, async_op)(comm, ORDER_TOKEN, sends, recvs, is_recv, peers, *tail)
    return TracedWork(recvs, tail[-1])


# -- every communicator op: one row of ``table.OPS`` ------------------------------------------
def _bind(
    op_name: str,
    names: tuple[str, ...],
    kinds: tuple[str, ...],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[dict[str, Any], list[Any], list[torch.Tensor], _Tail]:
    """A call's arguments bound to the row's names, flattened into the op's schema types,
    the tensors it writes, and the tail (``async_op``, hints, timeout, call id)."""
    params = (*names, "async_op", "hints", "timeout")
    if len(args) > len(params):
        raise TypeError(f"{op_name[:-1]}() takes {len(params)} arguments, got {len(args)}")
    bound = dict(zip(params, args, strict=False))
    for key, value in kwargs.items():
        if key not in params or key in bound:
            raise TypeError(f"{op_name[:-1]}() got an unexpected or repeated argument {key!r}")
        bound[key] = value
    for name in (*names, "async_op"):
        if name not in bound:
            raise TypeError(f"{op_name[:-1]}() missing argument {name!r}")
    tail = _tail(bound["async_op"], bound.get("hints"), bound.get("timeout"))
    flat: list[Any] = []
    outputs: list[torch.Tensor] = []
    for name, kind in zip(names, kinds, strict=False):  # equal lengths: the table
        value = bound[name]
        if kind == table.RED:
            flat.extend(_red(value))
        elif kind == table.INTS:
            flat.append(list(value))
        else:
            flat.append(value)
        if kind == table.OUT:
            outputs.append(value)
        elif kind == table.OUTS:
            outputs.extend(value)
    return bound, flat, outputs, tail


def _requires_grad(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, (list, tuple)):
        return any(isinstance(t, torch.Tensor) and t.requires_grad for t in value)
    return False


def eager_with_grad(
    spec: table.OpSpec, comm: Any, args: tuple[Any, ...], kwargs: dict[str, Any], functional: str
) -> Any:
    """Upstream's eager autograd path, for a call outside a compiled region: ``None`` unless
    the call goes through autograd (``_wants_grad``); else it runs the functional op (the
    formula records the backward collective) and returns what upstream returns, the result
    instead of a work: the output tensor (``all_gather``: the list of them), each wrapped
    in a ``TorchCommsAsyncTensor`` that is already complete, so ``.wait()`` still works."""
    from torchcomms.functional.async_tensor import TorchCommsAsyncTensor

    if not any(_requires_grad(v) for v in (*args, *kwargs.values())):
        return None  # the common case, decided without binding
    names, kinds = spec.names, spec.kinds
    try:
        bound, flat, outputs, tail = _bind(spec.op, names, kinds, args, kwargs)
    except (TypeError, AttributeError, ValueError):
        return None  # bad arguments: the eager method raises its own error
    if not _wants_grad(names, kinds, bound, outputs):
        return None
    done = _differentiable(functional, names, kinds, bound, comm, flat, tail)
    results = [TorchCommsAsyncTensor(t, None) for t in done.tensors]
    return results if table.OUTS in kinds else results[0]


def call(
    spec: table.OpSpec,
    comm: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    functional: str | None = None,
) -> TracedWork:
    """Emit the op of one ``table.OPS`` row for a call ``method(*args, **kwargs)``.

    Binds the arguments as the eager method does (its names, then ``async_op``, ``hints=None``,
    ``timeout=None``), flattens them into the op's schema types and returns the work whose
    ``wait()`` emits ``torchcomm_wait_`` on the tensors the op writes.  ``functional`` names
    the row's differentiable functional op, if it has one: a call whose input requires grad
    emits it instead (``_differentiable``)."""
    op_name, names, kinds = spec.op, spec.names, spec.kinds
    bound, flat, outputs, tail = _bind(op_name, names, kinds, args, kwargs)
    async_op = bound["async_op"]
    if functional is not None and _wants_grad(names, kinds, bound, outputs):
        return _differentiable(functional, names, kinds, bound, comm, flat, tail)
    with torch.no_grad():
        _op(op_name, async_op)(comm, ORDER_TOKEN, *flat, *tail)
    return TracedWork(outputs, tail[-1])


def _wants_grad(
    names: tuple[str, ...],
    kinds: tuple[str, ...],
    bound: dict[str, Any],
    outputs: list[torch.Tensor],
) -> bool:
    """Whether a call goes through autograd: grad mode on and an input requiring grad.

    The inputs are the tensors an op reads, or, for an op that only writes in place
    (``all_reduce``), the tensors it writes; a reduction must be linear (``_LINEAR``).  A leaf
    that requires grad and is written stays outside autograd, as in an eager call (autograd
    refuses an in-place write to it)."""
    if not torch.is_grad_enabled():
        return False
    for name, kind in zip(names, kinds, strict=False):
        if kind == table.RED and bound[name].type not in _LINEAR:
            return False  # MAX and the like have no formula: outside autograd, as eagerly
    read_only = any(k in (table.TENSOR, table.TENSORS) for k in kinds)
    inputs: list[torch.Tensor] = []
    for name, kind in zip(names, kinds, strict=False):
        value = bound[name]
        if kind == table.TENSOR or (kind == table.OUT and not read_only):
            inputs.append(value)
        elif kind == table.TENSORS or (kind == table.OUTS and not read_only):
            inputs.extend(value)
    if not any(t.requires_grad for t in inputs):
        return False
    return not any(t.requires_grad and t.is_leaf for t in outputs)


def _differentiable(
    functional: str,
    names: tuple[str, ...],
    kinds: tuple[str, ...],
    bound: dict[str, Any],
    comm: Any,
    flat: list[Any],
    tail: _Tail,
) -> TracedWork:
    """The functional op (its autograd formula records the backward collective), its results
    copied into the outputs under autograd, as an in-place write of them.  It completes in
    its own op, so its work's ``wait()`` emits nothing (an ``async_op=True`` call is issued
    synchronously)."""
    async_op, keys, values, seconds, call_id = tail
    hints = _hints_text(tuple(keys), tuple(values))
    result = getattr(_ops(), functional)(
        comm, ORDER_TOKEN, *flat, async_op, hints, seconds, call_id
    )
    with torch.no_grad():
        ORDER_TOKEN.copy_(result[0])
    at = 1
    outputs: list[torch.Tensor] = []
    for name, kind in zip(names, kinds, strict=False):
        if kind == table.OUT:
            bound[name].copy_(result[at])
            outputs.append(bound[name])
            at += 1
        elif kind == table.OUTS:
            for dst, src in zip(bound[name], result[at], strict=True):
                dst.copy_(src)
                outputs.append(dst)
            at += 1
    return TracedWork(outputs, tail[-1], done=True)
