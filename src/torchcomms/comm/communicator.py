"""``TorchComm`` and ``new_comm``: the backend-agnostic communicator object users hold.

``TorchComm`` validates arguments, assigns the process-global ``op_id``, runs pre/post
hooks, resolves the per-op timeout, owns the communicator's state machine
(``torchcomms.runtime.state``: ready → error → aborted / finalized, plus uninitialized in
reconfigure mode) and forwards to its backend through the one typed interface
``CommBackend``.  It never touches bytes.  The layers: ``comm.core`` (state, hooks,
the issue path), ``optable.methods`` (every operation, through ``comm.ops``),
``comm.persistent`` (the persistent all-gather), and here the lifecycle, ``split`` and the
GPU-only getters.

Thread-safety follows upstream: a communicator is meant to be driven by one thread;
``op_id`` allocation and hook registration are thread-safe.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from torchcomms import config, registry
from torchcomms.backends import plugin
from torchcomms.backends.base import TorchCommBackend
from torchcomms.backends.window_contract import WindowBackend
from torchcomms.bridge import c10d_caller
from torchcomms.comm import allocator
from torchcomms.comm.core import FINALIZE_OP_ID, RemovableHandle, _next_op_id
from torchcomms.comm.ops import BatchSendRecv, CommOps
from torchcomms.comm.persistent import PersistentAllGather
from torchcomms.comm.window import TorchCommWindow
from torchcomms.errors import CommStateError
from torchcomms.optable import OpName, hook_args
from torchcomms.runtime.oprecord import OpObserver
from torchcomms.runtime.state import CommState
from torchcomms.runtime.work import TorchWork
from torchcomms.types import AbortReason, CommOptions

__all__ = [
    "FINALIZE_OP_ID",
    "BatchSendRecv",
    "RemovableHandle",
    "TorchComm",
    "add_default_observer",
    "new_comm",
]

logger = logging.getLogger("torchcomms.comm")


class TorchComm(CommOps, PersistentAllGather):
    """A communicator: a group of ranks with communicator-relative rank numbers."""

    # -- getters ---------------------------------------------------------------------------------
    def get_device(self) -> torch.device:
        return self._device

    def get_backend(self) -> str:
        return self._backend_name

    def get_options(self) -> CommOptions:
        return self._options

    def get_backend_impl(self) -> TorchCommBackend:
        return self._impl

    def unsafe_get_backend(self) -> TorchCommBackend:
        warnings.warn(
            "unsafe_get_backend() is deprecated; use get_backend_impl()",
            DeprecationWarning,
            stacklevel=2,
        )
        return self._impl

    def get_backend_version(self) -> str:
        return self._backend.get_backend_version()

    def get_init_handle(self) -> str:
        return self._backend.get_init_handle()

    def is_abort_supported(self) -> bool:
        return bool(self._backend.is_abort_supported())

    def is_aborted(self) -> bool:
        """True once ``abort()`` succeeded (stays True after ``finalize``)."""
        return self._aborted or bool(self._backend.is_aborted())

    def set_timeout(self, timeout: timedelta) -> None:
        if not isinstance(timeout, timedelta):
            raise TypeError(
                f"set_timeout: timeout must be a timedelta, got {type(timeout).__name__}"
            )
        if timeout <= timedelta(0):
            raise ValueError(f"set_timeout: timeout must be positive, got {timeout}")
        self._backend.set_timeout(timeout)
        self._options.timeout = timeout

    def set_hints(self, hints: dict[str, str]) -> None:
        self._backend.set_hints(dict(hints))

    def get_device_transport(self) -> int:
        """A GPU transport handle for Triton kernels; raises on a backend without one (CPU)."""
        return int(self._backend.get_device_transport())

    def get_mem_allocator(self) -> Any:
        """The backend's global memory allocator (``torchcomms.get_mem_allocator``)."""
        return allocator.get_mem_allocator(self._backend_name)

    @property
    def mem_allocator(self) -> Any:
        """Upstream's deprecated alias of ``get_mem_allocator()``."""
        return self.get_mem_allocator()

    def __repr__(self) -> str:
        try:
            where = f"rank={self.get_rank()}/{self.get_size()}"
        except Exception:
            where = "uninitialized"
        state = self._status.state.value
        return (
            f"TorchComm(backend={self._backend_name!r}, name={self._safe_name()!r}, "
            f"{where}, {state})"
        )

    # -- copy semantics: a communicator is a handle, never duplicated ------------------------------
    def __copy__(self) -> TorchComm:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> TorchComm:
        if id(self) in memo:
            return memo[id(self)]
        memo[id(self)] = self
        return self

    # -- sub-communicators -------------------------------------------------------------------------
    def split(
        self,
        ranks: list[int],
        name: str,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchComm | None:
        """A new communicator over ``ranks`` (parent ranks; list order = new rank order).

        Every rank of the new group calls it with the same list; ranks outside any group
        pass ``[]`` and get ``None``.
        """
        c = self._checker("split")
        members = c.split_ranks(ranks)
        if not isinstance(name, str) or not name:
            raise TypeError(f"{c.prefix}name must be a non-empty str")
        op_id, child_timeout = self._begin(
            OpName.split, hook_args.SplitPreHookArgs(members, name), timeout, hints
        )
        child_options = CommOptions()
        child_options.timeout = child_timeout
        child_options.abort_process_on_timeout_or_error = (
            self._options.abort_process_on_timeout_or_error
        )
        child_options.hints = dict(hints or {})
        if not members:
            self._backend.split_outside(name, child_options)
            return None
        child_backend = self._backend.split(members, name, child_options)
        # type(self): a child of a traceable communicator (torchcomms.functional) is one too.
        child = type(self)(self._backend_name, child_backend, self._device, child_options)
        child._set_observers(self._observers)
        for observer in self._observers:
            on_split = getattr(observer, "comm_split", None)
            if on_split is not None:  # e.g. the flight recorder records the split
                on_split(self, child, members, op_id)
        self._run_post_hooks(op_id, hook_args.SplitPostHookArgs(child))
        return child

    # -- lifecycle ---------------------------------------------------------------------------------
    def finalize(self) -> None:
        """Release the communicator; every later call raises.

        After ``abort()`` it releases what is left without waiting for ops stuck in the
        transport, and a release error is logged rather than raised.
        """
        if self._status.state is CommState.FINALIZED:
            raise CommStateError(f"{self._impl_name} already finalized (comm {self._safe_name()})")
        aborted = self._status.state is CommState.ABORTED
        self._run_pre_hooks(OpName.finalize, FINALIZE_OP_ID, hook_args.FinalizePreHookArgs())
        self._status.set(CommState.FINALIZED)
        if aborted:
            try:
                self._backend.finalize()
            except Exception:
                logger.debug(
                    "torchcomms: releasing aborted comm %s raised",
                    self._safe_name(),
                    exc_info=True,
                    extra={"comm": self._safe_name()},
                )
        else:
            self._backend.finalize()
        self._run_post_hooks(FINALIZE_OP_ID, hook_args.FinalizePostHookArgs())

    def abort(self, reason: AbortReason = AbortReason.ABORTED, context: str = "") -> None:
        """Abort the communicator: local, returns at once, any thread.

        The abort hooks run (once), then the backend aborts: every pending op fails with
        ``CommAbortedError`` and later ops are refused with it.  A second call does nothing.
        A backend that cannot abort raises (upstream's "abort not implemented"); the comm
        is then left as it was, and a later call tries again (the hooks do not rerun).
        """
        if not isinstance(reason, AbortReason):
            raise TypeError(f"abort: reason must be an AbortReason, got {type(reason).__name__}")
        with self._abort_lock:
            if self._aborting:
                return
            self._aborting = True
        first_reason = self._abort_info is None
        try:
            self._set_abort_info(reason, str(context))
            self._fire_abort_hooks()
            self._backend.abort()
        except BaseException:
            with self._abort_lock:
                self._aborting = False
                if first_reason:
                    self._abort_info = None
            raise
        self._status.abort()
        self._aborted = True

    def reconfigure(
        self,
        uuid: int,
        init_handles: list[str] | set[str],
        timeout: timedelta | None = None,
        hints: dict[str, str] | None = None,
    ) -> TorchWork:
        """Connect anew over the members ``init_handles`` name (every member's
        ``get_init_handle()``; a list: rank = position, a set: the backend orders them).

        Blocking; on success the comm is ready with its new rank and size, whatever state
        it was in (an error, a revoke or an abort is left behind).  ``uuid`` must be new.
        """
        if self._status.state is CommState.FINALIZED:
            raise CommStateError(f"{self._prefix('reconfigure')}the communicator was finalized")
        timeout = self._resolve_timeout(timeout, "reconfigure", hints)
        self._checkers.clear()  # rank and size may change
        work = self._backend.reconfigure(uuid, init_handles, timeout, hints)
        if isinstance(work, TorchWork):
            work.wait_blocking()
        else:
            work = plugin.as_work(work)
        self._status.revive()
        with self._abort_lock:  # a new incarnation: abort (and its hooks) may run again
            self._aborting = self._aborted = self._abort_hooks_fired = False
            self._abort_info = None
        return work

    # -- recovery ----------------------------------------------------------------------------------
    def revoke(self) -> None:
        """Revoke the communicator (non-collective, ULFM's revoke).

        Every member's pending and later ops raise ``CommRevokedError``: this rank's at
        once, the others' as soon as they wait on a member that knows.  Recover with
        ``shrink`` or ``reconfigure``.
        """
        state = self._status.state
        if state in (CommState.FINALIZED, CommState.UNINITIALIZED, CommState.ABORTED):
            self._status.check(self._prefix("revoke"), self._impl_name)
        self._backend.revoke()

    def shrink(
        self,
        exclude_ranks: list[int] | None = None,
        name: str | None = None,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchComm:
        """A new communicator of the surviving members, ranks contiguous in the old order.

        Collective over the survivors, also after a failure or a revoke (ULFM's shrink).
        ``exclude_ranks=None``: they agree on who failed, also if a member dies meanwhile;
        a list: those ranks are left out too.  ``name`` defaults to this comm's name.
        """
        prefix = self._prefix("shrink")
        state = self._status.state
        if state in (CommState.FINALIZED, CommState.UNINITIALIZED):
            self._status.check(prefix, self._impl_name)
        size, rank = self.get_size(), self.get_rank()
        excluded: list[int] | None = None
        if exclude_ranks is not None:
            if not isinstance(exclude_ranks, (list, tuple)) or not all(
                isinstance(r, int) and not isinstance(r, bool) for r in exclude_ranks
            ):
                raise TypeError(f"{prefix}exclude_ranks must be a list of int ranks or None")
            bad = [r for r in exclude_ranks if not 0 <= r < size]
            if bad:
                raise ValueError(
                    f"{prefix}Invalid rank {bad[0]} in exclude_ranks. "
                    f"Valid ranks are 0 to {size - 1}"
                )
            if rank in exclude_ranks:
                raise ValueError(
                    f"{prefix}exclude_ranks holds this rank ({rank}): "
                    "excluded ranks do not call shrink"
                )
            excluded = sorted(set(exclude_ranks))
        if name is None:
            name = self.get_name()
        elif not isinstance(name, str) or not name:
            raise TypeError(f"{prefix}name must be a non-empty str")
        child_options = CommOptions()
        child_options.timeout = self._resolve_timeout(timeout, "shrink", hints)
        child_options.abort_process_on_timeout_or_error = (
            self._options.abort_process_on_timeout_or_error
        )
        # Unlike split's, a shrunk comm keeps the parent's settings (transport, ...).
        child_options.hints = {**self._options.hints, **(hints or {})}
        child_backend, members = self._backend.shrink(excluded, name, child_options)
        child = type(self)(self._backend_name, child_backend, self._device, child_options)
        child._set_observers(self._observers)
        op_id = _next_op_id()
        for observer in self._observers:
            on_split = getattr(observer, "comm_split", None)
            if on_split is not None:  # the flight recorder follows the new comm
                on_split(self, child, members, op_id)
        return child

    def new_window(self, tensor: torch.Tensor | None = None) -> Any:
        """A one-sided window on this comm (``torchcomms.comm.window``); with ``tensor``, registered.

        Every rank creates its windows in the same order (a window is matched across ranks
        by that order); with ``tensor`` the call is collective (``tensor_register``).
        """
        self._checker("new_window")
        op_id, _ = self._begin(OpName.new_window, hook_args.NewWindowPreHookArgs(), None, None)
        impl = self._backend.new_window(tensor)
        window = impl
        if isinstance(impl, WindowBackend):  # built-in: the window registers ``tensor`` itself
            window = TorchCommWindow(self, impl)
            if tensor is not None:
                window.tensor_register(tensor)
        self._run_post_hooks(op_id, hook_args.NewWindowPostHookArgs(window))
        return window

    def tensor_register(self, tensor: torch.Tensor) -> None:
        self._backend.tensor_register(tensor)

    def tensor_deregister(self, tensor: torch.Tensor) -> None:
        self._backend.tensor_deregister(tensor)

    def __del__(self) -> None:
        try:
            if self._status.state is not CommState.FINALIZED:
                logger.debug("TorchComm %s was destroyed without finalize()", self._safe_name())
        except Exception:
            pass


def _as_device(device: torch.device | str) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if isinstance(device, str):
        return torch.device(device)
    raise TypeError(f"new_comm: device must be a torch.device, got {type(device).__name__}")


def new_comm(
    backend: str,
    device: torch.device,
    name: str,
    abort_process_on_timeout_or_error: bool | None = None,
    timeout: timedelta | None = None,
    is_high_priority_stream: bool | None = None,
    store: Any = None,
    enable_reconfigure: bool = False,
    hints: dict[str, str] | None = None,
) -> TorchComm:
    """Create a communicator over every rank of the job (collective: all ranks call it)."""
    if not isinstance(backend, str) or not backend:
        raise TypeError(f"new_comm: backend must be a non-empty str, got {backend!r}")
    if not isinstance(name, str) or not name:
        raise TypeError(f"new_comm: name must be a non-empty str, got {name!r}")
    dev = _as_device(device)
    from_c10d = c10d_caller.group_settings()  # PyTorch creating a group through us
    if from_c10d is not None:
        # what the release may not pass: the group's chosen timeout, 2.14's reconfigure mode
        timeout = timeout if timeout is not None else from_c10d.timeout
        enable_reconfigure = bool(enable_reconfigure) or from_c10d.enable_reconfigure
    options = CommOptions()
    options.timeout = config.default_timeout()
    options.abort_process_on_timeout_or_error = config.default_abort_on_error()
    if abort_process_on_timeout_or_error is not None:
        options.abort_process_on_timeout_or_error = bool(abort_process_on_timeout_or_error)
    if timeout is not None:
        if not isinstance(timeout, timedelta):
            raise TypeError(f"new_comm: timeout must be a timedelta, got {type(timeout).__name__}")
        if timeout <= timedelta(0):
            raise ValueError(f"new_comm: timeout must be positive, got {timeout}")
        options.timeout = timeout
    if is_high_priority_stream is not None:
        options.is_high_priority_stream = bool(is_high_priority_stream)
    options.store = store
    options.enable_reconfigure = bool(enable_reconfigure)
    if hints is not None:
        if not isinstance(hints, dict):
            raise TypeError(f"new_comm: hints must be a dict[str, str], got {type(hints).__name__}")
        options.hints = {str(k): str(v) for k, v in hints.items()}
    backend_class = registry.get_backend_class(backend)
    impl = backend_class()
    # The one place a plug-in's calling convention is adapted (and a non-backend refused).
    comm_backend = plugin.adapt(impl, f"backend {backend!r}")
    if enable_reconfigure and not comm_backend.supports_reconfigure():
        raise RuntimeError(
            f"[TorchComm]: enable_reconfigure=true is not supported by backend: {backend}"
        )
    comm_backend.check_device(dev)  # before init: no networking for a device it cannot serve
    impl._set_device_and_options(dev, options)
    comm_backend.init(dev, name, options)
    comm = _comm_class(backend, comm_backend, dev, options)
    for factory in list(_default_observer_factories):
        observer = factory(comm)
        if observer is not None:
            comm._add_observer(observer)
    return comm


#: The class ``new_comm`` instantiates: ``TorchComm``, or the traceable subclass that
#: ``torchcomms.functional`` installs when ``TORCHCOMMS_PATCH_FOR_COMPILE=1``.
_comm_class: type[TorchComm] = TorchComm


def _set_comm_class(cls: type[TorchComm]) -> None:
    """Make ``new_comm`` create ``cls`` (a ``TorchComm`` subclass) from now on."""
    global _comm_class
    if not issubclass(cls, TorchComm):
        raise TypeError(f"_set_comm_class: {cls!r} is not a TorchComm subclass")
    _comm_class = cls


ObserverFactory = Callable[[TorchComm], "OpObserver | None"]
_default_observer_factories: list[ObserverFactory] = []


def add_default_observer(factory: ObserverFactory) -> None:
    """Call ``factory(comm)`` for every communicator ``new_comm`` creates from now on.

    Used by always-on tooling (the flight recorder, ``TORCHCOMM_LOG_JSON``): the factory
    returns the observer to attach, or ``None`` to leave that comm alone.
    """
    if factory not in _default_observer_factories:
        _default_observer_factories.append(factory)
