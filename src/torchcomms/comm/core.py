"""``CommCore``: what every operation of a ``TorchComm`` goes through, and nothing else.

One path for every op (collectives, point-to-point, batches, split):

1. ``_checker(op)``: refuse unless the comm's state allows ops (``torchcomms.runtime.state``),
   then the op validates its arguments (``validation``);
2. ``_begin``: resolve the per-op timeout, take the process-global ``op_id``, run the
   pre-hooks (a raising hook stops the op);
3. ``_issue``: call the backend (the typed ``CommBackend``) with an ``OpOptions``,
   telling the internal observers (``oprecord``) about it; then the post-hooks.

``split`` takes steps 1 and 2 and creates a communicator instead of calling an op.

The sync lane (``_sync``) is steps 2 and 3 for the common case, the small-message latency
path: a sync op with the comm's timeout and no hints, while no user hook is registered
and the comm's only observer can record it in one call (``_lane``; the flight recorder
can).  It
skips the pre-hook arguments and the ``OpRecord``; what observers and dumps see is the
same.

Failures and abort: an error that surfaces from the backend while the comm is aborted
comes out as ``CommAbortedError`` (the original as ``__cause__``).  The first failure a
backend reports (``CommStatus.failure_listener``, on the failing thread) ends the process
when ``abort_process_on_timeout_or_error`` is on and it is a timeout or a peer failure:
the abort hooks run (once; the flight recorder's dumps), a critical log line names comm,
rank, op and cause, then ``os._exit(ABORT_EXIT_CODE)``.  Validation errors and collective
mismatches never end the process.  The abort hooks run at most once per communicator,
whoever triggers them (``abort()`` or that path), on the triggering thread.

Thread-safety follows upstream: a communicator is meant to be driven by one thread;
``op_id`` allocation, hook registration and ``abort()`` are thread-safe.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import re
import sys
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from torchcomms.backends.base import TorchCommBackend
from torchcomms.backends.contract import CommBackend
from torchcomms.comm.validation import Checker
from torchcomms.errors import CommAbortedError, CommError, CommTimeoutError, PeerFailureError
from torchcomms.optable import OpName, hook_args
from torchcomms.runtime.oprecord import LaneObserver, OpObserver, OpRecord
from torchcomms.runtime.state import CommState, CommStatus
from torchcomms.runtime.work import CompletedWork, TorchWork
from torchcomms.types import AbortInfo, AbortReason, CommOptions, OpOptions

FINALIZE_OP_ID = 2**64 - 1
#: The exit code of a process ended by ``abort_process_on_timeout_or_error``.
ABORT_EXIT_CODE = 86
_READY = CommState.READY
_ZERO = timedelta(0)
_ABORTED = CommState.ABORTED

logger = logging.getLogger("torchcomms.comm.core")

#: ``next()`` on an ``itertools.count`` is one C call that holds the GIL throughout, so
#: op ids are unique across threads without a lock.
_op_ids = itertools.count()
_next_op_id = _op_ids.__next__


PreHook = Callable[[OpName, int, Any], None]
PostHook = Callable[[int, Any], None]
AbortHook = Callable[[], None]
#: One op's backend method (``CommBackend``), called as ``call(*call_args, options)``.
BackendCall = Callable[..., TorchWork]


def _exit_process(code: int) -> None:
    """End the process at once (no atexit, no finalizers): other threads may be stuck."""
    os._exit(code)


_OP_IN_MESSAGE = re.compile(r"\] (\w+)")


class RemovableHandle:
    """Returned by ``register_*_hook``; ``remove()`` unregisters once, later calls do nothing."""

    def __init__(
        self,
        registry_: dict[int, Any],
        key: int,
        on_remove: weakref.WeakMethod[Callable[[], None]] | None = None,
    ) -> None:
        self._registry = registry_
        self._key = key
        self._lock = threading.Lock()
        # Weak: a handle may outlive its communicator and must not keep it alive.
        self._on_remove = on_remove

    def remove(self) -> None:
        with self._lock:
            self._registry.pop(self._key, None)
        method = self._on_remove() if self._on_remove is not None else None
        if method is not None:
            method()


class CommCore:
    """State, hooks, observers and the issue path of one communicator (module docstring)."""

    def __init__(
        self, backend_name: str, backend: CommBackend, device: torch.device, options: CommOptions
    ) -> None:
        self._backend_name = backend_name
        self._backend = backend
        self._impl: TorchCommBackend = backend.backend_object()
        self._impl_name = type(self._impl).__name__
        self._device = device
        self._options = options
        initial = CommState.UNINITIALIZED if options.enable_reconfigure else CommState.READY
        self._status = CommStatus(initial)
        backend.bind_status(self._status)
        self._hook_ids = itertools.count()
        self._pre_hooks: dict[int, PreHook] = {}
        self._post_hooks: dict[int, PostHook] = {}
        self._abort_hooks: dict[int, AbortHook] = {}
        self._checkers: dict[str, Checker] = {}
        self._observers: tuple[OpObserver, ...] = ()
        # The comm's one observer while the sync lane is open (``_update_lane``), else None.
        self._lane: LaneObserver | None = None
        self._lane_ref = weakref.WeakMethod(self._update_lane)
        self._abort_lock = threading.Lock()
        self._abort_info: AbortInfo | None = None  # the first reason wins
        self._abort_hooks_fired = False
        self._aborting = False  # an abort() call got past its once-check (TorchComm.abort)
        self._aborted = False  # abort() succeeded
        self._status.failure_listener = self._on_failure

    # -- state ---------------------------------------------------------------------------------
    @property
    def _finalized(self) -> bool:
        return self._status.state is CommState.FINALIZED

    def get_rank(self) -> int:
        return int(self._backend.get_rank())

    def get_size(self) -> int:
        return int(self._backend.get_size())

    def _supports_reconfigure(self) -> bool:
        """Whether the backend can ``reconfigure`` (what c10d's ``supports_reconfigure`` asks)."""
        return bool(self._backend.supports_reconfigure())

    def get_name(self) -> str:
        return str(self._backend.get_comm_name())

    def _safe_name(self) -> str:
        try:
            return self.get_name()
        except Exception:
            return "<unnamed>"

    # -- hooks -----------------------------------------------------------------------------------
    def register_pre_hook(self, callback: PreHook) -> RemovableHandle:
        """``callback(name: OpName, op_id: int, args)`` runs before each op; raising stops the op."""
        return self._add_hook(self._pre_hooks, callback)

    def register_post_hook(self, callback: PostHook) -> RemovableHandle:
        """``callback(op_id: int, args)`` runs right after each op was issued."""
        return self._add_hook(self._post_hooks, callback)

    def register_abort_hook(self, callback: AbortHook) -> RemovableHandle:
        """``callback()`` runs before the communicator aborts."""
        return self._add_hook(self._abort_hooks, callback)

    def _add_hook(self, table: dict[int, Any], callback: Any) -> RemovableHandle:
        if not callable(callback):
            raise TypeError(f"hook must be callable, got {type(callback).__name__}")
        key = next(self._hook_ids)
        table[key] = callback
        self._update_lane()
        return RemovableHandle(table, key, self._lane_ref)

    def _run_pre_hooks(self, name: OpName, op_id: int, args: Any) -> None:
        if self._pre_hooks:
            for hook in list(self._pre_hooks.values()):
                hook(name, op_id, args)

    def _run_post_hooks(self, op_id: int, args: Any) -> None:
        for hook in list(self._post_hooks.values()):
            hook(op_id, args)

    def _fire_abort_hooks(self) -> bool:
        """Run the abort hooks unless they ran already; a raising hook is logged, not raised."""
        with self._abort_lock:
            if self._abort_hooks_fired:
                return False
            self._abort_hooks_fired = True
        for hook in list(self._abort_hooks.values()):
            try:
                hook()
            except Exception:
                logger.exception(
                    "torchcomms: an abort hook of comm %s raised",
                    self._safe_name(),
                    extra={"comm": self._safe_name()},
                )
        return True

    def _set_abort_info(self, reason: AbortReason, context: str) -> None:
        with self._abort_lock:
            if self._abort_info is None:
                self._abort_info = AbortInfo(reason, context)

    def get_abort_info(self) -> AbortInfo | None:
        """Why the comm was aborted (the first reason given), or ``None`` if it was not."""
        return self._abort_info

    # -- failures --------------------------------------------------------------------------------
    def _on_failure(self, error: CommError) -> None:
        """The comm's first failure (any thread): end the process if the options say so."""
        if not self._options.abort_process_on_timeout_or_error:
            return
        if not isinstance(error, (CommTimeoutError, PeerFailureError)):
            return
        timed_out = isinstance(error, CommTimeoutError)
        self._set_abort_info(
            AbortReason.TIMED_OUT if timed_out else AbortReason.NETWORK_ERROR, str(error)
        )
        self._fire_abort_hooks()  # e.g. the flight recorder dumps its buffer
        name = self._safe_name()
        try:
            rank: Any = self._backend.get_rank()
        except Exception:
            rank = "?"
        found = _OP_IN_MESSAGE.search(str(error))
        op = found.group(1) if found else "?"
        logger.critical(
            "torchcomms: comm %s rank %s: %s %s; ending the process with exit code %d "
            "(abort_process_on_timeout_or_error is on; TORCHCOMM_ABORT_ON_ERROR=0 raises "
            "the error instead): %s",
            name,
            rank,
            op,
            "timed out" if timed_out else "lost a peer",
            ABORT_EXIT_CODE,
            error,
            extra={"comm": name, "rank": rank, "op": op, "exit_code": ABORT_EXIT_CODE},
        )
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        _exit_process(ABORT_EXIT_CODE)

    def _surfaced(self, name: OpName, exc: BaseException) -> BaseException:
        """The error a failed op raises: ``CommAbortedError`` once the comm was aborted."""
        if (
            self._status.state is not _ABORTED
            or isinstance(exc, CommAbortedError)
            or not isinstance(exc, Exception)
        ):
            return exc
        return CommAbortedError(
            f"{self._prefix(name.name)}the communicator was aborted while the op was running "
            f"({type(exc).__name__}: {exc})"
        )

    # -- the issue path ----------------------------------------------------------------------------
    def _prefix(self, op: str) -> str:
        rank = self._backend.get_rank() if not self._finalized else "?"
        return f"[{self._impl_name} comm={self._safe_name()} rank={rank}] {op}: "

    def _checker(self, op: str) -> Checker:
        """Refuse unless ops may run, then the (cached) validator of ``op``."""
        if self._status.state is not _READY:
            self._status.check(self._prefix(op), self._impl_name)
        checker = self._checkers.get(op)
        if checker is None:  # rank, size and dtypes are fixed for a comm's life: build once
            backend = self._backend
            checker = Checker(
                functools.partial(self._prefix, op),
                self.get_rank(),
                self.get_size(),
                self._device,
                backend.supported_dtypes(),
                backend.self_p2p_allowed(),
            )
            self._checkers[op] = checker
        return checker

    def _resolve_timeout(self, timeout: timedelta | None, op: str, hints: Any = None) -> timedelta:
        """The op's timeout (the comm's default when unset); also type-checks ``hints``."""
        if hints is not None and not isinstance(hints, dict):
            raise TypeError(
                f"{self._prefix(op)}hints must be a dict[str, str], got {type(hints).__name__}"
            )
        if timeout is None:
            return self._options.timeout
        if not isinstance(timeout, timedelta):
            raise TypeError(
                f"{self._prefix(op)}timeout must be a timedelta, got {type(timeout).__name__}"
            )
        if timeout <= _ZERO:
            # As for new_comm and set_timeout: every wait has a deadline, none is "forever".
            raise ValueError(f"{self._prefix(op)}timeout must be positive, got {timeout}")
        return timeout

    def _begin(
        self, name: OpName, pre_args: Any, timeout: timedelta | None, hints: Any
    ) -> tuple[int, timedelta]:
        """Resolve the timeout, take an op_id, run the pre-hooks: ``(op_id, timeout)``."""
        resolved = self._resolve_timeout(timeout, name._name_, hints)
        op_id = _next_op_id()
        self._run_pre_hooks(name, op_id, pre_args)
        return op_id, resolved

    def _issue(
        self,
        name: OpName,
        pre_args: Any,
        timeout: timedelta | None,
        hints: dict[str, str] | None,
        call: BackendCall,
        call_args: tuple[Any, ...],
        post_args: Callable[[TorchWork], Any] | None = None,
    ) -> TorchWork:
        """Begin the op, ``call(*call_args, options)`` (observed), then run the post-hooks.

        ``call`` is the backend's method for the op and ``call_args`` its arguments before
        the options; observers may inspect them (e.g. the reduce op).  ``post_args`` builds
        the post-hooks' argument from the work (default: the op's ``CollectivePostHookArgs``
        subclass).  The steps of ``_begin`` are inlined: this is every op's hot path.
        """
        op_name = name._name_  # (``.name`` is a descriptor call, ``_name_`` a plain read)
        if timeout is None and hints is None:
            resolved = self._options.timeout
        else:
            resolved = self._resolve_timeout(timeout, op_name, hints)
        op_id = _next_op_id()
        if self._pre_hooks:
            self._run_pre_hooks(name, op_id, pre_args)
        options = OpOptions(resolved, dict(hints) if hints else {}, op_name, op_id)
        observers = self._observers
        if not observers:
            try:
                work = call(*call_args, options)
            except BaseException as exc:
                error = self._surfaced(name, exc)
                if error is exc:
                    raise
                raise error from exc
        else:
            record = OpRecord(self, name, op_id, pre_args, resolved, observers, call_args)
            try:
                # An observer may stop the op (the collective check); it still finishes, failed.
                record._scheduled()
                work = call(*call_args, options)
            except BaseException as exc:
                error = self._surfaced(name, exc)
                record._failed(error)
                if error is exc:
                    raise
                raise error from exc
            if type(work) is CompletedWork:  # a sync op: done, nothing to wait for
                record._finish()
            else:
                record._issued(work)
        if self._post_hooks:
            if post_args is None:  # the op's own CollectivePostHookArgs subclass
                by_op = hook_args.POST_HOOK_ARGS_BY_OP
                post_args = by_op.get(name, hook_args.CollectivePostHookArgs)
            self._run_post_hooks(op_id, post_args(work))
        return work

    def _sync(
        self,
        name: OpName,
        tensor: torch.Tensor | None,
        peer: int,
        call: BackendCall,
        call_args: tuple[Any, ...],
    ) -> TorchWork:
        """The lane: ``_issue`` for a valid sync op with the comm's timeout and no hints.

        The caller checked that the lane is open (``_lane``: no user hook, and the comm's
        one observer records on the lane); it takes one ``SyncRecord`` instead of an
        ``OpRecord`` and its entry.  What it and the backend see is the same as on
        ``_issue``'s path (``tests/test_lane.py`` compares the two).
        """
        observer = self._lane
        assert observer is not None
        resolved = self._options.timeout
        op_id = _next_op_id()
        options = OpOptions(resolved, {}, name._name_, op_id)
        record = observer.op_sync(self, name, op_id, tensor, peer, resolved)
        try:
            work = call(*call_args, options)
        except BaseException as exc:
            error = self._surfaced(name, exc)
            record._finished(observer, self, error)
            if error is exc:
                raise
            raise error from exc
        if type(work) is CompletedWork:
            record.time_completed_ns = time.time_ns()
        else:
            record._track(work, observer, self)
        return work

    def _add_observer(self, observer: OpObserver) -> None:
        """Attach an internal observer (see ``oprecord``); split children inherit it."""
        if observer not in self._observers:
            self._set_observers((*self._observers, observer))

    def _remove_observer(self, observer: OpObserver) -> None:
        self._set_observers(tuple(o for o in self._observers if o is not observer))

    def _set_observers(self, observers: tuple[OpObserver, ...]) -> None:
        self._observers = observers
        self._update_lane()

    def _update_lane(self) -> None:
        """Open the sync lane (``_sync``) while no user hook is registered and the comm's
        only observer records on it (the flight recorder, by default); ops check only
        ``_lane``.  Any thread (hook changes)."""
        observers = self._observers
        only = observers[0] if len(observers) == 1 else None
        if (
            callable(getattr(only, "op_sync", None))
            and not self._pre_hooks
            and not self._post_hooks
        ):
            self._lane = only  # type: ignore[assignment]  # a LaneObserver, checked
        else:
            self._lane = None
