"""``_BackendWrapper``: a ``torch.distributed`` process group that runs on a ``TorchComm``.

PyTorch 2.13-2.15 (``TORCH_DISTRIBUTED_USE_TORCHCOMMS=1``) build each process group with
``new_comm(...)`` and wrap the comm with ``_BackendWrapper(comm)``.  ``c10d.Backend`` cannot
be subclassed from Python in 2.13, so the wrapper subclasses ``c10d.ProcessGroup`` on every
release; PyTorch then uses the wrapper as the process group itself, and every c10d call (the
Python API, DDP's reducer, FSDP2, DTensor's functional collectives through the C++
dispatcher) lands on a method below that maps it to the comm (reference §8.1).  On 2.14+
the wrapper also answers c10d's native reconfigure (``dist._reconfigure``), and while a
dispatch mode watches (``CommDebugMode``) its calls go through the dispatcher
(``_c10d.dispatch``).

Modules: this one holds the process group (and its ``options``); ``_c10d.work`` the c10d
``Work`` it returns (``_WorkWrapper``), ``_c10d.args`` the conversions from c10d's calling
conventions (reduce ops, options objects, tensor lists).  Their names are importable here.

Import rule: PyTorch imports this module while ``torch.distributed`` is half-initialised,
so at module level it imports only ``torch``, ``torch._C._distributed_c10d``, the stdlib
and torchcomms modules that obey the same rule (``_c10d.args``, ``_c10d.work``, ``comm``,
``work``).

Concurrency: each c10d call is issued on the calling thread, in call order, like any
TorchComm op.  A ``_WorkWrapper`` completes its future from the TorchWork's done-callback
(on the thread that finished the op), so DDP's ``get_future().then(...)`` chains run
without anyone calling ``wait()``.  Coalescing state (``_start_coalescing`` ..
``_end_coalescing``) belongs to the thread driving the group.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch
from torch._C import _distributed_c10d as c10d

from torchcomms.bridge.args import (
    _aliased,
    _c10d_op,
    _even_splits,
    _is_reduce_op,
    _options,
    _reconfigure_args,
    _reduce_op,
    _single,
    _single_list,
    _tag,
)
from torchcomms.bridge.c10d_work import _WorkWrapper
from torchcomms.bridge.dispatch import seen_by_dispatch_modes
from torchcomms.comm import BatchSendRecv, TorchComm
from torchcomms.runtime.work import TorchWork

logger = logging.getLogger("torchcomms.backend_wrapper")

BACKEND_NAME = "torchcomms"
_MB_TAG_SIZE = 1


_F = TypeVar("_F", bound=Callable[..., Any])


def _outside_autograd(method: _F) -> _F:
    """c10d's collectives never record autograd; with ``TORCHCOMMS_PATCH_FOR_COMPILE=1`` a
    communicator call whose input requires grad would (upstream's eager path), so the ops that
    have a formula run with grad mode off here and return their works as c10d expects.
    (``torch.no_grad`` is looked up per call: torch may still be importing this module.)"""

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return method(*args, **kwargs)

    return cast(_F, run)


class _BackendWrapperOptions(c10d.Backend.Options):
    """The wrapper's ``options``: c10d backend options plus the comm's own settings."""

    def __init__(self, comm: TorchComm) -> None:
        opts = comm.get_options()
        super().__init__(BACKEND_NAME, opts.timeout)
        self.abort_process_on_timeout_or_error = opts.abort_process_on_timeout_or_error
        self.is_high_priority_stream = opts.is_high_priority_stream
        self.store = opts.store
        self.hints = dict(opts.hints)


class _BackendWrapper(c10d.ProcessGroup):
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
        #: ``(rank, size)`` and the C++ twin of ``_c10d.dispatch`` (built on first use).
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
        """``dist.shrink_group``: a c10d gloo backend over the survivors (``_c10d.shrink``)."""
        from torchcomms._c10d import shrink as survivors  # at call time: torch.distributed is whole

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

    def _timeout(self, opts: Any) -> timedelta | None:
        t = getattr(opts, "timeout", None)
        if isinstance(t, timedelta) and t > timedelta(0):
            return t
        return self._default_timeout

    @staticmethod
    def _async(opts: Any) -> bool:
        return bool(getattr(opts, "asyncOp", True))

    def _wrap(
        self,
        works: Sequence[TorchWork],
        result: list[torch.Tensor],
        timeout: timedelta | None,
        finish: Callable[[], None] | None = None,
    ) -> _WorkWrapper:
        self._seq += 1
        wrapped = _WorkWrapper(works, result, timeout, finish)
        if self._coalescing is not None:
            self._coalescing.append(wrapped)
        return wrapped

    # -- collectives ---------------------------------------------------------------------
    # Each method also accepts the binding's convenience overloads, e.g.
    # ``pg.broadcast(tensor, root, timeout)`` or ``pg.allreduce(tensor, op)`` (§7.1 uses them).
    @seen_by_dispatch_modes
    def broadcast(
        self, tensors: Any, opts: Any = None, root: int | None = None, timeout: Any = None
    ) -> _WorkWrapper:
        if isinstance(opts, int):
            opts, root = None, opts
        opts = _options(c10d.BroadcastOptions, opts, timeout, rootRank=root)
        t = _single(tensors, "broadcast")
        timeout = self._timeout(opts)
        work = self._comm.broadcast(t, opts.rootRank, self._async(opts), timeout=timeout)
        return self._wrap([work], [t], timeout)

    @seen_by_dispatch_modes
    @_outside_autograd
    def allreduce(
        self, tensors: Any, opts: Any = None, op: Any = None, timeout: Any = None
    ) -> _WorkWrapper:
        if _is_reduce_op(opts):
            opts, op = None, opts
        opts = _options(c10d.AllreduceOptions, opts, timeout, reduceOp=_c10d_op(op))
        t = _single(tensors, "allreduce")
        timeout = self._timeout(opts)
        work = self._comm.all_reduce(
            t, _reduce_op(opts.reduceOp), self._async(opts), timeout=timeout
        )
        return self._wrap([work], [t], timeout)

    @seen_by_dispatch_modes
    @_outside_autograd
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> _WorkWrapper:
        opts = opts if opts is not None else c10d.AllreduceCoalescedOptions()
        timeout = self._timeout(opts)
        op = _reduce_op(opts.reduceOp)
        works = [self._comm.all_reduce(t, op, True, timeout=timeout) for t in tensors]
        return self._wrap(works, list(tensors), timeout)

    @seen_by_dispatch_modes
    def reduce(
        self,
        tensors: Any,
        opts: Any = None,
        op: Any = None,
        timeout: Any = None,
        root: int | None = None,
    ) -> _WorkWrapper:
        if isinstance(opts, int):
            opts, root = None, opts
        opts = _options(c10d.ReduceOptions, opts, timeout, rootRank=root, reduceOp=_c10d_op(op))
        t = _single(tensors, "reduce")
        timeout = self._timeout(opts)
        work = self._comm.reduce(
            t, opts.rootRank, _reduce_op(opts.reduceOp), self._async(opts), timeout=timeout
        )
        return self._wrap([work], [t], timeout)

    @seen_by_dispatch_modes
    @_outside_autograd
    def allgather(
        self, output_lists: Any, inputs: Any, opts: Any = None, timeout: Any = None
    ) -> _WorkWrapper:
        if isinstance(inputs, torch.Tensor):  # allgather(outputs: list, input: tensor)
            output_lists, inputs = [output_lists], [inputs]
        opts = _options(c10d.AllgatherOptions, opts, timeout)
        t = _single(inputs, "allgather")
        outputs = _single_list(output_lists)
        timeout = self._timeout(opts)
        if _aliased(outputs):
            # Outputs sharing storage cannot be written per rank; stage through one buffer.
            staging = t.new_empty((len(outputs), *t.shape))
            work = self._comm.all_gather_single(
                staging.view(-1), t.contiguous().view(-1), True, timeout=timeout
            )

            def copy_back() -> None:
                for i, out in enumerate(outputs):
                    out.copy_(staging[i])

            return self._wrap([work], outputs, timeout, copy_back)
        work = self._comm.all_gather(outputs, t, self._async(opts), timeout=timeout)
        return self._wrap([work], outputs, timeout)

    @seen_by_dispatch_modes
    @_outside_autograd
    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> _WorkWrapper:
        opts = opts if opts is not None else c10d.AllgatherOptions()
        if len(output_lists) != len(inputs):
            raise RuntimeError(
                f"allgather_coalesced: {len(output_lists)} output lists for {len(inputs)} inputs"
            )
        timeout = self._timeout(opts)
        works = [
            self._comm.all_gather(list(outs), t, True, timeout=timeout)
            for outs, t in zip(output_lists, inputs, strict=True)
        ]
        return self._wrap(works, [o for outs in output_lists for o in outs], timeout)

    @seen_by_dispatch_modes
    @_outside_autograd
    def _allgather_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> _WorkWrapper:
        return self.all_gather_single(output, input, opts)

    @seen_by_dispatch_modes
    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> _WorkWrapper:
        opts = opts if opts is not None else c10d.AllgatherOptions()
        timeout = self._timeout(opts)
        work = self._comm.all_gather_single(output, input, self._async(opts), timeout=timeout)
        return self._wrap([work], [output], timeout)

    @seen_by_dispatch_modes
    @_outside_autograd
    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> _WorkWrapper:
        opts = opts if opts is not None else c10d.AllgatherOptions()
        timeout = self._timeout(opts)
        works = [
            self._comm.all_gather_single(o, i, True, timeout=timeout)
            for o, i in zip(outputs, inputs, strict=True)
        ]
        return self._wrap(works, list(outputs), timeout)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def _rooted(
        self, op: str, options_type: Any, single: Any, lists: Any, opts: Any, timeout: Any
    ) -> tuple[torch.Tensor, list[torch.Tensor], int, Any]:
        """gather's and scatter's arguments: the one tensor every rank passes (``single``:
        a tensor, or c10d's list of one), the root's list (``lists``; empty elsewhere), the
        root and the options (``opts``: the options, or the root as an int)."""
        if isinstance(single, torch.Tensor):
            single, lists = [single], [lists]
        if isinstance(opts, int):
            opts = _options(options_type, None, timeout, rootRank=opts)
        opts = _options(options_type, opts, timeout)
        t = _single(single, op)
        root = opts.rootRank
        return t, _single_list(lists) if self.rank() == root else [], root, opts

    @seen_by_dispatch_modes
    def gather(
        self, output_lists: Any, inputs: Any, opts: Any = None, timeout: Any = None
    ) -> _WorkWrapper:
        # gather(outputs: list, input: tensor, root) as well as c10d's lists
        t, outputs, root, opts = self._rooted(
            "gather", c10d.GatherOptions, inputs, output_lists, opts, timeout
        )
        timeout = self._timeout(opts)
        work = self._comm.gather(outputs, t, root, self._async(opts), timeout=timeout)
        return self._wrap([work], outputs, timeout)

    @seen_by_dispatch_modes
    def scatter(
        self, outputs: Any, input_lists: Any, opts: Any = None, timeout: Any = None
    ) -> _WorkWrapper:
        # scatter(output: tensor, inputs: list, root) as well as c10d's lists
        t, inputs, root, opts = self._rooted(
            "scatter", c10d.ScatterOptions, outputs, input_lists, opts, timeout
        )
        timeout = self._timeout(opts)
        work = self._comm.scatter(t, inputs, root, self._async(opts), timeout=timeout)
        return self._wrap([work], [t], timeout)

    @seen_by_dispatch_modes
    @_outside_autograd
    def reduce_scatter(
        self, outputs: Any, input_lists: Any, opts: Any = None, op: Any = None, timeout: Any = None
    ) -> _WorkWrapper:
        if isinstance(outputs, torch.Tensor):  # reduce_scatter(output: tensor, inputs: list, op)
            outputs, input_lists = [outputs], [input_lists]
        if _is_reduce_op(opts):
            opts, op = None, opts
        opts = _options(c10d.ReduceScatterOptions, opts, timeout, reduceOp=_c10d_op(op))
        t = _single(outputs, "reduce_scatter")
        inputs = _single_list(input_lists)
        timeout = self._timeout(opts)
        work = self._comm.reduce_scatter(
            t, inputs, _reduce_op(opts.reduceOp), self._async(opts), timeout=timeout
        )
        return self._wrap([work], [t], timeout)

    @seen_by_dispatch_modes
    @_outside_autograd
    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> _WorkWrapper:
        return self.reduce_scatter_single(output, input, opts)

    @seen_by_dispatch_modes
    @_outside_autograd
    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> _WorkWrapper:
        opts = opts if opts is not None else c10d.ReduceScatterOptions()
        timeout = self._timeout(opts)
        work = self._comm.reduce_scatter_single(
            output, input, _reduce_op(opts.reduceOp), self._async(opts), timeout=timeout
        )
        return self._wrap([work], [output], timeout)

    @seen_by_dispatch_modes
    @_outside_autograd
    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> _WorkWrapper:
        opts = opts if opts is not None else c10d.ReduceScatterOptions()
        timeout = self._timeout(opts)
        op = _reduce_op(opts.reduceOp)
        works = [
            self._comm.reduce_scatter_single(o, i, op, True, timeout=timeout)
            for o, i in zip(outputs, inputs, strict=True)
        ]
        return self._wrap(works, list(outputs), timeout)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    @seen_by_dispatch_modes
    @_outside_autograd
    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
        timeout: Any = None,
    ) -> _WorkWrapper:
        opts = _options(c10d.AllToAllOptions, opts, timeout)
        timeout = self._timeout(opts)
        if not output_split_sizes and not input_split_sizes:
            work = self._comm.all_to_all_single(output, input, self._async(opts), timeout=timeout)
        else:
            out_sizes = list(output_split_sizes) or _even_splits(output, self.size())
            in_sizes = list(input_split_sizes) or _even_splits(input, self.size())
            work = self._comm.all_to_all_v_single(
                output, input, out_sizes, in_sizes, self._async(opts), timeout=timeout
            )
        return self._wrap([work], [output], timeout)

    all_to_all_single = alltoall_base

    @seen_by_dispatch_modes
    @_outside_autograd
    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> _WorkWrapper:
        opts = opts if opts is not None else c10d.AllToAllOptions()
        timeout = self._timeout(opts)
        work = self._comm.all_to_all(
            list(outputs), list(inputs), self._async(opts), timeout=timeout
        )
        return self._wrap([work], list(outputs), timeout)

    @seen_by_dispatch_modes
    def barrier(self, opts: Any = None, timeout: Any = None) -> _WorkWrapper:
        opts = _options(c10d.BarrierOptions, opts, timeout)
        timeout = self._timeout(opts)
        work = self._comm.barrier(self._async(opts), timeout=timeout)
        return self._wrap([work], [], timeout)

    def monitored_barrier(
        self, timeout: timedelta | None = None, wait_all_ranks: bool = False
    ) -> None:
        """gloo's debugging barrier: rank 0 names the ranks that did not arrive in time."""
        from torchcomms.bridge.monitored_barrier import monitored_barrier

        monitored_barrier(self._comm, timeout or self._default_timeout, wait_all_ranks)

    # -- point-to-point ------------------------------------------------------------------
    @seen_by_dispatch_modes
    def send(self, tensors: Any, dst: int, tag: int = 0) -> _WorkWrapper:
        t = _single(tensors, "send")
        if self._coalesced_batch is not None:
            self._coalesced_batch.send(t, dst)
            return self._wrap([], [t], None)
        work = self._comm.send(t, dst, True, hints=_tag(tag), timeout=self._default_timeout)
        return self._wrap([work], [t], self._default_timeout)

    @seen_by_dispatch_modes
    def recv(self, tensors: Any, src: int, tag: int = 0) -> _WorkWrapper:
        t = _single(tensors, "recv")
        if self._coalesced_batch is not None:
            self._coalesced_batch.recv(t, src)
            return self._wrap([], [t], None)
        work = self._comm.recv(t, src, True, hints=_tag(tag), timeout=self._default_timeout)
        return self._wrap([work], [t], self._default_timeout)

    def recv_anysource(self, tensors: Any, tag: int = 0) -> _WorkWrapper:
        raise RuntimeError(
            "recv_anysource is not supported by torchcomms communicators (receive from a "
            "named source rank instead)"
        )

    # -- coalescing ----------------------------------------------------------------------
    def _start_coalescing(self, device: Any = None) -> None:
        if self._coalescing is not None:
            raise RuntimeError(
                f"[torchcomms {self._group_name}] _start_coalescing: already coalescing"
            )
        self._coalescing = []
        self._coalesced_batch = self._comm.batch_op_create()

    def _end_coalescing(self, device: Any = None) -> _WorkWrapper:
        if self._coalescing is None:
            raise RuntimeError(
                f"[torchcomms {self._group_name}] _end_coalescing without _start_coalescing"
            )
        batch, self._coalesced_batch = self._coalesced_batch, None
        queued, self._coalescing = self._coalescing, None
        works: list[TorchWork] = [w for q in queued for w in q._works]
        if batch is not None and batch.ops:
            works.append(batch.issue(True))
        result = [t for q in queued for t in q._result]
        return self._wrap(works, result, self._default_timeout)

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
