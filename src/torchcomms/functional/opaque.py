"""``TraceableTorchComm``: a ``TorchComm`` that torch.compile sees as an opaque object.

torch 2.13's opaque-object support (``torch._library.opaque_object``) lets a custom op take
a Python object as an argument: a *reference* type is lifted into the graph as an input and
passed to the op, unchanged, when the graph runs.  Registering needs a class whose
metaclass is ``torch._opaque_base.OpaqueBaseMeta``, which a class cannot acquire after it
is created, so this subclass has it and ``install()`` makes ``new_comm`` (and so ``split``)
create it.

Dynamo may read only the members registered below: the getters are evaluated on the real
object at trace time (``USE_REAL``, baked into the graph as constants), the operations are
inlined.  Each operation checks ``torch.compiler.is_compiling()``: while tracing it emits the
op's custom op (``torchcomms.functional.traced``); otherwise, including when the compiled
graph runs the op, it is the eager ``TorchComm`` method, untouched.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch._library.opaque_object import MemberType, get_opaque_type_name, register_opaque_type
from torch._opaque_base import OpaqueBaseMeta

from torchcomms.comm import TorchComm
from torchcomms.comm import communicator as comm_module
from torchcomms.comm.ops import BatchSendRecv
from torchcomms.functional import autograd, ops, table, traced
from torchcomms.runtime.work import TorchWork
from torchcomms.types import BatchP2POptions, P2POp, P2POpType

#: Read on the real object while tracing; the result is a constant of the graph.
GETTERS = ("get_rank", "get_size", "get_name", "get_device", "get_backend")
#: Traced: each emits its ``torchcomms::`` op (the rows of ``table.OPS``, and batches).
OPERATIONS = (*(spec.method for spec in table.OPS), "batch_op_create")

_compiling = torch.compiler.is_compiling


class TraceableTorchComm(TorchComm, metaclass=OpaqueBaseMeta):
    """A communicator whose operations torch.compile traces into custom ops.

    Each operation of ``table.OPS`` is set on the class below (``_traceable``)."""

    def batch_op_create(self) -> BatchSendRecv:
        if not _compiling():
            self._checker("batch_op_create")  # what the eager method checks
        return TraceableBatch(self)


class TraceableBatch(BatchSendRecv):
    """The batch a traceable communicator creates: usable in a compiled region wherever made.

    A batch is a plain Python object, not an opaque one, so Dynamo traces its methods and
    keeps its queue (``ops``) as Python state: while tracing, ``send`` and ``recv`` append to
    ``ops`` without reading the communicator (its other members are not registered), and the
    appends are replayed on the real batch when the graph returns, as eager calls leave them.
    ``issue`` while tracing emits the batch's one op (``traced.issue_batch``) over every queued
    operation, those queued before the graph included.  Outside tracing each method is the
    eager one: validation of a queued operation happens at ``issue`` (eager ``issue`` checks
    every operation again), so a bad peer queued in a graph is reported there.
    """

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        if _compiling():
            self.ops.append(P2POp(P2POpType.SEND, tensor, dst))
            return
        BatchSendRecv.send(self, tensor, dst)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        if _compiling():
            self.ops.append(P2POp(P2POpType.RECV, tensor, src))
            return
        BatchSendRecv.recv(self, tensor, src)

    def issue(self, async_op: bool, options: BatchP2POptions | None = None) -> TorchWork:
        if _compiling():
            return traced.issue_batch(self._comm, self.ops, async_op, options)
        return BatchSendRecv.issue(self, async_op, options)


def _traceable(spec: table.OpSpec) -> Callable[..., Any]:
    """The method for one row: its custom op while tracing; eagerly, with an input that
    requires grad, upstream's autograd path (``traced.eager_with_grad``); else the eager
    method, untouched."""
    eager = getattr(TorchComm, spec.method)
    functional = spec.functional if autograd.differentiable(spec) else None

    @functools.wraps(eager)
    def method(self: TorchComm, *args: Any, **kwargs: Any) -> Any:
        if _compiling():
            return traced.call(spec, self, args, kwargs, functional)
        if functional is not None and torch.is_grad_enabled():
            result = traced.eager_with_grad(spec, self, args, kwargs, functional)
            if result is not None:
                return result
        return eager(self, *args, **kwargs)

    return method


for _spec in table.OPS:
    setattr(TraceableTorchComm, _spec.method, _traceable(_spec))


_installed = False


def install() -> None:
    """Register the opaque type and the ops, and make ``new_comm`` create this class (once)."""
    global _installed
    if _installed:
        return
    members = {name: MemberType.USE_REAL for name in GETTERS}
    members.update({name: MemberType.INLINED for name in OPERATIONS})
    register_opaque_type(TraceableTorchComm, typ="reference", members=members)
    ops.define(get_opaque_type_name(TraceableTorchComm))
    comm_module._set_comm_class(TraceableTorchComm)
    _installed = True
