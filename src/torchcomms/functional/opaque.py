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

from datetime import timedelta

import torch
from torch._library.opaque_object import MemberType, get_opaque_type_name, register_opaque_type
from torch._opaque_base import OpaqueBaseMeta

from torchcomms import comm as comm_module
from torchcomms.comm import TorchComm
from torchcomms.comm_ops import BatchSendRecv
from torchcomms.functional import ops, traced
from torchcomms.types import ReduceOp
from torchcomms.work import TorchWork

_Hints = dict[str, str] | None
_Timeout = timedelta | None
_Tensors = list[torch.Tensor]

#: Read on the real object while tracing; the result is a constant of the graph.
GETTERS = ("get_rank", "get_size", "get_name", "get_device", "get_backend")
#: Traced: each emits its ``torchcomms::`` op.
OPERATIONS = (
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "all_gather_v",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_v",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "all_to_all_v_single",
    "scatter",
    "gather",
    "gather_single",
    "send",
    "recv",
    "barrier",
    "batch_op_create",
)

_compiling = torch.compiler.is_compiling


class TraceableTorchComm(TorchComm, metaclass=OpaqueBaseMeta):
    """A communicator whose operations torch.compile traces into custom ops."""

    def send(
        self,
        tensor: torch.Tensor,
        dst: int,
        async_op: bool,
        hints: _Hints = None,
        timeout: _Timeout = None,
    ) -> TorchWork:
        if _compiling():
            return traced.send(self, tensor, dst, async_op, hints, timeout)
        return TorchComm.send(self, tensor, dst, async_op, hints, timeout)

    def recv(
        self,
        tensor: torch.Tensor,
        src: int,
        async_op: bool,
        hints: _Hints = None,
        timeout: _Timeout = None,
    ) -> TorchWork:
        if _compiling():
            return traced.recv(self, tensor, src, async_op, hints, timeout)
        return TorchComm.recv(self, tensor, src, async_op, hints, timeout)

    def batch_op_create(self) -> BatchSendRecv:
        if _compiling():
            return traced.TracedBatch(self)
        return TorchComm.batch_op_create(self)

    def broadcast(
        self,
        tensor: torch.Tensor,
        root: int,
        async_op: bool,
        hints: _Hints = None,
        timeout: _Timeout = None,
    ) -> TorchWork:
        if _compiling():
            return traced.broadcast(self, tensor, root, async_op, hints, timeout)
        return TorchComm.broadcast(self, tensor, root, async_op, hints, timeout)

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp,
        async_op: bool,
        hints: _Hints = None,
        timeout: _Timeout = None,
    ) -> TorchWork:
        if _compiling():
            return traced.all_reduce(self, tensor, op, async_op, hints, timeout)
        return TorchComm.all_reduce(self, tensor, op, async_op, hints, timeout)

    def reduce(
        self,
        tensor: torch.Tensor,
        root: int,
        op: ReduceOp,
        async_op: bool,
        hints: _Hints = None,
        timeout: _Timeout = None,
    ) -> TorchWork:
        if _compiling():
            return traced.reduce(self, tensor, root, op, async_op, hints, timeout)
        return TorchComm.reduce(self, tensor, root, op, async_op, hints, timeout)

    def all_gather(
        self,
        tensor_list: _Tensors,
        tensor: torch.Tensor,
        async_op: bool,
        hints: _Hints = None,
        timeout: _Timeout = None,
    ) -> TorchWork:
        if _compiling():
            return traced.all_gather(self, tensor_list, tensor, async_op, hints, timeout)
        return TorchComm.all_gather(self, tensor_list, tensor, async_op, hints, timeout)

    def all_gather_v(
        self,
        tensor_list: _Tensors,
        tensor: torch.Tensor,
        async_op: bool,
        hints: _Hints = None,
        timeout: _Timeout = None,
    ) -> TorchWork:
        if _compiling():
            return traced.all_gather_v(self, tensor_list, tensor, async_op, hints, timeout)
        return TorchComm.all_gather_v(self, tensor_list, tensor, async_op, hints, timeout)

    def all_gather_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        async_op: bool,
        hints: _Hints = None,
        timeout: _Timeout = None,
    ) -> TorchWork:
        if _compiling():
            return traced.all_gather_single(self, output, input, async_op, hints, timeout)
        return TorchComm.all_gather_single(self, output, input, async_op, hints, timeout)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: _Tensors,
        op: ReduceOp,
        async_op: bool,
        hints: _Hints = None,
        timeout: _Timeout = None,
    ) -> TorchWork:
        if _compiling():
            return traced.reduce_scatter(self, output, input_list, op, async_op, hints, timeout)
        return TorchComm.reduce_scatter(self, output, input_list, op, async_op, hints, timeout)

    def reduce_scatter_v(
        self,
        output: torch.Tensor,
        input_list: _Tensors,
        op: ReduceOp,
        async_op: bool,
        hints: _Hints = None,
        timeout: _Timeout = None,
    ) -> TorchWork:
        if _compiling():
            return traced.reduce_scatter_v(self, output, input_list, op, async_op, hints, timeout)
        return TorchComm.reduce_scatter_v(self, output, input_list, op, async_op, hints, timeout)

    def reduce_scatter_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp,
        async_op: bool,
        hints: _Hints = None,
        timeout: _Timeout = None,
    ) -> TorchWork:
        if _compiling():
            return traced.reduce_scatter_single(self, output, input, op, async_op, hints, timeout)
        return TorchComm.reduce_scatter_single(self, output, input, op, async_op, hints, timeout)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        async_op: bool,
        hints: _Hints = None,
        timeout: _Timeout = None,
    ) -> TorchWork:
        if _compiling():
            return traced.all_to_all_single(self, output, input, async_op, hints, timeout)
        return TorchComm.all_to_all_single(self, output, input, async_op, hints, timeout)

    def all_to_all_v_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        async_op: bool,
        hints: _Hints = None,
        timeout: _Timeout = None,
    ) -> TorchWork:
        if _compiling():
            return traced.all_to_all_v_single(
                self, output, input, output_split_sizes, input_split_sizes, async_op, hints, timeout
            )
        return TorchComm.all_to_all_v_single(
            self, output, input, output_split_sizes, input_split_sizes, async_op, hints, timeout
        )

    def all_to_all(
        self,
        output_tensor_list: _Tensors,
        input_tensor_list: _Tensors,
        async_op: bool,
        hints: _Hints = None,
        timeout: _Timeout = None,
    ) -> TorchWork:
        if _compiling():
            return traced.all_to_all(
                self, output_tensor_list, input_tensor_list, async_op, hints, timeout
            )
        return TorchComm.all_to_all(
            self, output_tensor_list, input_tensor_list, async_op, hints, timeout
        )

    def barrier(self, async_op: bool, hints: _Hints = None, timeout: _Timeout = None) -> TorchWork:
        if _compiling():
            return traced.barrier(self, async_op, hints, timeout)
        return TorchComm.barrier(self, async_op, hints, timeout)

    def scatter(
        self,
        output_tensor: torch.Tensor,
        input_tensor_list: _Tensors,
        root: int,
        async_op: bool,
        hints: _Hints = None,
        timeout: _Timeout = None,
    ) -> TorchWork:
        if _compiling():
            return traced.scatter(
                self, output_tensor, input_tensor_list, root, async_op, hints, timeout
            )
        return TorchComm.scatter(
            self, output_tensor, input_tensor_list, root, async_op, hints, timeout
        )

    def gather(
        self,
        output_tensor_list: _Tensors,
        input_tensor: torch.Tensor,
        root: int,
        async_op: bool,
        hints: _Hints = None,
        timeout: _Timeout = None,
    ) -> TorchWork:
        if _compiling():
            return traced.gather(
                self, output_tensor_list, input_tensor, root, async_op, hints, timeout
            )
        return TorchComm.gather(
            self, output_tensor_list, input_tensor, root, async_op, hints, timeout
        )

    def gather_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        root: int,
        async_op: bool,
        hints: _Hints = None,
        timeout: _Timeout = None,
    ) -> TorchWork:
        if _compiling():
            return traced.gather_single(self, output, input, root, async_op, hints, timeout)
        return TorchComm.gather_single(self, output, input, root, async_op, hints, timeout)


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
