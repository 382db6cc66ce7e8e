"""The ``fake`` backend: a size-1 communicator whose ops do nothing, for unit tests of the API layer."""

from __future__ import annotations

from typing import Any

import torch

from torchcomms.backends.contract import CommBackend
from torchcomms.types import CommOptions, OpOptions, P2POp, ReduceOp
from torchcomms.work import CompletedWork, TorchWork


class TorchCommFake(CommBackend):
    """Rank 0 of 1; every op returns a completed work without touching data."""

    def __init__(self) -> None:
        super().__init__()
        self._name = ""
        self.last_op: tuple[str, OpOptions] | None = None

    def init(self, device: torch.device, name: str, options: CommOptions) -> None:
        self._device = device
        self._name = name
        self._options = options

    def finalize(self) -> None:
        pass

    def get_rank(self) -> int:
        return 0

    def get_size(self) -> int:
        return 1

    def get_backend_name(self) -> str:
        return "fake"

    def get_comm_name(self) -> str:
        return self._name

    def get_backend_version(self) -> str:
        return "fake"

    def supports_reconfigure(self) -> bool:
        return True

    def abort(self) -> None:
        pass

    def check_device(self, device: torch.device) -> None:
        """Any device: the fake backend never touches data."""

    def set_timeout(self, timeout: Any) -> None:
        self._options.timeout = timeout

    def set_hints(self, hints: dict[str, str]) -> None:
        self._options.hints.update(hints)

    def get_init_handle(self) -> str:
        return f"fake:0:{self._name}"

    def reconfigure(self, uuid: int, init_handles: Any, timeout: Any, hints: Any) -> TorchWork:
        return CompletedWork()

    def split(self, ranks: list[int], name: str, options: CommOptions) -> TorchCommFake:
        child = TorchCommFake()
        child.init(self._device or torch.device("cpu"), name, options)
        return child

    def _done(self, op: str, options: OpOptions) -> TorchWork:
        self.last_op = (op, options)
        return CompletedWork()

    def send(self, tensor: torch.Tensor, dst: int, async_op: bool, options: OpOptions) -> TorchWork:
        return self._done("send", options)

    def recv(self, tensor: torch.Tensor, src: int, async_op: bool, options: OpOptions) -> TorchWork:
        return self._done("recv", options)

    def batch_op_issue(self, ops: list[P2POp], async_op: bool, options: OpOptions) -> TorchWork:
        return self._done("batch_op_issue", options)

    def broadcast(
        self, tensor: torch.Tensor, root: int, async_op: bool, options: OpOptions
    ) -> TorchWork:
        return self._done("broadcast", options)

    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp, async_op: bool, options: OpOptions
    ) -> TorchWork:
        return self._done("all_reduce", options)

    def reduce(
        self, tensor: torch.Tensor, root: int, op: ReduceOp, async_op: bool, options: OpOptions
    ) -> TorchWork:
        return self._done("reduce", options)

    def all_gather(
        self,
        tensor_list: list[torch.Tensor],
        tensor: torch.Tensor,
        async_op: bool,
        options: OpOptions,
    ) -> TorchWork:
        return self._done("all_gather", options)

    def all_gather_v(
        self,
        tensor_list: list[torch.Tensor],
        tensor: torch.Tensor,
        async_op: bool,
        options: OpOptions,
    ) -> TorchWork:
        return self._done("all_gather_v", options)

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool, options: OpOptions
    ) -> TorchWork:
        return self._done("all_gather_single", options)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: ReduceOp,
        async_op: bool,
        options: OpOptions,
    ) -> TorchWork:
        return self._done("reduce_scatter", options)

    def reduce_scatter_v(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: ReduceOp,
        async_op: bool,
        options: OpOptions,
    ) -> TorchWork:
        return self._done("reduce_scatter_v", options)

    def reduce_scatter_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp,
        async_op: bool,
        options: OpOptions,
    ) -> TorchWork:
        return self._done("reduce_scatter_single", options)

    def all_to_all_single(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool, options: OpOptions
    ) -> TorchWork:
        return self._done("all_to_all_single", options)

    def all_to_all_v_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        async_op: bool,
        options: OpOptions,
    ) -> TorchWork:
        return self._done("all_to_all_v_single", options)

    def all_to_all(
        self,
        output_tensor_list: list[torch.Tensor],
        input_tensor_list: list[torch.Tensor],
        async_op: bool,
        options: OpOptions,
    ) -> TorchWork:
        return self._done("all_to_all", options)

    def barrier(self, async_op: bool, options: OpOptions) -> TorchWork:
        return self._done("barrier", options)

    def scatter(
        self,
        output_tensor: torch.Tensor,
        input_tensor_list: list[torch.Tensor],
        root: int,
        async_op: bool,
        options: OpOptions,
    ) -> TorchWork:
        return self._done("scatter", options)

    def gather(
        self,
        output_tensor_list: list[torch.Tensor],
        input_tensor: torch.Tensor,
        root: int,
        async_op: bool,
        options: OpOptions,
    ) -> TorchWork:
        return self._done("gather", options)

    def gather_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        root: int,
        async_op: bool,
        options: OpOptions,
    ) -> TorchWork:
        return self._done("gather_single", options)
