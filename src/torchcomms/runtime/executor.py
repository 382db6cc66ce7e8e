"""Issue-order execution of a communicator's operations.

Concurrency model: each communicator owns one ``OpExecutor``.  Async ops are
queued and run, one at a time in issue order, on the executor's single daemon
thread.  A sync op first waits until every op queued before it has run, then
runs inline on the caller's thread (no hand-off, so small sync ops stay cheap).
An op body may return a *completion* (a callable that waits for work it posted
without blocking, like gloo receives); the executor stores it in the work and
moves on, so a posted receive never blocks the ops queued behind it.  Errors
raised by a body are captured into the work and re-raised by ``wait()``.
``_lock`` guards the queue, the running work and the count of unfinished queued ops.

Abort (``abort()``, any thread, never blocks on the op thread): the executor's
``AbortSignal`` is set, queued ops are dropped, and every work not finished yet (queued
or running) fails with ``CommAbortedError`` at once, so their waiters return even if
the running op is stuck in its transport.  An error the running op raises later comes
out as ``CommAbortedError`` too (with the original as ``__cause__``), and a completion
not yet run by ``wait()`` is not run.  Later ``submit`` calls are refused; ``drain`` and
``close`` return without waiting for the op thread.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from torchcomms.errors import CommAbortedError, CommTimeoutError
from torchcomms.runtime import intra_op
from torchcomms.runtime.work import AbortSignal, AsyncWork

Completion = Callable[[], None]
OpBody = Callable[[], "Completion | None"]


class OpExecutor:
    """Runs a communicator's op bodies in issue order (see the module docstring)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Condition()
        self._queue: collections.deque[tuple[OpBody, AsyncWork]] = collections.deque()
        self._unfinished = 0
        self._thread: threading.Thread | None = None
        self._running: AsyncWork | None = None
        self._closed = False
        self.aborted = AbortSignal()

    def submit(self, body: OpBody, work: AsyncWork) -> AsyncWork:
        """Queue ``body`` to run after every earlier op; its outcome lands in ``work``."""
        work._abort = self.aborted
        with self._lock:
            if self.aborted.is_set:
                raise CommAbortedError(f"communicator {self._name} was aborted")
            if self._closed:
                raise RuntimeError(f"communicator {self._name} is finalized")
            self._queue.append((body, work))
            self._unfinished += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"torchcomms-{self._name}", daemon=True
                )
                self._thread.start()
            self._lock.notify_all()
        return work

    def drain(self, timeout_s: float) -> None:
        """Wait until every queued op has run (their errors stay in their works)."""
        with self._lock:
            if self._unfinished == 0 or self.aborted.is_set:
                return
            if not self._lock.wait_for(
                lambda: self._unfinished == 0 or self.aborted.is_set, timeout_s
            ):
                raise CommTimeoutError(
                    f"communicator {self._name}: {self._unfinished} earlier async op(s) did not "
                    f"finish within {timeout_s:.1f} s"
                )

    def abort(self) -> None:
        """Refuse new ops and fail every unfinished one with ``CommAbortedError`` (no waiting)."""
        with self._lock:
            if self.aborted.is_set:
                return
            self.aborted.set()
            dropped = [work for _, work in self._queue]
            self._queue.clear()
            self._unfinished -= len(dropped)
            running = self._running
            self._lock.notify_all()
        if running is not None:
            dropped.insert(0, running)
        for work in dropped:
            work._fail_pending(AbortSignal.error_for(work._description))

    def close(self, timeout_s: float) -> None:
        """Stop accepting ops, let queued ones finish (bounded), and end the thread.

        After ``abort`` it does not wait: the op thread may be stuck in its transport.
        """
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            thread = self._thread
        if self.aborted.is_set:
            return
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def _run(self) -> None:
        intra_op.for_this_thread()  # the ops' torch kernels: one OpenMP thread (why: there)
        aborted = self.aborted
        while True:
            with self._lock:
                while not self._queue and not self._closed and not aborted.is_set:
                    self._lock.wait()
                if not self._queue:
                    return
                body, work = self._queue.popleft()
                self._running = work
            self._run_one(body, work)
            # The idle thread must not keep the last op (and through it its communicator)
            # alive: a comm dropped without ``finalize`` is released by its collection.
            del body, work

    def _run_one(self, body: OpBody, work: AsyncWork) -> None:
        work._mark_started()
        try:
            completion = body()
        except BaseException as exc:
            if self.aborted.is_set and not isinstance(exc, CommAbortedError):
                exc = AbortSignal.error_for(work._description, exc)
            work._finish(exc)
        else:
            work._finish(None, completion)
        finally:
            with self._lock:
                self._running = None
                self._unfinished -= 1
                self._lock.notify_all()
