"""``TorchCommBackend``: the interface a backend implements, for built-in and plug-in backends.

Two calling conventions exist, chosen by the class attribute ``_native``:

* plug-in backends (``_native = False``, upstream's Python trampoline): collectives are
  called with exactly the positional arguments listed in the reference (no hints, no
  timeout) and return ``None`` (completed) or an object with ``wait()``;
* built-in backends (``_native = True``): every collective also gets an ``OpOptions``
  (resolved timeout and hints) as its last argument and returns a ``TorchWork``.

Either way ``TorchComm`` validates arguments first, so backends may assume valid input.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from torchcomms.types import CommOptions


def _pure_virtual(method: str) -> RuntimeError:
    return RuntimeError(f'Tried to call pure virtual function "TorchCommBackend::{method}"')


class TorchCommBackend:
    """Base class of every backend; subclass it and call ``super().__init__()``."""

    _native = False
    # Upstream's TorchComm only range-checks peers; a backend that cannot talk to itself
    # (gloo: "Cannot send to self") sets this to False.
    _self_p2p_allowed = True

    def __init__(self) -> None:
        self._device: torch.device | None = None
        self._options: CommOptions = CommOptions()

    # -- lifecycle (required) ----------------------------------------------------------------
    def init(self, device: torch.device, name: str, options: CommOptions) -> None:
        raise _pure_virtual("init")

    def finalize(self) -> None:
        raise _pure_virtual("finalize")

    def get_rank(self) -> int:
        raise _pure_virtual("getRank")

    def get_size(self) -> int:
        raise _pure_virtual("getSize")

    def get_backend_name(self) -> str:
        raise _pure_virtual("getBackendName")

    def get_comm_name(self) -> str:
        raise _pure_virtual("getCommName")

    def split(self, ranks: list[int], name: str, options: CommOptions) -> TorchCommBackend:
        raise _pure_virtual("split")

    # -- optional, with upstream's default errors ---------------------------------------------
    def get_backend_version(self) -> str:
        raise RuntimeError("[TorchCommBackend]: getBackendVersion not implemented")

    def set_timeout(self, timeout: timedelta) -> None:
        raise RuntimeError("[TorchCommBackend]: setTimeout not implemented")

    def set_hints(self, hints: dict[str, str]) -> None:
        raise RuntimeError("[TorchCommBackend]: setHints not implemented")

    def abort(self) -> None:
        raise RuntimeError(
            f"[TorchCommBackend]: abort not implemented for communicator:{self._safe_name()}"
        )

    def is_abort_supported(self) -> bool:
        return False

    def is_aborted(self) -> bool:
        return False

    def supports_reconfigure(self) -> bool:
        return False

    def get_init_handle(self) -> str:
        raise RuntimeError(
            "[TorchCommBackend]: getInitHandle not implemented for communicator:"
            f"{self._safe_name()}"
        )

    def reconfigure(self, uuid: int, init_handles: Any, timeout: Any, hints: Any) -> Any:
        raise RuntimeError(
            f"[TorchCommBackend]: reconfigure not implemented for communicator:{self._safe_name()}"
        )

    def new_window(self, tensor: torch.Tensor | None = None) -> Any:
        raise RuntimeError(f"new_window not implemented for communicator:{self._safe_name()}")

    def tensor_register(self, tensor: torch.Tensor) -> None:
        raise RuntimeError(f"tensor_register not implemented for communicator:{self._safe_name()}")

    def tensor_deregister(self, tensor: torch.Tensor) -> None:
        raise RuntimeError(
            f"tensor_deregister not implemented for communicator:{self._safe_name()}"
        )

    def supported_dtypes(self) -> frozenset[torch.dtype] | None:
        """The dtypes this backend moves; ``None`` means "no restriction known"."""
        return None

    def _safe_name(self) -> str:
        try:
            return self.get_comm_name()
        except RuntimeError:
            return "<unnamed>"

    # -- collectives (plug-in convention; see the module docstring) ----------------------------
    def send(self, tensor: torch.Tensor, dst: int, async_op: bool) -> Any:
        raise _pure_virtual("send")

    def recv(self, tensor: torch.Tensor, src: int, async_op: bool) -> Any:
        raise _pure_virtual("recv")

    def broadcast(self, tensor: torch.Tensor, root: int, async_op: bool) -> Any:
        raise _pure_virtual("broadcast")

    def all_reduce(self, tensor: torch.Tensor, op: Any, async_op: bool) -> Any:
        raise _pure_virtual("all_reduce")

    def reduce(self, tensor: torch.Tensor, root: int, op: Any, async_op: bool) -> Any:
        raise _pure_virtual("reduce")

    def all_gather(
        self, tensor_list: list[torch.Tensor], tensor: torch.Tensor, async_op: bool
    ) -> Any:
        raise _pure_virtual("all_gather")

    def all_gather_v(
        self, tensor_list: list[torch.Tensor], tensor: torch.Tensor, async_op: bool
    ) -> Any:
        raise _pure_virtual("all_gather_v")

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, async_op: bool) -> Any:
        raise _pure_virtual("all_gather_single")

    def reduce_scatter(
        self, output: torch.Tensor, input_list: list[torch.Tensor], op: Any, async_op: bool
    ) -> Any:
        raise _pure_virtual("reduce_scatter")

    def reduce_scatter_v(
        self, output: torch.Tensor, input_list: list[torch.Tensor], op: Any, async_op: bool
    ) -> Any:
        raise _pure_virtual("reduce_scatter_v")

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, op: Any, async_op: bool
    ) -> Any:
        raise _pure_virtual("reduce_scatter_single")

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, async_op: bool) -> Any:
        raise _pure_virtual("all_to_all_single")

    def all_to_all_v_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        async_op: bool,
    ) -> Any:
        raise _pure_virtual("all_to_all_v_single")

    def all_to_all(
        self,
        output_tensor_list: list[torch.Tensor],
        input_tensor_list: list[torch.Tensor],
        async_op: bool,
    ) -> Any:
        raise _pure_virtual("all_to_all")

    def barrier(self, async_op: bool) -> Any:
        raise _pure_virtual("barrier")

    def scatter(
        self,
        output_tensor: torch.Tensor,
        input_tensor_list: list[torch.Tensor],
        root: int,
        async_op: bool,
    ) -> Any:
        raise _pure_virtual("scatter")

    def gather(
        self,
        output_tensor_list: list[torch.Tensor],
        input_tensor: torch.Tensor,
        root: int,
        async_op: bool,
    ) -> Any:
        raise _pure_virtual("gather")
