"""``_BackendWrapper``: a ``torch.distributed`` process group that runs on a ``TorchComm``.

PyTorch 2.13-2.15 (``TORCH_DISTRIBUTED_USE_TORCHCOMMS=1``) build each process group with
``new_comm(...)`` and wrap the comm with ``_BackendWrapper(comm)``.  ``c10d.Backend`` cannot
be subclassed from Python in 2.13, so the wrapper subclasses ``c10d.ProcessGroup`` on every
release; PyTorch then uses the wrapper as the process group itself, and every c10d call (the
Python API, DDP's reducer, FSDP2, DTensor's functional collectives through the C++
dispatcher) lands on one of its methods and runs on the comm (reference §8.1).  On 2.14+
the wrapper also answers c10d's native reconfigure (``dist._reconfigure``).

Modules: this one holds the process group's identity and lifecycle (rank, size, names,
timeouts, options, reconfigure, split, shutdown); ``bridge.c10d_calls`` its c10d calls
(``C10dCalls``, which it inherits), ``bridge.c10d_work`` the c10d ``Work`` they return,
``bridge.args`` the conversions from c10d's calling conventions and ``bridge.dispatch`` what
dispatch modes (``CommDebugMode``) are shown.

Import rule: PyTorch imports this module while ``torch.distributed`` is half-initialised,
so at module level it imports only ``torch``, ``torch._C._distributed_c10d``, the stdlib
and torchcomms modules that obey the same rule (``bridge``, ``comm``, ``runtime.work``).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch
from torch._C import _distributed_c10d as c10d

from torchcomms.bridge.args import (
    _reconfigure_args,
)
from torchcomms.bridge.c10d_calls import C10dCalls
from torchcomms.bridge.c10d_work import _WorkWrapper
from torchcomms.comm import BatchSendRecv, TorchComm

logger = logging.getLogger("torchcomms.backend_wrapper")

BACKEND_NAME = "torchcomms"
_MB_TAG_SIZE = 1


class _BackendWrapperOptions(c10d.Backend.Options):
    """The wrapper's ``options``: c10d backend options plus the comm's own settings."""

    def __init__(self, comm: TorchComm) -> None:
        opts = comm.get_options()
        super().__init__(BACKEND_NAME, opts.timeout)
        self.abort_process_on_timeout_or_error = opts.abort_process_on_timeout_or_error
        self.is_high_priority_stream = opts.is_high_priority_stream
        self.store = opts.store
        self.hints = dict(opts.hints)


class _BackendWrapper(C10dCalls):
    """A ``torch.distributed`` process group whose every call runs on ``comm``."""

    def __init__(self, comm: TorchComm) -> None:
        if not isinstance(comm, TorchComm):
            raise TypeError(f"_BackendWrapper expects a TorchComm, got {type(comm).__name__}")
        # Only the (rank, size) constructor accepts a Python subclass in torch 2.13.
        super().__init__(comm.get_rank(), comm.get_size())  # type: ignore[call-arg]
        self._comm = comm
        self._default_timeout: timedelta | None = None
        self._group_name = comm.get_name()
        self._group_desc = "undefined"
        self._coalescing: list[Any] | None = None
        self._coalesced_batch: BatchSendRecv | None = None
        self._seq = 0
        self._options = _BackendWrapperOptions(comm)
        self._options.group_name = self._group_name
        self._store: c10d.Store | None = None
        #: ``(rank, size)`` and the C++ twin of ``bridge.dispatch`` (built on first use).
        self._twin: tuple[tuple[int, int], c10d.ProcessGroup] | None = None

    # -- identity ------------------------------------------------------------------------
    def get_comm(self) -> TorchComm:
        return self._comm

    def name(self) -> str:
        return self._comm.get_backend()

    _get_backend_name = name

    def get_mem_allocator(self) -> Any:
        raise RuntimeError(
            f"get_mem_allocator: backend {self._comm.get_backend()!r} has no memory allocator "
            "(CPU communicators use ordinary tensors)"
        )

    @property
    def options(self) -> _BackendWrapperOptions:
        return self._options

    @property
    def supports_splitting(self) -> bool:
        return True

    @property
    def supports_shrinking(self) -> bool:
        return True

    def shrink(
        self, ranks_to_exclude: list[int], shrink_flags: int = 0, opts_override: Any = None
    ) -> c10d.Backend:
        """``dist.shrink_group``: a c10d gloo backend over the survivors (``bridge.shrink``)."""
        # at call time: torch.distributed is whole by now
        from torchcomms.bridge import shrink as survivors

        return survivors.shrink(self._comm, list(ranks_to_exclude), int(shrink_flags))

    @property
    def supports_coalescing(self) -> bool:
        return True

    # -- rank and size: live, since reconfigure changes them ---------------------------------
    def rank(self) -> int:
        """The comm's rank now (-1 before the first ``reconfigure`` of a deferred comm)."""
        try:
            return self._comm.get_rank()
        except RuntimeError:  # finalized: what the group was built with
            return int(super().rank())

    def size(self) -> int:
        try:
            return self._comm.get_size()
        except RuntimeError:
            return int(super().size())

    # -- c10d's native reconfigure (torch 2.14+: dist._reconfigure) --------------------------
    @property
    def supports_reconfigure(self) -> bool:
        return self._comm._supports_reconfigure()

    def get_reconfigure_handle(self) -> str:
        """``dist._get_reconfigure_handle``: the comm's init handle, for the peers to exchange."""
        return self._comm.get_init_handle()

    def reconfigure(self, opts: Any) -> _WorkWrapper:
        """``dist._reconfigure``: reconnect over the members ``opts.handles`` name (a list:
        rank = position; a set: the backend orders them).  Blocks until the comm is ready with
        its new rank and size, which ``rank()``/``size()`` then report; the returned work is
        complete.  c10d's own rank maps of *sub*-groups are not rewritten (PyTorch keeps them)."""
        uuid, members, timeout, hints = _reconfigure_args(opts)
        work = self._comm.reconfigure(uuid, members, timeout=timeout, hints=hints)
        self._coalescing = None
        self._coalesced_batch = None
        return self._wrap([work], [], timeout)

    @property
    def group_name(self) -> str:
        return self._group_name

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def _set_group_name(self, name: str) -> None:
        self._group_name = str(name)
        self._options.group_name = self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = str(desc)

    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device(self._comm.get_device().type)]

    def _get_backend(self, device: Any) -> _BackendWrapper:
        wanted = torch.device(device).type
        if wanted != self._comm.get_device().type:
            raise RuntimeError(f"No backend type associated with device type {wanted}")
        return self

    def get_group_store(self) -> c10d.Store:
        """A store shared by the group's ranks: a prefix of the comm's own where it has one."""
        if self._store is None:
            comm_store = getattr(self._comm.get_backend_impl(), "_store", None)
            shared = getattr(comm_store, "store", None)
            self._store = (
                c10d.PrefixStore("c10d_group/", shared)
                if isinstance(shared, c10d.Store)
                else c10d.HashStore()
            )
        return self._store

    def _get_sequence_number_for_group(self) -> int:
        return self._seq

    def _set_sequence_number_for_group(self) -> None:
        """Sequence numbers are the comm's own (op_id); nothing to agree on here."""

    def eager_connect_single_device(self, device: Any) -> None:
        """Communicators connect eagerly in ``new_comm``; nothing is left to do."""

    def _has_hooks(self) -> bool:
        return False

    def _wait_for_pending_works(self) -> None:
        """No completion hooks run on other threads here, so nothing is pending."""

    def _register_on_completion_hook(self, hook: Any) -> None:
        raise RuntimeError(
            "_register_on_completion_hook is not supported by torchcomms process groups "
            "(register a post-hook on pg.get_comm() instead)"
        )

    def merge_remote_group(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("merge_remote_group is not supported by torchcomms process groups")

    def use_pg_for_symm_mem_rendezvous(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "symmetric-memory rendezvous is not supported by torchcomms process groups"
        )

    def set_timeout(self, timeout: timedelta) -> None:
        self._set_default_timeout(timeout)

    # -- timeouts ------------------------------------------------------------------------
    def _set_default_timeout(self, timeout: timedelta) -> None:
        self._default_timeout = timeout
        self._options._timeout = timeout

    def _verify_work_timeout(self, work: Any, timeout: timedelta) -> bool:
        return isinstance(work, _WorkWrapper) and work._timeout_value() == timeout

    # -- sub-groups and lifecycle ----------------------------------------------------------
    def split_group(
        self,
        ranks: list[int],
        timeout: timedelta | None = None,
        opts: Any = None,
        group_name: str | None = None,
        group_desc: str | None = None,
        device_types: Any = None,
    ) -> _BackendWrapper | None:
        """A child group over ``ranks`` (this group's ranks); every rank of this group calls it."""
        name = group_name or f"{self._group_name}:split:{sorted(ranks)}"
        hints = dict(getattr(opts, "hints", None) or {})
        if self.rank() not in ranks:
            self._comm.split([], name, hints=hints)
            return None
        child = self._comm.split(sorted(ranks), name, hints=hints, timeout=timeout)
        assert child is not None
        wrapper = _BackendWrapper(child)
        wrapper._set_group_name(name)
        if group_desc:
            wrapper._set_group_desc(group_desc)
        if timeout is not None:
            wrapper._set_default_timeout(timeout)
        return wrapper

    def shutdown(self) -> None:
        """``destroy_process_group``: finalize the comm; idempotent, errors logged, not raised."""
        comm = self._comm
        if comm._finalized:
            return
        try:
            comm.finalize()
        except Exception:
            logger.warning("torchcomms: finalize of %s failed", self._group_name, exc_info=True)

    def abort(self) -> None:
        """Abort the comm where the backend can; otherwise release it locally."""
        try:
            self._comm.abort()
        except Exception:
            logger.info("torchcomms: abort of %s fell back to finalize", self._group_name)
            self.shutdown()

    def __repr__(self) -> str:
        return (
            f"_BackendWrapper(group={self._group_name!r}, backend={self._comm.get_backend()!r}, "
            f"rank={self.rank()}/{self.size()})"
        )
