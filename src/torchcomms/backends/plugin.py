"""``PluginBackend``: a plug-in written to upstream's calling convention, as a ``CommBackend``.

``new_comm`` wraps a ``TorchCommBackend`` that is not a ``CommBackend`` in one of these,
once.  Each op drops the ``OpOptions`` (upstream passes plug-ins no hints and no
timeout), calls the plug-in with the reference's positional arguments, and turns its
result (``None`` or an object with ``wait()``) into a ``TorchWork``.  A plug-in without
its own ``gather_single`` gets upstream's default (``TorchCommBackend``'s, composed from
``gather``); ``batch_op_issue`` is refused with upstream's error.

Failures: an exception the plug-in raises from an op, or from its work's ``wait()``,
moves the communicator to its error state (later ops fail fast quoting it), except a
method the plug-in does not implement (upstream's "pure virtual" error), which leaves
the comm as it was.  Runs on the caller's thread (plug-ins own their concurrency).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from torchcomms import optable
from torchcomms.backends.base import TorchCommBackend
from torchcomms.backends.contract import CommBackend, fill_ops
from torchcomms.errors import BackendNotImplementedError, CommError
from torchcomms.runtime.work import PythonBackendWork, TorchWork, completed_python_work
from torchcomms.types import CommOptions, OpOptions, P2POp

BATCH_UNSUPPORTED = "[PyTorchCommBackend]: batch_op_issue not implemented for Python backends"


def _forwarded(entry: optable.Op) -> Callable[..., TorchWork]:
    """The plug-in's method of the op, with the op's arguments and ``async_op``."""
    method = entry.method

    def forward(self: PluginBackend, *args: Any) -> TorchWork:
        call = getattr(self.plugin, method)
        return self._call(lambda: call(*args[:-1]))

    forward.__name__ = method
    return forward


@fill_ops(_forwarded)
class PluginBackend(CommBackend):
    """Adapts one plug-in instance (see the module docstring)."""

    def __init__(self, plugin: TorchCommBackend) -> None:
        super().__init__()
        self.plugin = plugin

    def backend_object(self) -> TorchCommBackend:
        return self.plugin

    # -- lifecycle and getters: straight through -------------------------------------------
    def init(self, device: torch.device, name: str, options: CommOptions) -> None:
        self.plugin.init(device, name, options)

    def finalize(self) -> None:
        self.plugin.finalize()

    def get_rank(self) -> int:
        return self.plugin.get_rank()

    def get_size(self) -> int:
        return self.plugin.get_size()

    def get_backend_name(self) -> str:
        return self.plugin.get_backend_name()

    def get_comm_name(self) -> str:
        return self.plugin.get_comm_name()

    def get_backend_version(self) -> str:
        return self.plugin.get_backend_version()

    def set_timeout(self, timeout: timedelta) -> None:
        self.plugin.set_timeout(timeout)

    def set_hints(self, hints: dict[str, str]) -> None:
        self.plugin.set_hints(hints)

    def abort(self) -> None:
        self.plugin.abort()

    def is_abort_supported(self) -> bool:
        return self.plugin.is_abort_supported()

    def check_device(self, device: torch.device) -> None:
        """A plug-in decides for itself which devices it serves (in its ``init``)."""

    def is_aborted(self) -> bool:
        return self.plugin.is_aborted()

    def supports_reconfigure(self) -> bool:
        return self.plugin.supports_reconfigure()

    def get_init_handle(self) -> str:
        return self.plugin.get_init_handle()

    def reconfigure(self, uuid: int, init_handles: Any, timeout: Any, hints: Any) -> Any:
        return self.plugin.reconfigure(uuid, init_handles, timeout, hints)

    def revoke(self) -> None:
        self.plugin.revoke()

    def shrink(
        self, exclude: list[int] | None, name: str, options: CommOptions
    ) -> tuple[CommBackend, list[int]]:
        child, members = self.plugin.shrink(exclude, name, options)
        where = f"{type(self.plugin).__name__}.shrink returned an object whose"
        return adapt(child, where), list(members)

    def new_window(self, tensor: torch.Tensor | None = None) -> Any:
        return self.plugin.new_window(tensor)

    def tensor_register(self, tensor: torch.Tensor) -> None:
        self.plugin.tensor_register(tensor)

    def tensor_deregister(self, tensor: torch.Tensor) -> None:
        self.plugin.tensor_deregister(tensor)

    def split(self, ranks: list[int], name: str, options: CommOptions) -> CommBackend:
        child = self.plugin.split(ranks, name, options)
        return adapt(child, f"{type(self.plugin).__name__}.split returned an object whose")

    # -- operations ------------------------------------------------------------------------
    def _call(self, call: Callable[[], Any]) -> TorchWork:
        try:
            result = call()
        except BackendNotImplementedError:
            raise
        except BaseException as exc:
            self._failed(exc)
            raise
        return as_work(result, self._failed)

    def _failed(self, exc: BaseException) -> None:
        if isinstance(exc, Exception):
            cause = exc if isinstance(exc, CommError) else CommError(f"{type(exc).__name__}: {exc}")
            self.report_failure(cause)

    def batch_op_issue(self, ops: list[P2POp], async_op: bool, options: OpOptions) -> TorchWork:
        raise RuntimeError(BATCH_UNSUPPORTED)


def as_work(result: Any, on_error: Callable[[BaseException], None] | None = None) -> TorchWork:
    """A plug-in's op result (``None`` or an object with ``wait()``) as a ``TorchWork``."""
    if result is None:
        return completed_python_work()
    if isinstance(result, TorchWork):
        return result
    if not callable(getattr(result, "wait", None)):
        raise TypeError(
            "a Python backend op must return None or an object with wait(), "
            f"got {type(result).__name__}"
        )
    return PythonBackendWork(result, on_error=on_error)


def adapt(backend: object, what: str) -> CommBackend:
    """The ``CommBackend`` that ``TorchComm`` calls for ``backend`` (itself, or an adapter).

    ``what`` names it in the error when it is no backend at all (``backend 'x'``).
    """
    if isinstance(backend, CommBackend):
        return backend
    if not isinstance(backend, TorchCommBackend):
        raise TypeError(f"{what} class {type(backend).__name__} must subclass TorchCommBackend")
    return PluginBackend(backend)
