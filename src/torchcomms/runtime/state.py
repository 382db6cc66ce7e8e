"""The communicator's state machine, owned by ``TorchComm`` and shared with its backend.

::

    uninitialized ──reconfigure──► ready ──failure──► error ──abort──► aborted
    (reconfigure mode)               │                  │                 │
                                     └──────────────────┴──── finalize ───┴──► finalized

* ``ready``: ops run.  ``uninitialized`` (a comm made with ``enable_reconfigure=True``
  before its first ``reconfigure``) refuses ops.
* ``error``: the first failure a backend reports (``fail``) is kept as the cause; every
  later op fails fast with an error of the same type that quotes it.  Any thread may
  report (an async op fails on the comm's executor thread); the first report wins.
* ``revoke`` makes a ``CommRevokedError`` the cause (also over an earlier failure);
  ``revive`` (a successful ``reconfigure``) returns to ``ready`` from any state but
  ``finalized``.
* ``aborted`` (``abort()``, from any state but ``finalized``) and ``finalized`` refuse
  every op; ``finalize`` after abort releases what is left, quietly.
* ``failure_listener`` (set by ``TorchComm``) learns of the first failure once, after the
  backend's own ``on_failure`` (``CommBackend.report_failure``); it acts on
  ``abort_process_on_timeout_or_error``.

``_lock`` guards the transitions; ``check`` reads without it (a stale read only lets one
op start that will fail on its own).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable

from torchcomms.errors import CommAbortedError, CommError, CommStateError


class CommState(enum.Enum):
    UNINITIALIZED = "uninitialized"
    READY = "ready"
    ERROR = "error"
    ABORTED = "aborted"
    FINALIZED = "finalized"


class CommStatus:
    """One communicator's state and the cause of its failure (see the module docstring)."""

    __slots__ = ("_lock", "aborted", "cause", "failure_listener", "state")

    def __init__(self, state: CommState = CommState.READY) -> None:
        self.state = state
        self.cause: CommError | None = None
        #: Sticky, like ``cause``: still true once ``finalize`` moved the state on.
        self.aborted = False
        self.failure_listener: Callable[[CommError], None] | None = None
        self._lock = threading.Lock()

    def fail(self, error: CommError) -> bool:
        """Record a failure; True when it is the first (the comm moved to ``error``)."""
        with self._lock:
            if self.state is not CommState.READY:
                return False
            self.state = CommState.ERROR
            self.cause = error
            return True

    def revoke(self, error: CommError) -> None:
        """A revoke (this rank's or a peer's) becomes the cause, over an earlier failure."""
        with self._lock:
            if self.state in (CommState.READY, CommState.ERROR):
                self.state = CommState.ERROR
                self.cause = error

    def revive(self) -> None:
        """``reconfigure`` connected the comm anew: ready, with no cause and no abort."""
        with self._lock:
            self.state = CommState.READY
            self.cause = None
            self.aborted = False

    def set(self, state: CommState) -> None:
        with self._lock:
            self.state = state

    def abort(self) -> bool:
        """Move to ``aborted`` unless finalized or aborted already; True if this call did."""
        with self._lock:
            if self.state in (CommState.ABORTED, CommState.FINALIZED):
                return False
            self.state = CommState.ABORTED
            self.aborted = True
            return True

    def check(self, prefix: str, backend: str) -> None:
        """Raise unless ops may run; ``prefix`` is ``[Backend comm=… rank=…] op: ``."""
        state = self.state
        if state is CommState.READY:
            return
        if state is CommState.ERROR:
            cause = self.cause
            assert cause is not None
            raise type(cause)(
                f"{prefix}communicator is unusable after an earlier failure: {cause}"
            ) from cause
        if state is CommState.ABORTED:
            raise CommAbortedError(f"{prefix}the communicator was aborted")
        if state is CommState.FINALIZED:
            raise CommStateError(
                f"{prefix}{backend} not initialized (the communicator was finalized)"
            )
        raise CommStateError(
            f"{prefix}{backend} not initialized (reconfigure() has not been called yet)"
        )
