"""Issue-order execution of a communicator's operations.

Concurrency model: each communicator owns one ``OpExecutor``.  Async ops are
queued and run, one at a time in issue order, on the executor's single daemon
thread.  A sync op first waits until every op queued before it has run, then
runs inline on the caller's thread (no hand-off, so small sync ops stay cheap).
An op body may return a *completion* (a callable that waits for work it posted
without blocking, like gloo receives); the executor stores it in the work and
moves on, so a posted receive never blocks the ops queued behind it.  Errors
raised by a body are captured into the work and re-raised by ``wait()``.
``_lock`` guards the queue and the count of unfinished queued ops.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from torchcomms.errors import CommTimeoutError
from torchcomms.work import AsyncWork

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
        self._closed = False

    def submit(self, body: OpBody, work: AsyncWork) -> AsyncWork:
        """Queue ``body`` to run after every earlier op; its outcome lands in ``work``."""
        with self._lock:
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
            if self._unfinished == 0:
                return
            if not self._lock.wait_for(lambda: self._unfinished == 0, timeout_s):
                raise CommTimeoutError(
                    f"communicator {self._name}: {self._unfinished} earlier async op(s) did not "
                    f"finish within {timeout_s:.1f} s"
                )

    def close(self, timeout_s: float) -> None:
        """Stop accepting ops, let queued ones finish (bounded), and end the thread."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if not self._queue:
                    return
                body, work = self._queue.popleft()
            work._mark_started()
            try:
                completion = body()
            except BaseException as exc:
                work._finish(exc)
            else:
                work._finish(None, completion)
            finally:
                with self._lock:
                    self._unfinished -= 1
                    self._lock.notify_all()
