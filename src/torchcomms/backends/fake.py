"""The ``fake`` backend: a size-1 communicator whose ops do nothing, for unit tests of the API layer."""

# Native backends take an extra OpOptions argument (see backends/base.py), on purpose.
# mypy: disable-error-code="override"

from __future__ import annotations

from typing import Any

import torch

from torchcomms.backends.base import TorchCommBackend
from torchcomms.types import CommOptions, OpOptions, P2POp
from torchcomms.work import CompletedWork, TorchWork


class TorchCommFake(TorchCommBackend):
    """Rank 0 of 1; every op returns a completed work without touching data."""

    _native = True

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


_COLLECTIVES = frozenset(
    {
        "broadcast",
        "all_reduce",
        "reduce",
        "all_gather",
        "all_gather_v",
        "all_gather_single",
        "reduce_scatter",
        "reduce_scatter_v",
        "reduce_scatter_single",
        "all_to_all_single",
        "all_to_all_v_single",
        "all_to_all",
        "barrier",
        "scatter",
        "gather",
        "gather_single",
    }
)


def _no_op(op: str) -> Any:
    def run(self: TorchCommFake, *args: Any) -> TorchWork:
        return self._done(op, args[-1])

    run.__name__ = op
    run.__doc__ = f"{op}: does nothing, returns a completed work."
    return run


# Every collective has the shape (…, async_op, options) -> work; one no-op serves all.
for _op in _COLLECTIVES:
    setattr(TorchCommFake, _op, _no_op(_op))
