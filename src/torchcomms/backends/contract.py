"""``CommBackend``: the one typed interface ``TorchComm`` calls, for every backend.

Built-in backends (``gloo``, ``fake``) subclass it directly; a plug-in written to
upstream's calling convention (``TorchCommBackend``) is wrapped once, in ``new_comm``,
by ``backends.plugin.PluginBackend``.  Every op takes the API's arguments (validated by
``TorchComm``), then ``async_op`` and an ``OpOptions`` (resolved timeout, hints, op
name and id), and returns a ``TorchWork``.

Failure state lives in ``TorchComm`` (``torchcomms.runtime.state``): it hands the backend its
``CommStatus`` (``bind_status``) before the first op.  A backend reports a failure with
one call, ``report_failure(error)``; from then on ``TorchComm`` refuses new ops with the
original cause, and a backend with queued async ops refuses those with ``check_usable``.
The status's ``failure_listener`` (``TorchComm``'s) then learns of it, once.

``check_device`` is called by ``new_comm`` before ``init``: a device the backend cannot
serve is refused there, not at the first op.  ``abort`` (when ``is_abort_supported``)
must be local and prompt, callable from any thread, and leave the status ``aborted``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TypeVar

import torch
from torch._C import _distributed_c10d as c10d

from torchcomms import optable
from torchcomms.backends.base import TorchCommBackend
from torchcomms.errors import CommError, CommValidationError
from torchcomms.runtime.state import CommStatus
from torchcomms.runtime.work import TorchWork
from torchcomms.types import CommOptions, OpOptions, P2POp

#: Called once, with the first failure, after the comm moved to its error state
#: (``CommStatus.failure_listener``).
FailureListener = Callable[[CommError], None]


class CommBackend(TorchCommBackend, abc.ABC):
    """A backend as ``TorchComm`` calls it (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._status = CommStatus()  # replaced by the owning TorchComm's, see bind_status

    # -- what TorchComm needs besides the ops ----------------------------------------------
    def bind_status(self, status: CommStatus) -> None:
        """Share the owning communicator's state machine (called once, before any op)."""
        self._status = status

    @property
    def status(self) -> CommStatus:
        return self._status

    def report_failure(self, error: CommError) -> CommError:
        """Move the comm to its error state (the first report wins); returns ``error``."""
        status = self._status
        if status.fail(error):
            self.on_failure(error)
            listener = status.failure_listener
            if listener is not None:
                listener(error)
        return error

    def on_failure(self, error: CommError) -> None:
        """Runs once, on the reporting thread, after the first failure (e.g. tell the peers)."""

    def check_usable(self, prefix: str) -> None:
        """Raise the state error (with the original cause) unless ops may run."""
        self._status.check(prefix, type(self.backend_object()).__name__)

    def check_device(self, device: torch.device) -> None:
        """Refuse a device this backend cannot serve (raises ``CommValidationError``).

        The default is the host-staging rule of the built-in CPU backend: ``cpu`` always,
        ``cuda`` when CUDA is available (tensors are staged through host memory).
        """
        kind = device.type
        if kind == "cpu":
            return
        if kind == "cuda":
            if not torch.cuda.is_available():
                raise CommValidationError(
                    f"new_comm: device {device} is not available: torch.cuda.is_available() "
                    f"is False (backend {self.get_backend_name()} serves cpu, and cuda when "
                    "CUDA is available)"
                )
            count = torch.cuda.device_count()
            if device.index is not None and device.index >= count:
                raise CommValidationError(
                    f"new_comm: device {device} is not available: this process sees {count} "
                    "CUDA device(s)"
                )
            return
        raise CommValidationError(
            f"new_comm: backend {self.get_backend_name()} cannot serve device {device} "
            "(it serves cpu, and cuda when CUDA is available)"
        )

    def backend_object(self) -> TorchCommBackend:
        """What ``TorchComm.get_backend_impl()`` returns (a plug-in's own instance)."""
        return self

    def members_store(self) -> c10d.Store | None:
        """A store every member reaches (the c10d bridge's monitored barrier runs on it)."""
        return None

    def self_p2p_allowed(self) -> bool:
        """Upstream's TorchComm only range-checks peers; gloo refuses to send to itself."""
        return True

    def supported_dtypes(self) -> frozenset[torch.dtype] | None:
        """The dtypes this backend moves; ``None`` means "no restriction known"."""
        return None

    @abc.abstractmethod
    def split(self, ranks: list[int], name: str, options: CommOptions) -> CommBackend: ...

    def split_outside(self, name: str, options: CommOptions) -> None:
        """This rank is in no group of a ``split`` (it passed ``[]``); nothing by default."""

    # -- operations ------------------------------------------------------------------------
    # Every op of ``optable.OPS`` as ``method(*its arguments, async_op, options) ->
    # TorchWork`` (the arguments ``TorchComm`` validated, in its signature's order), filled
    # in for a backend class by ``fill_ops``; a batch of sends and receives is its own call.
    @abc.abstractmethod
    def batch_op_issue(self, ops: list[P2POp], async_op: bool, options: OpOptions) -> TorchWork: ...


B = TypeVar("B", bound=type)


def fill_ops(make: Callable[[optable.Op], Callable[..., TorchWork]]) -> Callable[[B], B]:
    """Class decorator: give the class every op of the table it does not define itself,
    as ``make(op)`` (a function taking ``self, *arguments, async_op, options``).

    What a backend writes by hand (its fast paths, an op it maps in its own way) stays."""

    def fill(cls: B) -> B:
        own = [k for k in cls.__mro__ if k not in (CommBackend, TorchCommBackend, object)]
        for entry in optable.OPS:
            if not any(entry.method in vars(k) for k in own):
                setattr(cls, entry.method, make(entry))
        return cls

    return fill
