"""``WindowBackend``: what ``TorchCommWindow`` asks of a backend's window implementation.

``TorchCommWindow`` (``torchcomms.comm.window``) validates every argument (ranks, offsets,
sizes, dtypes, registration state) against ``meta`` first, so an implementation may
assume valid input.  Every op takes ``async_op`` and an ``OpOptions`` (resolved timeout,
hints, op name) and returns a ``TorchWork``; a backend runs them in the communicator's
issue order, as its collectives.  ``CommBackend.new_window`` returns one of these for a
backend that has windows.
"""

from __future__ import annotations

import abc

import torch

from torchcomms.runtime.work import TorchWork
from torchcomms.types import OpOptions, TorchCommWinAccessType


class WindowBackend(abc.ABC):
    """One window of one communicator, as the backend implements it."""

    @abc.abstractmethod
    def register(self, tensor: torch.Tensor, owning: bool, options: OpOptions) -> torch.Tensor:
        """Collective: make ``tensor`` this rank's window; returns the window's own buffer."""

    @abc.abstractmethod
    def deregister(self, options: OpOptions) -> None:
        """Collective: release the registration (every peer's ops to this rank are done)."""

    @abc.abstractmethod
    def meta(self, rank: int) -> tuple[torch.dtype, tuple[int, ...]]:
        """``rank``'s registered dtype and shape (known since ``register``)."""

    @abc.abstractmethod
    def access_type(self, rank: int) -> TorchCommWinAccessType: ...

    @abc.abstractmethod
    def remote_tensor(self, rank: int) -> torch.Tensor:
        """A writable view of a same-host ``rank``'s buffer (UNIFIED peers only)."""

    @abc.abstractmethod
    def put(
        self, tensor: torch.Tensor, dst: int, offset: int, async_op: bool, options: OpOptions
    ) -> TorchWork: ...

    @abc.abstractmethod
    def get(
        self, tensor: torch.Tensor, src: int, offset: int, async_op: bool, options: OpOptions
    ) -> TorchWork: ...

    @abc.abstractmethod
    def signal(self, peer: int, async_op: bool, options: OpOptions) -> TorchWork: ...

    @abc.abstractmethod
    def wait_signal(self, peer: int, async_op: bool, options: OpOptions) -> TorchWork: ...
