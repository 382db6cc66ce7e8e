"""``OpRecord``: one issued operation as internal observers see it.

Observers (the flight recorder, the JSON event log, the collective-mismatch check)
attach to a communicator with ``TorchComm._add_observer`` and implement
``OpObserver``.  Unlike user hooks, they see the op's whole life:

* ``op_scheduled(record)`` runs on the issuing thread after the pre-hooks and before
  the backend is called; raising stops the op (the error reaches the caller).
  ``record.args`` (the pre-hook args, holding the tensors) is only set during this call,
  so a recorder that keeps records never keeps tensors alive.
* ``op_finished(record)`` runs once, when the op completed or failed (``record.error``),
  on whichever thread finished it: the issuing thread for sync ops and failures at issue,
  the comm's executor thread for async ops, the waiting thread for ops that finish in
  ``wait()`` (posted receives).  It must be quick and must not raise.
* optionally ``comm_split(parent, child, members, op_id)``: the parent's ``split`` created
  ``child`` (which inherits the parent's observers) over parent ranks ``members``;
* optionally ``op_sync(...)`` (``LaneObserver``): record a sync op of the lane
  (``CommCore._sync``) in one call, returning its ``SyncRecord``.  While it is a comm's
  only observer, sync ops skip the ``OpRecord`` (see ``SyncRecord``).

``state`` follows PyTorch's flight-recorder vocabulary: ``scheduled`` (queued behind
earlier ops), ``started`` (running), ``completed`` (finished, with or without error).
Times are ``time.time_ns()`` wall-clock, comparable across ranks of one host.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any, Generic, Protocol, TypeVar

from torchcomms.optable import OpName
from torchcomms.runtime.work import TorchWork, WorkStatus

#: The communicator type that issued the op (``TorchComm``); a parameter, not an import,
#: because this module sits below ``torchcomms.comm``.
CommT = TypeVar("CommT")

logger = logging.getLogger("torchcomms.runtime.oprecord")


class OpObserver(Protocol):
    def op_scheduled(self, record: OpRecord) -> None: ...

    def op_finished(self, record: OpRecord) -> None: ...


class OpRecord(Generic[CommT]):
    """Everything known about one op (see the module docstring); mutated by its comm only."""

    __slots__ = (
        "args",
        "async_op",
        "call_args",
        "comm",
        "error",
        "name",
        "observers",
        "op_id",
        "time_completed_ns",
        "time_created_ns",
        "time_started_ns",
        "timeout",
        "work",
    )

    def __init__(
        self,
        comm: CommT,
        name: OpName,
        op_id: int,
        args: Any,
        timeout: timedelta,
        observers: tuple[OpObserver, ...],
        call_args: tuple[Any, ...] = (),
    ) -> None:
        self.comm: CommT = comm
        self.name = name
        self.op_id = op_id
        self.args: Any = args
        # The backend's positional arguments (e.g. the ReduceOp), like ``args`` only
        # during ``op_scheduled``.
        self.call_args: tuple[Any, ...] = call_args
        self.async_op: bool = args.async_op  # every op's pre-hook args carry it
        self.timeout = timeout
        self.observers = observers
        self.time_created_ns = time.time_ns()
        self.time_started_ns: int | None = None
        self.time_completed_ns: int | None = None
        self.error: BaseException | None = None
        self.work: TorchWork | None = None

    @property
    def state(self) -> str:
        if self.time_completed_ns is not None:
            return "completed"
        if self.time_started_ns is not None or self._work_started():
            return "started"
        return "scheduled"

    @property
    def started_ns(self) -> int | None:
        """When the op began running (an async op: when the executor picked it up)."""
        if self.time_started_ns is not None:
            return self.time_started_ns
        work = self.work
        mono = work._started_ns() if work is not None else None
        if mono is None:
            return None
        # "That long ago" in wall-clock time: an offset taken once would drift from
        # ``time_created_ns`` whenever the wall clock is stepped (NTP, a VM resync).
        return time.time_ns() - (time.monotonic_ns() - mono)

    def _work_started(self) -> bool:
        work = self.work
        return work is not None and work.status() is not WorkStatus.NOT_STARTED

    # -- driven by TorchComm ---------------------------------------------------------------
    def _scheduled(self) -> None:
        """Tell the observers; a sync op then starts running on this thread."""
        try:
            for observer in self.observers:
                observer.op_scheduled(self)
        finally:
            self.args = None
            self.call_args = ()
        if not self.async_op:
            self.time_started_ns = time.time_ns()

    def _issued(self, work: TorchWork) -> None:
        """The op was handed to the backend (``_finish`` directly for a sync op's work)."""
        self.work = work
        work._add_done_callback(self._work_done)

    def _failed(self, error: BaseException) -> None:
        self.error = error
        self._finish()

    def _work_done(self, work: TorchWork) -> None:
        self.error = work.exception()
        if self.time_started_ns is None:
            self.time_started_ns = self.started_ns
        self._finish()

    def _finish(self) -> None:
        self.time_completed_ns = time.time_ns()
        self.work = None
        for observer in self.observers:
            try:
                observer.op_finished(self)
            except Exception:
                logger.exception("torchcomms: an op observer raised in op_finished")
        # A recorder keeps finished records for a while: they must not keep a dropped
        # communicator (and its sockets and threads) alive.
        self.comm = None  # type: ignore[assignment]


class LaneObserver(OpObserver, Protocol):
    """An observer that can record a sync op on the lane (``CommCore._sync``) cheaply.

    ``op_sync(comm, name, op_id, tensor, peer, timeout)`` runs on the issuing thread when
    the op starts and returns the ``SyncRecord`` it keeps (``tensor``: the op's one tensor,
    ``(input, output)`` for an op with one of each, or ``None``); the lane sets its completion
    time and calls ``op_finished(record)`` only for a failure or an op that finished later.
    """

    def op_sync(
        self,
        comm: Any,
        name: OpName,
        op_id: int,
        tensor: Any,
        peer: int,
        timeout: timedelta,
    ) -> SyncRecord: ...


class SyncRecord:
    """The record of a sync op with no user hooks: the fast lane's ``OpRecord``.

    Such an op starts on the caller's thread when it is created, and nearly always is
    complete when the backend returns (the lane sets ``time_completed_ns``).  Observers read
    the same fields as on an ``OpRecord``; ``comm`` is set only for the observers' calls
    (``op_finished``), so a kept record never keeps its communicator alive.
    """

    __slots__ = (
        "comm",
        "error",
        "name",
        "op_id",
        "time_completed_ns",
        "time_created_ns",
        "timeout",
        "work",
    )

    async_op = False

    def __init__(self, name: OpName, op_id: int, timeout: timedelta) -> None:
        self.name = name
        self.op_id = op_id
        self.timeout = timeout
        self.time_created_ns = time.time_ns()
        self.time_completed_ns: int | None = None
        self.error: BaseException | None = None
        self.comm: Any = None
        self.work: TorchWork | None = None

    @property
    def time_started_ns(self) -> int:
        return self.time_created_ns

    started_ns = time_started_ns

    @property
    def state(self) -> str:
        return "started" if self.time_completed_ns is None else "completed"

    def _finished(self, observer: OpObserver, comm: Any, error: BaseException | None) -> None:
        """Completed or failed (any thread): tell ``observer``, which may dump on failure."""
        self.error = error
        self.time_completed_ns = time.time_ns()
        self.work = None
        self.comm = comm
        try:
            observer.op_finished(self)  # type: ignore[arg-type]  # the same fields
        except Exception:
            logger.exception("torchcomms: an op observer raised in op_finished")
        self.comm = None

    def _track(self, work: TorchWork, observer: OpObserver, comm: Any) -> None:
        """The backend returned a work still running (a posted receive): finish with it."""
        self.work = work
        work._add_done_callback(lambda w: self._finished(observer, comm, w.exception()))
