"""``TorchCommWindow``: upstream's one-sided window API, validated once, over a ``WindowBackend``.

``comm.new_window(tensor=None)`` returns one.  Every rank registers a contiguous tensor
(``tensor_register``, collective); then any rank may ``put`` into, or ``get`` from, any
peer's registered tensor at an element offset, ``signal`` a peer and ``wait_signal`` for
a peer's signal.  A signal is ordered after the puts that the same rank issued before it
to the same peer: once ``wait_signal(src)`` returns, ``src``'s earlier puts are visible.

This class checks the arguments (ranks, offsets, sizes, dtypes, registration state) with
errors that name the communicator, rank, op and value, resolves each op's timeout like the
communicator's ops, and tracks async works so that ``tensor_deregister`` refuses to run
under pending ops.  The backend (``backends.window_contract``) moves the bytes; ops run in
the communicator's issue order (async ones on its executor thread).  A window is meant
to be driven by one thread, as its communicator.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Protocol

import torch

from torchcomms.backends.window_contract import WindowBackend
from torchcomms.comm.validation import Checker
from torchcomms.errors import CommStateError, CommValidationError
from torchcomms.runtime.work import TorchWork
from torchcomms.types import OpOptions, TorchCommWindowAttr


class _Comm(Protocol):
    """What a window needs of its ``TorchComm``."""

    def get_rank(self) -> int: ...

    def get_size(self) -> int: ...

    def _checker(self, op: str) -> Checker: ...

    def _resolve_timeout(
        self, timeout: timedelta | None, op: str, hints: Any = None
    ) -> timedelta: ...

    def new_window(self, tensor: torch.Tensor | None = None) -> Any: ...


class TorchCommWindow:
    """A registered buffer per rank, open to one-sided access (module docstring)."""

    def __init__(self, comm: _Comm, backend: WindowBackend) -> None:
        self._comm = comm
        self._backend = backend
        self._registered = False
        self._owning = True
        self._tensor: torch.Tensor | None = None
        self._dtype: torch.dtype | None = None
        self._shape: tuple[int, ...] | None = None
        self._nbytes = 0
        self._pending: list[TorchWork] = []

    # -- registration ------------------------------------------------------------------------
    def tensor_register(self, tensor: torch.Tensor, owning: bool = True) -> None:
        """Collective: make ``tensor`` (contiguous, on the CPU) this rank's window buffer.

        On the CPU backend the tensor is rebound (``Tensor.set_``) onto the window's
        memory, keeping its values: reading it shows what peers put.  Other views of its
        old storage do not follow.
        """
        c = self._comm._checker("tensor_register")
        t = c.tensor(tensor)
        if self._registered:
            raise CommStateError(
                f"{c.prefix}a tensor is already registered with this window; "
                "call tensor_deregister() first"
            )
        if t.device.type != "cpu":
            raise CommValidationError(
                f"{c.prefix}windows of this backend hold CPU tensors (got one on {t.device})"
            )
        if t.requires_grad:
            raise CommValidationError(f"{c.prefix}a window buffer must not require grad")
        opts = self._options("tensor_register", None, None)
        with torch.no_grad():
            self._backend.register(t, bool(owning), opts)
        self._registered = True
        self._owning = bool(owning)
        self._tensor = t if owning else None
        self._dtype = t.dtype
        self._shape = tuple(t.shape)
        self._nbytes = t.numel() * t.element_size()
        self._pending = []

    def tensor_deregister(self) -> None:
        """Collective: release the buffer; refused while this rank's async window ops run."""
        c = self._comm._checker("tensor_deregister")
        if not self._registered:
            raise CommStateError(f"{c.prefix}no tensor is registered with this window")
        pending = [w for w in self._pending if not w.is_completed()]
        if pending:
            raise CommStateError(
                f"{c.prefix}{len(pending)} async window op(s) of this rank are still pending; "
                "wait() for them before deregistering"
            )
        with torch.no_grad():
            self._backend.deregister(self._options("tensor_deregister", None, None))
        self._registered = False
        self._tensor = None
        self._dtype = None
        self._shape = None
        self._nbytes = 0
        self._pending = []

    # -- what is registered --------------------------------------------------------------------
    def get_size(self) -> int:
        """Bytes of this rank's registered buffer (0 when none is registered)."""
        return self._nbytes

    def get_tensor(self) -> torch.Tensor | None:
        """The registered tensor; None when none is, or it was registered non-owning."""
        return self._tensor

    @property
    def dtype(self) -> torch.dtype | None:
        return self._dtype

    @property
    def shape(self) -> tuple[int, ...] | None:
        return self._shape

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def get_attr(self, peer_rank: int) -> TorchCommWindowAttr:
        """``UNIFIED`` for this rank and same-host peers (mapped), ``SEPARATE`` otherwise."""
        c = self._comm._checker("get_attr")
        c.rank_arg("peer_rank", peer_rank)
        return TorchCommWindowAttr(self._backend.access_type(peer_rank))

    def map_remote_tensor(self, rank: int) -> torch.Tensor:
        """A writable view of ``rank``'s registered buffer (this rank or a UNIFIED peer)."""
        c = self._comm._checker("map_remote_tensor")
        c.rank_arg("rank", rank)
        self._require_registered(c)
        if self.get_attr(rank).access_type.name != "WIN_ACCESS_TYPE_UNIFIED":
            raise CommValidationError(
                f"{c.prefix}peer rank {rank} is on another host (access type SEPARATE): its "
                "window cannot be mapped; use get()"
            )
        return self._backend.remote_tensor(rank)

    # -- one-sided operations ------------------------------------------------------------------
    def put(
        self,
        tensor: torch.Tensor,
        dst_rank: int,
        target_offset_nelems: int,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        """Write ``tensor`` into ``dst_rank``'s buffer from element ``target_offset_nelems``."""
        c = self._comm._checker("put")
        t = self._check_access(c, tensor, dst_rank, "dst_rank", target_offset_nelems, async_op)
        opts = self._options("put", hints, timeout)
        return self._track(
            async_op, self._backend.put(t, dst_rank, target_offset_nelems, async_op, opts)
        )

    def get(
        self,
        tensor: torch.Tensor,
        src_rank: int,
        src_offset_nelems: int,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        """Read ``tensor.numel()`` elements of ``src_rank``'s buffer from ``src_offset_nelems``."""
        c = self._comm._checker("get")
        t = self._check_access(c, tensor, src_rank, "src_rank", src_offset_nelems, async_op)
        opts = self._options("get", hints, timeout)
        return self._track(
            async_op, self._backend.get(t, src_rank, src_offset_nelems, async_op, opts)
        )

    def signal(
        self,
        peer_rank: int,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        """Tell ``peer_rank`` one more signal arrived (after this rank's earlier puts to it)."""
        c = self._comm._checker("signal")
        self._check_peer(c, peer_rank, async_op)
        opts = self._options("signal", hints, timeout)
        return self._track(async_op, self._backend.signal(peer_rank, async_op, opts))

    def wait_signal(
        self,
        peer_rank: int,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        """Wait for (and consume) one signal from ``peer_rank``."""
        c = self._comm._checker("wait_signal")
        self._check_peer(c, peer_rank, async_op)
        opts = self._options("wait_signal", hints, timeout)
        return self._track(async_op, self._backend.wait_signal(peer_rank, async_op, opts))

    # -- device-side API: GPU only upstream --------------------------------------------------
    def get_device_window(
        self, signal_count: int = -1, counter_count: int = -1, barrier_count: int = 1
    ) -> int:
        raise RuntimeError("get_device_window is not yet supported by this backend")

    def register_local_buffer(self, tensor: torch.Tensor) -> int:
        raise RuntimeError("register_local_buffer is not supported by this backend (device API)")

    def deregister_local_buffer(self, handle: int) -> None:
        raise RuntimeError("deregister_local_buffer is not supported by this backend (device API)")

    # -- copy semantics (upstream's) ---------------------------------------------------------
    def __copy__(self) -> TorchCommWindow:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> TorchCommWindow:
        if id(self) in memo:
            return memo[id(self)]
        twin = self.clone()
        memo[id(self)] = twin
        if self._tensor is not None and twin._tensor is not None:
            memo[id(self._tensor)] = twin._tensor
        return twin

    def clone(self) -> TorchCommWindow:
        """A new window on the same comm with a clone of the registered tensor (collective)."""
        twin: TorchCommWindow = self._comm.new_window()
        source = self._tensor
        if source is None and self._registered:
            source = self._backend.remote_tensor(self._comm.get_rank())
        if source is not None:
            twin.tensor_register(source.detach().clone())
        return twin

    def __repr__(self) -> str:
        if not self._registered:
            return "TorchCommWindow(unregistered)"
        return f"TorchCommWindow(dtype={self._dtype}, shape={self._shape})"

    # -- helpers -------------------------------------------------------------------------------
    def _options(self, op: str, hints: Any, timeout: timedelta | None) -> OpOptions:
        resolved = self._comm._resolve_timeout(timeout, op, hints)
        return OpOptions(resolved, dict(hints) if hints else {}, op)

    def _track(self, async_op: bool, work: TorchWork) -> TorchWork:
        if async_op:
            self._pending = [w for w in self._pending if not w.is_completed()]
            self._pending.append(work)
        return work

    def _require_registered(self, c: Checker) -> None:
        if not self._registered:
            raise CommStateError(
                f"{c.prefix}no tensor is registered with this window (call tensor_register first)"
            )

    def _check_peer(self, c: Checker, peer: Any, async_op: Any) -> None:
        c.async_op(async_op)
        c.rank_arg("peer_rank", peer)
        self._require_registered(c)

    def _check_access(
        self, c: Checker, tensor: Any, peer: Any, what: str, offset: Any, async_op: Any
    ) -> torch.Tensor:
        c.async_op(async_op)
        t = c.tensor(tensor)
        c.rank_arg(what, peer)
        self._require_registered(c)
        if isinstance(offset, bool) or not isinstance(offset, int):
            raise TypeError(f"{c.prefix}offset must be an int, got {type(offset).__name__}")
        dtype, shape = self._backend.meta(peer)
        if t.dtype != dtype:
            raise CommValidationError(
                f"{c.prefix}tensor dtype {t.dtype} does not match rank {peer}'s window dtype "
                f"{dtype}"
            )
        capacity = 1
        for d in shape:
            capacity *= d
        if offset < 0 or offset + t.numel() > capacity:
            raise CommValidationError(
                f"{c.prefix}elements [{offset}, {offset + t.numel()}) are out of bounds of rank "
                f"{peer}'s window of {capacity} elements"
            )
        return t
