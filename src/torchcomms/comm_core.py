"""``CommCore``: what every operation of a ``TorchComm`` goes through, and nothing else.

One path for every op (collectives, point-to-point, batches, split):

1. ``_checker(op)``: refuse unless the comm's state allows ops (``torchcomms.state``),
   then the op validates its arguments (``validation``);
2. ``_begin``: resolve the per-op timeout, take the process-global ``op_id``, run the
   pre-hooks (a raising hook stops the op);
3. ``_issue``: call the backend (the typed ``CommBackend``) with an ``OpOptions``,
   telling the internal observers (``oprecord``) about it; then the post-hooks.

``split`` takes steps 1 and 2 and creates a communicator instead of calling an op.

Thread-safety follows upstream: a communicator is meant to be driven by one thread;
``op_id`` allocation and hook registration are thread-safe.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from torchcomms import hook_args
from torchcomms.backends.base import TorchCommBackend
from torchcomms.backends.contract import CommBackend
from torchcomms.oprecord import OpObserver, OpRecord
from torchcomms.state import CommState, CommStatus
from torchcomms.types import CommOptions, OpName, OpOptions
from torchcomms.validation import Checker
from torchcomms.work import TorchWork

FINALIZE_OP_ID = 2**64 - 1
_READY = CommState.READY

_op_ids = itertools.count()
_op_id_lock = threading.Lock()


def _next_op_id() -> int:
    with _op_id_lock:
        return next(_op_ids)


PreHook = Callable[[OpName, int, Any], None]
PostHook = Callable[[int, Any], None]
AbortHook = Callable[[], None]
#: Calls the backend for one op, given its resolved options.
BackendCall = Callable[[OpOptions], TorchWork]


class RemovableHandle:
    """Returned by ``register_*_hook``; ``remove()`` unregisters once, later calls do nothing."""

    def __init__(self, registry_: dict[int, Any], key: int) -> None:
        self._registry = registry_
        self._key = key
        self._lock = threading.Lock()

    def remove(self) -> None:
        with self._lock:
            self._registry.pop(self._key, None)


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

    # -- state ---------------------------------------------------------------------------------
    @property
    def _finalized(self) -> bool:
        return self._status.state is CommState.FINALIZED

    def get_rank(self) -> int:
        return int(self._backend.get_rank())

    def get_size(self) -> int:
        return int(self._backend.get_size())

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
        return RemovableHandle(table, key)

    def _run_pre_hooks(self, name: OpName, op_id: int, args: Any) -> None:
        if self._pre_hooks:
            for hook in list(self._pre_hooks.values()):
                hook(name, op_id, args)

    def _run_post_hooks(self, op_id: int, args: Any) -> None:
        for hook in list(self._post_hooks.values()):
            hook(op_id, args)

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
        if timeout <= timedelta(0):
            return self._options.timeout
        return timeout

    def _begin(
        self, name: OpName, pre_args: Any, timeout: timedelta | None, hints: Any
    ) -> tuple[int, timedelta]:
        """Resolve the timeout, take an op_id, run the pre-hooks: ``(op_id, timeout)``."""
        resolved = self._resolve_timeout(timeout, name.name, hints)
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
        call_args: tuple[Any, ...] = (),
        post_args: Callable[[TorchWork], Any] = hook_args.CollectivePostHookArgs,
    ) -> TorchWork:
        """Begin the op, ``call`` the backend (observed), then run the post-hooks.

        ``call_args`` are the backend arguments observers may inspect (e.g. the reduce op).
        The steps of ``_begin`` are inlined: this is every op's hot path.
        """
        resolved = self._resolve_timeout(timeout, name.name, hints)
        op_id = _next_op_id()
        if self._pre_hooks:
            self._run_pre_hooks(name, op_id, pre_args)
        options = OpOptions(resolved, dict(hints) if hints else {}, name.name, op_id)
        observers = self._observers
        if not observers:
            work = call(options)
        else:
            record = OpRecord(self, name, op_id, pre_args, resolved, observers, call_args)
            try:
                # An observer may stop the op (the collective check); it still finishes, failed.
                record._scheduled()
                work = call(options)
            except BaseException as exc:
                record._failed(exc)
                raise
            record._issued(work)
        if self._post_hooks:
            self._run_post_hooks(op_id, post_args(work))
        return work

    def _add_observer(self, observer: OpObserver) -> None:
        """Attach an internal observer (see ``oprecord``); split children inherit it."""
        if observer not in self._observers:
            self._observers = (*self._observers, observer)

    def _remove_observer(self, observer: OpObserver) -> None:
        self._observers = tuple(o for o in self._observers if o is not observer)
