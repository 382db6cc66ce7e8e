"""The ``fake`` backend: a size-1 communicator whose ops do nothing, for unit tests of the API layer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchcomms import optable
from torchcomms.backends.contract import CommBackend, fill_ops
from torchcomms.runtime.work import CompletedWork, TorchWork
from torchcomms.types import CommOptions, OpOptions, P2POp


def _no_op(entry: optable.Op) -> Callable[..., TorchWork]:
    """An op that records its name and options and touches nothing."""
    method = entry.method

    def done(self: TorchCommFake, *args: Any) -> TorchWork:
        return self._done(method, args[-1])

    done.__name__ = method
    return done


@fill_ops(_no_op)
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

    def batch_op_issue(self, ops: list[P2POp], async_op: bool, options: OpOptions) -> TorchWork:
        return self._done("batch_op_issue", options)
