"""Every op of a ``TorchComm``: its typed signature, its declaration and the code that runs it.

Each method is what ``TorchComm.<op>`` runs (``TorchComm`` inherits ``OpMethods``): it checks
its arguments with the reference's rules and error texts (``checks``, shared by every
backend, so backends may assume valid input), then takes the sync lane (``CommCore._sync``)
for a plain sync call while the lane is open, else issues the backend call with the
op's pre-hook arguments through ``CommCore._issue``.  The ``@op(...)`` above it declares
what the signature cannot say (see the package docstring); everything else per op is
derived from that declaration.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchcomms.optable import checks, hook_args
from torchcomms.optable.spec import (
    INT,
    INTS,
    MANY,
    OUT,
    OUTS,
    RED,
    STACKED,
    TENSOR,
    TENSORS,
    OpName,
    Side,
    op,
)

if TYPE_CHECKING:
    from collections.abc import Callable
    from datetime import timedelta

    import torch

    from torchcomms.comm.validation import Checker
    from torchcomms.runtime.work import TorchWork
    from torchcomms.types import ReduceOp


#: Sides and pre-hook orders that differ from the defaults (``op``).
_A2A_IN: Side = ("input_tensor_list", MANY)
_A2A_OUT: Side = ("output_tensor_list", MANY)
_A2AV_HOOK = ("input", "output", "input_split_sizes", "output_split_sizes")
_SCATTER_HOOK = ("output_tensor", "input_tensor_list", "root")


class OpMethods:
    """The ops of a ``TorchComm`` (see the module docstring); ``CommCore`` supplies the rest."""

    if TYPE_CHECKING:  # what the bodies use of ``CommCore``, which comes first in the MRO
        _backend: Any
        _lane: Any

        def _checker(self, op: str) -> Checker: ...

        def _sync(
            self,
            name: OpName,
            tensor: Any,
            peer: int,
            call: Callable[..., TorchWork],
            call_args: tuple[Any, ...],
        ) -> TorchWork: ...

        def _issue(
            self,
            name: OpName,
            pre_args: Any,
            timeout: timedelta | None,
            hints: dict[str, str] | None,
            call: Callable[..., TorchWork],
            call_args: tuple[Any, ...],
            post_args: Callable[[TorchWork], Any] | None = None,
        ) -> TorchWork: ...

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
        c = self._checker("send")
        checks.check_send(c, tensor, dst)
        if async_op is False and hints is None and timeout is None and self._lane is not None:
            return self._sync(OpName.send, tensor, dst, self._backend.send, (tensor, dst, False))
        c.async_op(async_op)
        pre = hook_args.SendPreHookArgs(tensor, dst, async_op)
        return self._issue(
            OpName.send, pre, timeout, hints, self._backend.send, (tensor, dst, async_op)
        )

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
        c = self._checker("recv")
        checks.check_recv(c, tensor, src)
        if async_op is False and hints is None and timeout is None and self._lane is not None:
            return self._sync(OpName.recv, tensor, src, self._backend.recv, (tensor, src, False))
        c.async_op(async_op)
        pre = hook_args.RecvPreHookArgs(tensor, src, async_op)
        return self._issue(
            OpName.recv, pre, timeout, hints, self._backend.recv, (tensor, src, async_op)
        )

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
        c = self._checker("broadcast")
        checks.check_broadcast(c, tensor, root)
        if async_op is False and hints is None and timeout is None and self._lane is not None:
            return self._sync(
                OpName.broadcast, tensor, -1, self._backend.broadcast, (tensor, root, False)
            )
        c.async_op(async_op)
        pre = hook_args.BroadcastPreHookArgs(tensor, root, async_op)
        return self._issue(
            OpName.broadcast, pre, timeout, hints, self._backend.broadcast, (tensor, root, async_op)
        )

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
        c = self._checker("all_reduce")
        checks.check_all_reduce(c, tensor, op)
        if async_op is False and hints is None and timeout is None and self._lane is not None:
            return self._sync(
                OpName.all_reduce, tensor, -1, self._backend.all_reduce, (tensor, op, False)
            )
        c.async_op(async_op)
        pre = hook_args.AllReducePreHookArgs(tensor, async_op)
        return self._issue(
            OpName.all_reduce, pre, timeout, hints, self._backend.all_reduce, (tensor, op, async_op)
        )

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
        c = self._checker("reduce")
        checks.check_reduce(c, tensor, root, op)
        if async_op is False and hints is None and timeout is None and self._lane is not None:
            return self._sync(
                OpName.reduce, tensor, -1, self._backend.reduce, (tensor, root, op, False)
            )
        c.async_op(async_op)
        pre = hook_args.ReducePreHookArgs(tensor, root, async_op)
        return self._issue(
            OpName.reduce, pre, timeout, hints, self._backend.reduce, (tensor, root, op, async_op)
        )

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
        c = self._checker("all_gather")
        checks.check_all_gather(c, tensor_list, tensor)
        c.async_op(async_op)
        pre = hook_args.AllGatherPreHookArgs(tensor, tensor_list, async_op)
        return self._issue(
            OpName.all_gather,
            pre,
            timeout,
            hints,
            self._backend.all_gather,
            (tensor_list, tensor, async_op),
        )

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
        c = self._checker("all_gather_v")
        checks.check_all_gather_v(c, tensor_list, tensor)
        c.async_op(async_op)
        pre = hook_args.AllGatherVPreHookArgs(tensor, tensor_list, async_op)
        return self._issue(
            OpName.all_gather_v,
            pre,
            timeout,
            hints,
            self._backend.all_gather_v,
            (tensor_list, tensor, async_op),
        )

    @op(OUT, TENSOR, inputs="input", outputs="output", hot=True)
    def all_gather_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        """``output`` becomes every rank's ``input``, concatenated in rank order."""
        c = self._checker("all_gather_single")
        checks.check_all_gather_single(c, output, input)
        if async_op is False and hints is None and timeout is None and self._lane is not None:
            return self._sync(
                OpName.all_gather_single,
                (input, output),
                -1,
                self._backend.all_gather_single,
                (output, input, False),
            )
        c.async_op(async_op)
        pre = hook_args.AllGatherSinglePreHookArgs(input, output, async_op)
        return self._issue(
            OpName.all_gather_single,
            pre,
            timeout,
            hints,
            self._backend.all_gather_single,
            (output, input, async_op),
        )

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
        c = self._checker("reduce_scatter")
        checks.check_reduce_scatter(c, output, input_list, op)
        c.async_op(async_op)
        pre = hook_args.ReduceScatterPreHookArgs(input_list, output, async_op)
        return self._issue(
            OpName.reduce_scatter,
            pre,
            timeout,
            hints,
            self._backend.reduce_scatter,
            (output, input_list, op, async_op),
        )

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
        c = self._checker("reduce_scatter_v")
        checks.check_reduce_scatter_v(c, output, input_list, op)
        c.async_op(async_op)
        pre = hook_args.ReduceScatterVPreHookArgs(input_list, output, async_op)
        return self._issue(
            OpName.reduce_scatter_v,
            pre,
            timeout,
            hints,
            self._backend.reduce_scatter_v,
            (output, input_list, op, async_op),
        )

    @op(OUT, TENSOR, RED, inputs="input", outputs="output", key="output", hot=True)
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
        c = self._checker("reduce_scatter_single")
        checks.check_reduce_scatter_single(c, output, input, op)
        if async_op is False and hints is None and timeout is None and self._lane is not None:
            return self._sync(
                OpName.reduce_scatter_single,
                (input, output),
                -1,
                self._backend.reduce_scatter_single,
                (output, input, op, False),
            )
        c.async_op(async_op)
        pre = hook_args.ReduceScatterSinglePreHookArgs(input, output, async_op)
        return self._issue(
            OpName.reduce_scatter_single,
            pre,
            timeout,
            hints,
            self._backend.reduce_scatter_single,
            (output, input, op, async_op),
        )

    @op(OUT, TENSOR, inputs="input", outputs="output", hot=True)
    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        """Chunk r of ``input`` goes to rank r; chunk r of ``output`` comes from rank r."""
        c = self._checker("all_to_all_single")
        checks.check_all_to_all_single(c, output, input)
        if async_op is False and hints is None and timeout is None and self._lane is not None:
            return self._sync(
                OpName.all_to_all_single,
                (input, output),
                -1,
                self._backend.all_to_all_single,
                (output, input, False),
            )
        c.async_op(async_op)
        pre = hook_args.AllToAllSinglePreHookArgs(input, output, async_op)
        return self._issue(
            OpName.all_to_all_single,
            pre,
            timeout,
            hints,
            self._backend.all_to_all_single,
            (output, input, async_op),
        )

    @op(
        OUT,
        TENSOR,
        INTS,
        INTS,
        inputs="input",
        outputs="output",
        hook=_A2AV_HOOK,
        normalizes=True,
        varying=True,
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
        """As ``all_to_all_single``, with rows per peer given by the split sizes."""
        c = self._checker("all_to_all_v_single")
        output, input, output_split_sizes, input_split_sizes = checks.check_all_to_all_v_single(
            c, output, input, output_split_sizes, input_split_sizes
        )
        c.async_op(async_op)
        pre = hook_args.AllToAllVSinglePreHookArgs(
            input, output, input_split_sizes, output_split_sizes, async_op
        )
        return self._issue(
            OpName.all_to_all_v_single,
            pre,
            timeout,
            hints,
            self._backend.all_to_all_v_single,
            (output, input, output_split_sizes, input_split_sizes, async_op),
        )

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
        c = self._checker("all_to_all")
        checks.check_all_to_all(c, output_tensor_list, input_tensor_list)
        c.async_op(async_op)
        pre = hook_args.AllToAllPreHookArgs(input_tensor_list, output_tensor_list, async_op)
        return self._issue(
            OpName.all_to_all,
            pre,
            timeout,
            hints,
            self._backend.all_to_all,
            (output_tensor_list, input_tensor_list, async_op),
        )

    @op(inputs=None, outputs=None, hot=True)
    def barrier(
        self,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        """Returns once every rank entered it."""
        c = self._checker("barrier")
        checks.check_barrier(c)
        if async_op is False and hints is None and timeout is None and self._lane is not None:
            return self._sync(OpName.barrier, None, -1, self._backend.barrier, (False,))
        c.async_op(async_op)
        pre = hook_args.BarrierPreHookArgs(async_op)
        return self._issue(OpName.barrier, pre, timeout, hints, self._backend.barrier, (async_op,))

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
        c = self._checker("scatter")
        checks.check_scatter(c, output_tensor, input_tensor_list, root)
        c.async_op(async_op)
        pre = hook_args.ScatterPreHookArgs(output_tensor, input_tensor_list, root, async_op)
        return self._issue(
            OpName.scatter,
            pre,
            timeout,
            hints,
            self._backend.scatter,
            (output_tensor, input_tensor_list, root, async_op),
        )

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
        c = self._checker("gather")
        checks.check_gather(c, output_tensor_list, input_tensor, root)
        c.async_op(async_op)
        pre = hook_args.GatherPreHookArgs(input_tensor, output_tensor_list, root, async_op)
        return self._issue(
            OpName.gather,
            pre,
            timeout,
            hints,
            self._backend.gather,
            (output_tensor_list, input_tensor, root, async_op),
        )

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
        c = self._checker("gather_single")
        checks.check_gather_single(c, output, input, root)
        c.async_op(async_op)
        pre = hook_args.GatherSinglePreHookArgs(input, output, root, async_op)
        return self._issue(
            OpName.gather_single,
            pre,
            timeout,
            hints,
            self._backend.gather_single,
            (output, input, root, async_op),
        )
