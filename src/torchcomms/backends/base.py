"""``TorchCommBackend``: upstream's base class of every backend, and what plug-ins subclass.

A Python plug-in (``register_backend``) subclasses it as upstream's trampoline expects:
collectives are called with exactly the positional arguments listed in the reference
(no hints, no timeout) and return ``None`` (completed) or an object with ``wait()``; a
method it does not override raises upstream's "pure virtual" error.  ``new_comm`` wraps
such a plug-in once in a ``PluginBackend`` (``backends.plugin``), so ``TorchComm`` only
ever calls the one typed interface ``CommBackend`` (``backends.contract``), which the
built-in backends implement directly.

``TorchComm`` validates arguments first, so backends may assume valid input.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from torchcomms import optable
from torchcomms.errors import BackendNotImplementedError
from torchcomms.types import CommOptions


def _pure_virtual(method: str) -> BackendNotImplementedError:
    return BackendNotImplementedError(
        f'Tried to call pure virtual function "TorchCommBackend::{method}"'
    )


class TorchCommBackend:
    """Base class of every backend; subclass it and call ``super().__init__()``."""

    def __init__(self) -> None:
        self._device: torch.device | None = None
        self._options: CommOptions = CommOptions()

    def _set_device_and_options(self, device: torch.device, options: CommOptions) -> None:
        """What ``new_comm`` records before ``init`` (upstream's trampoline does the same)."""
        self._device = device
        self._options = options

    def get_device(self) -> torch.device | None:
        return self._device

    def get_options(self) -> CommOptions:
        return self._options

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

    def revoke(self) -> None:
        raise RuntimeError(
            f"[TorchCommBackend]: revoke not implemented for communicator:{self._safe_name()}"
        )

    def shrink(
        self, exclude: list[int] | None, name: str, options: CommOptions
    ) -> tuple[Any, list[int]]:
        """A communicator of the members not excluded and not failed, and their ranks here."""
        raise RuntimeError(
            f"[TorchCommBackend]: shrink not implemented for communicator:{self._safe_name()}"
        )

    def new_window(self, tensor: torch.Tensor | None = None) -> Any:
        raise RuntimeError(f"new_window not implemented for communicator:{self._safe_name()}")

    def tensor_register(self, tensor: torch.Tensor) -> None:
        raise RuntimeError(f"tensor_register not implemented for communicator:{self._safe_name()}")

    def tensor_deregister(self, tensor: torch.Tensor) -> None:
        raise RuntimeError(
            f"tensor_deregister not implemented for communicator:{self._safe_name()}"
        )

    # -- persistent all-gather (upstream: ncclx/rcclx only; the CPU backend has it too) ------
    def all_gather_p_init(self, output: torch.Tensor, options: Any) -> Any:
        """Register ``output`` for persistent all-gathers; returns the backend's registration."""
        raise self._not_implemented("all_gather_p_init")

    def all_gather_p_exec(
        self, registration: Any, input: torch.Tensor, async_op: bool, options: Any
    ) -> Any:
        """Gather every rank's ``input`` into the registered output."""
        raise self._not_implemented("all_gather_p_exec")

    def all_gather_p_free(self, registration: Any) -> None:
        """Release a registration (local)."""
        raise self._not_implemented("all_gather_p_free")

    def get_device_transport(self) -> int:
        """A device pointer to a GPU transport handle (pipes, for Triton kernels)."""
        raise BackendNotImplementedError(
            "[TorchCommBackend]: get_device_transport not implemented for communicator:"
            f"{self._safe_name()} (a device transport is a GPU-resident handle for Triton "
            "kernels; this backend has none)"
        )

    def gather_single(
        self, output: torch.Tensor, input: torch.Tensor, root: int, async_op: bool
    ) -> Any:
        """Upstream's default: the root views its output as comm_size chunks and gathers."""
        outs = list(output.view(-1).chunk(self.get_size())) if self.get_rank() == root else []
        gather = getattr(self, optable.OpName.gather.name)  # a plug-in's, or the refusal
        return gather(outs, input, root, async_op)

    def _not_implemented(self, method: str) -> BackendNotImplementedError:
        return BackendNotImplementedError(
            f"[TorchCommBackend]: {method} not implemented for communicator:{self._safe_name()}"
        )

    def _safe_name(self) -> str:
        try:
            return self.get_comm_name()
        except RuntimeError:
            return "<unnamed>"


def _pure_virtual_op(entry: optable.Op) -> Callable[..., Any]:
    """Upstream's plug-in convention for one op: ``method(*its arguments, async_op)``,
    refused until the plug-in defines it."""

    def op(self: TorchCommBackend, *args: Any, **kwargs: Any) -> Any:
        raise _pure_virtual(entry.method)

    op.__name__ = entry.method
    op.__doc__ = f"``{entry.method}({', '.join([*entry.names, 'async_op'])})``"
    return op


for _entry in optable.OPS:
    if _entry.method not in vars(TorchCommBackend):  # upstream's defaults stay
        setattr(TorchCommBackend, _entry.method, _pure_virtual_op(_entry))
