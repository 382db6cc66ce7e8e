"""``CommOps``: the operations of a ``TorchComm``, each validated at the edge, then issued.

Every method checks its arguments with the reference's rules and error texts (shared by
every backend, so backends may assume valid input) and hands the backend call to
``CommCore._issue``.  ``BatchSendRecv`` collects sends and receives and issues them as
one op through the same path.
"""

from __future__ import annotations

from datetime import timedelta

import torch

from torchcomms import hook_args
from torchcomms.comm_core import CommCore
from torchcomms.types import (
    UNSET_BATCH_TIMEOUT,
    BatchP2POptions,
    OpName,
    P2POp,
    P2POpType,
    ReduceOp,
)
from torchcomms.work import TorchWork


class CommOps(CommCore):
    """Collectives and point-to-point of a communicator (see the module docstring)."""

    # -- point-to-point ----------------------------------------------------------------------------
    def send(
        self,
        tensor: torch.Tensor,
        dst: int,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("send")
        c.tensor(tensor)
        c.peer("dst", dst, "send to")
        if async_op is False and hints is None and timeout is None and self._lane is not None:
            return self._sync(OpName.send, tensor, dst, self._backend.send, (tensor, dst, False))
        c.async_op(async_op)
        return self._issue(
            OpName.send,
            hook_args.SendPreHookArgs(tensor, dst, async_op),
            timeout,
            hints,
            self._backend.send,
            (tensor, dst, async_op),
        )

    def recv(
        self,
        tensor: torch.Tensor,
        src: int,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("recv")
        c.tensor(tensor)
        c.peer("src", src, "recv from")
        if async_op is False and hints is None and timeout is None and self._lane is not None:
            return self._sync(OpName.recv, tensor, src, self._backend.recv, (tensor, src, False))
        c.async_op(async_op)
        return self._issue(
            OpName.recv,
            hook_args.RecvPreHookArgs(tensor, src, async_op),
            timeout,
            hints,
            self._backend.recv,
            (tensor, src, async_op),
        )

    def batch_op_create(self) -> BatchSendRecv:
        """A batch of sends and receives issued together, so mutual pairs cannot deadlock."""
        self._checker("batch_op_create")
        return BatchSendRecv(self)

    # -- collectives -----------------------------------------------------------------------------
    def broadcast(
        self,
        tensor: torch.Tensor,
        root: int,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("broadcast")
        c.tensor(tensor)
        c.rank_arg("root", root)
        if async_op is False and hints is None and timeout is None and self._lane is not None:
            return self._sync(
                OpName.broadcast, tensor, -1, self._backend.broadcast, (tensor, root, False)
            )
        c.async_op(async_op)
        return self._issue(
            OpName.broadcast,
            hook_args.BroadcastPreHookArgs(tensor, root, async_op),
            timeout,
            hints,
            self._backend.broadcast,
            (tensor, root, async_op),
        )

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("all_reduce")
        c.tensor(tensor)
        c.reduce_op(op, tensor.dtype)
        if async_op is False and hints is None and timeout is None and self._lane is not None:
            return self._sync(
                OpName.all_reduce, tensor, -1, self._backend.all_reduce, (tensor, op, False)
            )
        c.async_op(async_op)
        return self._issue(
            OpName.all_reduce,
            hook_args.AllReducePreHookArgs(tensor, async_op),
            timeout,
            hints,
            self._backend.all_reduce,
            (tensor, op, async_op),
        )

    def reduce(
        self,
        tensor: torch.Tensor,
        root: int,
        op: ReduceOp,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("reduce")
        c.tensor(tensor)
        c.rank_arg("root", root)
        c.reduce_op(op, tensor.dtype)
        if async_op is False and hints is None and timeout is None and self._lane is not None:
            return self._sync(
                OpName.reduce, tensor, -1, self._backend.reduce, (tensor, root, op, False)
            )
        c.async_op(async_op)
        return self._issue(
            OpName.reduce,
            hook_args.ReducePreHookArgs(tensor, root, async_op),
            timeout,
            hints,
            self._backend.reduce,
            (tensor, root, op, async_op),
        )

    def all_gather(
        self,
        tensor_list: list[torch.Tensor],
        tensor: torch.Tensor,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("all_gather")
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
        c.async_op(async_op)
        return self._issue(
            OpName.all_gather,
            hook_args.AllGatherPreHookArgs(tensor, tensor_list, async_op),
            timeout,
            hints,
            self._backend.all_gather,
            (tensor_list, tensor, async_op),
        )

    def all_gather_v(
        self,
        tensor_list: list[torch.Tensor],
        tensor: torch.Tensor,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("all_gather_v")
        c.tensor(tensor)
        outs = c.tensor_list(tensor_list, "tensor_list")
        c.list_len(outs, "tensor_list size must equal comm_size for all_gather_v")
        c.numel_eq(
            outs[c.rank].numel(),
            tensor.numel(),
            f"tensor_list[{c.rank}] must have the same size as this rank's input tensor",
        )
        c.same_dtype(tensor, outs)
        c.async_op(async_op)
        return self._issue(
            OpName.all_gather_v,
            hook_args.AllGatherVPreHookArgs(tensor, tensor_list, async_op),
            timeout,
            hints,
            self._backend.all_gather_v,
            (tensor_list, tensor, async_op),
        )

    def all_gather_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("all_gather_single")
        c.tensor(output, "output")
        c.tensor(input, "input")
        c.numel_eq(
            output.numel(),
            input.numel() * c.size,
            "Output tensor size must be input_size * comm_size for all_gather_single",
        )
        c.same_dtype(input, [output])
        c.async_op(async_op)
        return self._issue(
            OpName.all_gather_single,
            hook_args.AllGatherSinglePreHookArgs(input, output, async_op),
            timeout,
            hints,
            self._backend.all_gather_single,
            (output, input, async_op),
        )

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: ReduceOp,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("reduce_scatter")
        c.tensor(output, "output")
        ins = c.tensor_list(input_list, "input_list")
        c.list_len(ins, "input_list size must equal comm_size for reduce_scatter")
        for t in ins:
            c.numel_eq(
                t.numel(), output.numel(), "All input tensors must have same size as output tensor"
            )
        c.same_dtype(output, ins)
        c.reduce_op(op, output.dtype)
        c.async_op(async_op)
        return self._issue(
            OpName.reduce_scatter,
            hook_args.ReduceScatterPreHookArgs(input_list, output, async_op),
            timeout,
            hints,
            self._backend.reduce_scatter,
            (output, input_list, op, async_op),
        )

    def reduce_scatter_v(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: ReduceOp,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("reduce_scatter_v")
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
        c.async_op(async_op)
        return self._issue(
            OpName.reduce_scatter_v,
            hook_args.ReduceScatterVPreHookArgs(input_list, output, async_op),
            timeout,
            hints,
            self._backend.reduce_scatter_v,
            (output, input_list, op, async_op),
        )

    def reduce_scatter_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("reduce_scatter_single")
        c.tensor(output, "output")
        c.tensor(input, "input")
        c.numel_eq(
            input.numel(),
            output.numel() * c.size,
            "Input tensor size must be output_size * comm_size for reduce_scatter_single",
        )
        c.same_dtype(output, [input])
        c.reduce_op(op, output.dtype)
        c.async_op(async_op)
        return self._issue(
            OpName.reduce_scatter_single,
            hook_args.ReduceScatterSinglePreHookArgs(input, output, async_op),
            timeout,
            hints,
            self._backend.reduce_scatter_single,
            (output, input, op, async_op),
        )

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("all_to_all_single")
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
        c.async_op(async_op)
        return self._issue(
            OpName.all_to_all_single,
            hook_args.AllToAllSinglePreHookArgs(input, output, async_op),
            timeout,
            hints,
            self._backend.all_to_all_single,
            (output, input, async_op),
        )

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
        c = self._checker("all_to_all_v_single")
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
        c.async_op(async_op)
        return self._issue(
            OpName.all_to_all_v_single,
            hook_args.AllToAllVSinglePreHookArgs(input, output, in_splits, out_splits, async_op),
            timeout,
            hints,
            self._backend.all_to_all_v_single,
            (output, input, out_splits, in_splits, async_op),
        )

    def all_to_all(
        self,
        output_tensor_list: list[torch.Tensor],
        input_tensor_list: list[torch.Tensor],
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("all_to_all")
        outs = c.tensor_list(output_tensor_list, "output_tensor_list")
        ins = c.tensor_list(input_tensor_list, "input_tensor_list")
        if len(outs) != c.size or len(ins) != c.size:
            raise c.fail(
                "Tensor list sizes must equal comm_size for all_to_all "
                f"(got {len(outs)} outputs and {len(ins)} inputs, expected {c.size})"
            )
        c.same_dtype(ins[0], ins[1:] + outs)
        c.async_op(async_op)
        return self._issue(
            OpName.all_to_all,
            hook_args.AllToAllPreHookArgs(input_tensor_list, output_tensor_list, async_op),
            timeout,
            hints,
            self._backend.all_to_all,
            (output_tensor_list, input_tensor_list, async_op),
        )

    def barrier(
        self,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("barrier")
        if async_op is False and hints is None and timeout is None and self._lane is not None:
            return self._sync(OpName.barrier, None, -1, self._backend.barrier, (False,))
        c.async_op(async_op)
        return self._issue(
            OpName.barrier,
            hook_args.BarrierPreHookArgs(async_op),
            timeout,
            hints,
            self._backend.barrier,
            (async_op,),
        )

    def scatter(
        self,
        output_tensor: torch.Tensor,
        input_tensor_list: list[torch.Tensor],
        root: int,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("scatter")
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
        c.async_op(async_op)
        return self._issue(
            OpName.scatter,
            hook_args.ScatterPreHookArgs(output_tensor, input_tensor_list, root, async_op),
            timeout,
            hints,
            self._backend.scatter,
            (output_tensor, input_tensor_list, root, async_op),
        )

    def gather(
        self,
        output_tensor_list: list[torch.Tensor],
        input_tensor: torch.Tensor,
        root: int,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("gather")
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
        c.async_op(async_op)
        return self._issue(
            OpName.gather,
            hook_args.GatherPreHookArgs(input_tensor, output_tensor_list, root, async_op),
            timeout,
            hints,
            self._backend.gather,
            (output_tensor_list, input_tensor, root, async_op),
        )

    def gather_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        root: int,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("gather_single")
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
        c.async_op(async_op)

        return self._issue(
            OpName.gather_single,
            hook_args.GatherSinglePreHookArgs(input, output, root, async_op),
            timeout,
            hints,
            self._backend.gather_single,
            (output, input, root, async_op),
        )


class BatchSendRecv:
    """Sends and receives collected with ``send``/``recv`` and issued together by ``issue``."""

    def __init__(self, comm: CommOps) -> None:
        self._comm = comm
        self.ops: list[P2POp] = []

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        c = self._comm._checker("batch send")
        c.tensor(tensor)
        c.peer("dst", dst, "send to")
        self.ops.append(P2POp(P2POpType.SEND, tensor, dst))

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        c = self._comm._checker("batch recv")
        c.tensor(tensor)
        c.peer("src", src, "recv from")
        self.ops.append(P2POp(P2POpType.RECV, tensor, src))

    def issue(self, async_op: bool, options: BatchP2POptions | None = None) -> TorchWork:
        comm = self._comm
        c = comm._checker("batch_op_issue")
        c.async_op(async_op)
        if not self.ops:
            raise c.fail("Cannot issue empty batch operation")
        for op in self.ops:
            c.tensor(op.tensor)
            c.peer("peer", op.peer, "send to" if op.type is P2POpType.SEND else "recv from")
        opts = options or BatchP2POptions()
        timeout = None if opts.timeout is UNSET_BATCH_TIMEOUT else opts.timeout
        ops = list(self.ops)
        backend = comm._backend
        return comm._issue(
            OpName.batch_op_issue,
            hook_args.BatchOpIssuePreHookArgs(len(ops), async_op),
            timeout,
            opts.hints,
            backend.batch_op_issue,
            (ops, async_op),
            post_args=hook_args.BatchOpIssuePostHookArgs,
        )
