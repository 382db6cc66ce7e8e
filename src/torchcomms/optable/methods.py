"""The declarations: every op of a ``TorchComm`` as its typed signature under ``@op``.

The bodies never run: ``comm_ops`` generates each method from its entry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
    Side,
    declared,
    op,
)

if TYPE_CHECKING:
    from datetime import timedelta

    import torch

    from torchcomms.runtime.work import TorchWork
    from torchcomms.types import ReduceOp


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
        declared()

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
        declared()

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
        declared()

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
        declared()

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
        declared()

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
        declared()

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
        declared()

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
        declared()

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
        declared()

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
        declared()

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
        declared()

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
        declared()

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
        declared()

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
        declared()

    @op(inputs=None, outputs=None, hot=True)
    def barrier(
        self,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        """Returns once every rank entered it."""
        declared()

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
        declared()

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
        declared()

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
        declared()
