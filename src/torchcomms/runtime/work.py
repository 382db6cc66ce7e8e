"""Works: the handle every operation returns, and how errors travel back to ``wait()``.

Concurrency: a work is finished once, by the first of: its producer (the comm's
executor thread, or the thread that issued a sync op), the comm's ``abort()`` (any
thread, see ``AbortSignal``), or a ``wait()`` that gave up on a stuck executor.  The
finisher stores the result or the exception under ``_state_lock``, then sets an
``Event``; later finishes are ignored.  ``wait()`` blocks on that event with a deadline.
A work may carry a *completion* (e.g. "wait for these posted gloo receives"), run once
by the first ``wait()`` after the producer finished.

Status: a work that finished is *completed* (``is_completed()`` is True) whether it
succeeded (``COMPLETED``) or failed (``ERROR``, or ``TIMEDOUT`` for a
``CommTimeoutError``); ``wait()`` on a failed work re-raises the original error, every
time it is called.

Done-callbacks (``_add_done_callback``) let observers (the c10d bridge's futures,
the flight recorder) learn when an op finished without polling: each runs once,
on the thread that finished the work (or at once, on the registering thread, if
the work already finished).  A work with a completion finishes at the ``wait()``
that runs it.  Callback errors are logged, never raised into the producer.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from torchcomms.errors import CommAbortedError, CommTimeoutError

logger = logging.getLogger("torchcomms.runtime.work")

DoneCallback = Callable[["TorchWork"], None]

WAIT_BLOCKING_UNSUPPORTED = "[TorchWork]: waitBlocking not implemented for this work type"


class WorkStatus(enum.Enum):
    NOT_STARTED = 0
    INPROGRESS = 1
    COMPLETED = 2
    TIMEDOUT = 3
    ERROR = 4


#: The states of a work that finished, successfully or not.
FINISHED = frozenset((WorkStatus.COMPLETED, WorkStatus.TIMEDOUT, WorkStatus.ERROR))


def failed_status(error: BaseException) -> WorkStatus:
    """``TIMEDOUT`` for a timeout, ``ERROR`` for anything else."""
    return WorkStatus.TIMEDOUT if isinstance(error, CommTimeoutError) else WorkStatus.ERROR


class TorchWork:
    """A handle on an issued operation; ``wait()`` blocks until it finished and re-raises its error."""

    def __init__(self) -> None:
        self._status = WorkStatus.COMPLETED
        self._python_created = False

    def is_completed(self) -> bool:
        """True once the op finished, successfully or not (``status()`` tells which)."""
        return self._status in FINISHED

    def status(self) -> WorkStatus:
        return self._status

    def wait(self) -> None:
        """Block until the operation finished; a sync op's work returns at once."""

    def wait_blocking(self) -> None:
        """Block the host until done; supported by already-completed works only (as upstream)."""
        if self._status is not WorkStatus.COMPLETED:
            raise RuntimeError(WAIT_BLOCKING_UNSUPPORTED)

    def exception(self) -> BaseException | None:
        return None

    def _add_done_callback(self, callback: DoneCallback) -> None:
        """Run ``callback(self)`` once the op finished (now, if it already has)."""
        _call_safely(callback, self)

    def _started_ns(self) -> int | None:
        """``time.monotonic_ns()`` when the op began running, if this work knows it."""
        return None

    def _set_status(self, status: WorkStatus) -> None:
        if not self._python_created:
            raise RuntimeError("_set_status is only supported on Python-created work objects")
        self._status = status

    def __repr__(self) -> str:
        return f"{type(self).__name__}(status={self._status.name})"


class CompletedWork(TorchWork):
    """The work of an operation that already finished when it was returned.

    Every sync op returns one, so it costs an allocation and nothing more: its state lives
    in class attributes (``completed_python_work`` sets its own flag on the instance).
    """

    _status = WorkStatus.COMPLETED
    _python_created = False

    def __init__(self) -> None:
        pass


class AbortSignal:
    """Set once, when the communicator that owns an executor aborts (any thread).

    Works run by that executor consult it in ``wait()``: a completion not yet run is not
    run, and an error a running completion raises comes out as ``CommAbortedError``.
    """

    __slots__ = ("is_set",)

    def __init__(self) -> None:
        self.is_set = False

    def set(self) -> None:
        self.is_set = True

    @staticmethod
    def error_for(description: str, cause: BaseException | None = None) -> CommAbortedError:
        """The error of an op that was pending when its communicator was aborted."""
        error = CommAbortedError(
            f"{description}: the communicator was aborted while this op was pending"
        )
        error.__cause__ = cause
        return error


class AsyncWork(TorchWork):
    """The work of an operation running in the background (see the module docstring)."""

    #: Extra seconds ``wait()`` allows beyond twice the op's timeout before calling it stuck.
    STUCK_GRACE_S = 30.0

    def __init__(self, description: str, timeout_s: float) -> None:
        super().__init__()
        self._status = WorkStatus.NOT_STARTED
        self._description = description
        self._timeout_s = timeout_s
        self._done = threading.Event()
        self._finished = False  # guarded by _state_lock: the first finish wins
        self._state_lock = threading.Lock()
        self._error: BaseException | None = None
        self._completion: Callable[[], None] | None = None
        self._completion_lock = threading.Lock()
        self._callbacks = _DoneCallbacks(self)
        self._started_at: int | None = None
        #: The abort signal of the executor that runs this work (set by ``submit``).
        self._abort: AbortSignal | None = None

    # -- producer side -------------------------------------------------------------------
    def _mark_started(self) -> None:
        self._started_at = time.monotonic_ns()
        if not self._finished:
            self._status = WorkStatus.INPROGRESS

    def _started_ns(self) -> int | None:
        return self._started_at

    def _add_done_callback(self, callback: DoneCallback) -> None:
        self._callbacks.add(callback)

    def _fire_callbacks(self) -> None:
        self._callbacks.fire()

    def _finish(
        self, error: BaseException | None, completion: Callable[[], None] | None = None
    ) -> bool:
        """Record the outcome unless the work already finished; True if this call did."""
        with self._state_lock:
            if self._finished:
                return False
            self._finished = True
            self._error = error
            self._completion = completion if error is None else None
            if error is not None:
                self._status = failed_status(error)
            elif completion is None:
                self._status = WorkStatus.COMPLETED
        # Callbacks run before waiters wake, so an observer can still annotate the error
        # (e.g. with a flight-recorder dump path) before wait() re-raises it.
        if error is not None or completion is None:
            self._fire_callbacks()
        self._done.set()
        return True

    def _fail_pending(self, error: BaseException) -> bool:
        """Fail a work that has not finished, or whose completion has not started (abort)."""
        if self._finish(error):
            return True
        if not self._completion_lock.acquire(blocking=False):
            return False  # a wait() is running the completion; it sees the abort signal
        try:
            return self._complete(error)
        finally:
            self._completion_lock.release()

    def _complete(self, error: BaseException | None) -> bool:
        """End the completion stage (caller holds ``_completion_lock``)."""
        with self._state_lock:
            if self._completion is None:
                return False
            self._error = error
            self._status = WorkStatus.COMPLETED if error is None else failed_status(error)
            self._completion = None  # last: wait() reads it before _error, without the lock
        self._fire_callbacks()
        return True

    # -- consumer side -------------------------------------------------------------------
    def is_completed(self) -> bool:
        return self._done.is_set() and self._completion is None

    def wait(self) -> None:
        if not self._done.is_set():
            # The producer enforces the op's own deadline; this bound only guards against a
            # stuck executor (e.g. an earlier op that never returns), so it is generous.
            bound = self._timeout_s * 2 + self.STUCK_GRACE_S
            if not self._done.wait(bound):
                self._finish(
                    CommTimeoutError(
                        f"{self._description}: work did not complete within {bound:.0f} s"
                    )
                )
        if self._completion is None:  # read first: _complete clears it after setting _error
            if self._error is not None:
                raise self._error
            return
        with self._completion_lock:
            completion = self._completion
            if completion is not None:
                abort = self._abort
                if abort is not None and abort.is_set:
                    self._complete(abort.error_for(self._description))
                else:
                    try:
                        completion()
                    except BaseException as exc:
                        error = exc
                        if (
                            abort is not None
                            and abort.is_set
                            and not isinstance(exc, CommAbortedError)
                        ):
                            error = abort.error_for(self._description, exc)
                        self._complete(error)
                    else:
                        self._complete(None)
        if self._error is not None:
            raise self._error

    def exception(self) -> BaseException | None:
        return self._error

    def wait_blocking(self) -> None:
        # Upstream's threaded gloo works never implement it, whatever their state; keying on
        # the status would make the outcome depend on how fast the op ran.
        raise RuntimeError(WAIT_BLOCKING_UNSUPPORTED)


def _call_safely(callback: DoneCallback, work: TorchWork) -> None:
    try:
        callback(work)
    except Exception:
        logger.exception("torchcomms: a work done-callback raised")


class _DoneCallbacks:
    """The pending done-callbacks of one work; ``fire()`` runs them once, later adds run at once."""

    def __init__(self, work: TorchWork) -> None:
        self._work = work
        self._pending: list[DoneCallback] | None = []
        self._lock = threading.Lock()

    def add(self, callback: DoneCallback) -> None:
        with self._lock:
            if self._pending is not None:
                self._pending.append(callback)
                return
        _call_safely(callback, self._work)

    def fire(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
        for callback in pending or ():
            _call_safely(callback, self._work)


class PythonBackendWork(TorchWork):
    """Wraps the object a Python backend returned: ``wait()`` calls its ``wait()`` once.

    ``on_error`` learns of an error its ``wait()`` raised (the comm's failure report).
    """

    def __init__(self, inner: Any, on_error: Callable[[BaseException], None] | None = None) -> None:
        super().__init__()
        self._python_created = True
        self._inner = inner
        self._on_error = on_error
        self._status = WorkStatus.INPROGRESS
        self._waited = False
        self._error: BaseException | None = None
        self._callbacks = _DoneCallbacks(self)

    def exception(self) -> BaseException | None:
        return self._error

    def _add_done_callback(self, callback: DoneCallback) -> None:
        self._callbacks.add(callback)

    def wait(self) -> None:
        if self._waited:
            if self._error is not None:
                raise self._error  # the plug-in's wait() ran once; its error sticks
            return
        try:
            self._inner.wait()
        except BaseException as exc:
            self._waited = True
            self._error = exc
            self._status = WorkStatus.ERROR
            if self._on_error is not None:
                self._on_error(exc)
            self._callbacks.fire()
            raise
        self._waited = True
        self._status = WorkStatus.COMPLETED
        self._callbacks.fire()


def completed_python_work() -> TorchWork:
    """The work of a plug-in backend op that returned ``None`` (already done)."""
    work = CompletedWork()
    work._python_created = True
    return work
