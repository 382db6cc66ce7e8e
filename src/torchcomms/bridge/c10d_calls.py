"""``C10dCalls``: c10d's collective and point-to-point calls, each mapped to one ``TorchComm`` op.

``_BackendWrapper`` (the process group PyTorch holds) inherits these; every c10d call (the
Python API, DDP's reducer, FSDP2, DTensor's functional collectives through the dispatcher)
lands on one of them.  Each method also accepts the binding's convenience overloads, e.g.
``pg.broadcast(tensor, root, timeout)`` or ``pg.allreduce(tensor, op)`` (reference §7.1).
While a dispatch mode watches (``CommDebugMode``), ``seen_by_dispatch_modes`` shows the call
to it (``bridge.dispatch``).

Threads: each call is issued on the calling thread, in call order, like any TorchComm op.
Coalescing state (``_start_coalescing`` .. ``_end_coalescing``) belongs to the thread driving
the group.  Import rule: as ``_backend_wrapper`` (PyTorch imports it half-initialised).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from torch._C import _distributed_c10d as c10d

from torchcomms.bridge.args import (
    _aliased,
    _c10d_op,
    _even_splits,
    _is_reduce_op,
    _options,
    _reduce_op,
    _single,
    _single_list,
    _tag,
)
from torchcomms.bridge.c10d_work import _WorkWrapper
from torchcomms.bridge.dispatch import seen_by_dispatch_modes
from torchcomms.runtime.work import TorchWork

if TYPE_CHECKING:
    from torchcomms.comm import BatchSendRecv, TorchComm

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


class C10dCalls(c10d.ProcessGroup):
    """c10d's calls on a process group over ``_comm`` (see the module docstring)."""

    _comm: TorchComm
    _default_timeout: timedelta | None
    _group_name: str
    _coalescing: list[Any] | None
    _coalesced_batch: BatchSendRecv | None
    _seq: int

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
