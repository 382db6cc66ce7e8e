"""``CpuDispatch``: every op of the CPU backend as one dispatch to its transport.

Each op picks the connected transport's ``CpuOps`` (``_connected_ops``) and hands the op, as a
body taking its deadline, to the execution plumbing here (``_run``: issue order, sync inline
on the caller's thread or async on the comm's executor thread), with one OpenMP thread for
its torch kernels (``runtime.intra_op``).  The hot ops (all_reduce,
broadcast, barrier, send, recv) are written out for their sync fast path; every
other op of the table is the same dispatch to the ``CpuOps`` method of its name
(``_cold_op``).  ``TorchCommGloo`` subclasses it: it connects the transport and names and
types errors (``_prefix``, ``_translate``).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any

import torch

from torchcomms import optable
from torchcomms.backends.contract import CommBackend, fill_ops
from torchcomms.backends.cpu import allgather_p
from torchcomms.backends.cpu.ops import Completion, CpuOps
from torchcomms.errors import CommStateError, CommValidationError
from torchcomms.runtime import intra_op
from torchcomms.runtime.deadline import Deadline
from torchcomms.runtime.executor import OpExecutor
from torchcomms.runtime.state import CommState
from torchcomms.runtime.work import AsyncWork, CompletedWork, TorchWork
from torchcomms.types import OpOptions, P2POp, P2POpType, ReduceOp

#: One op's work on a transport, called as ``body(*args, deadline)`` (a ``CpuOps`` method
#: and the op's arguments: no closure per op); it may leave a completion.
OpBody = Callable[..., "Completion | None"]

_READY = CommState.READY
# The op's copies and reductions on one OpenMP thread (``runtime.intra_op``: why).
_one_thread, _restore_threads = intra_op.one_thread, intra_op.restore
_is_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled


def _tag_hint(hints: dict[str, str]) -> int | None:
    raw = hints.get("tag")
    if raw is None:
        return None
    try:
        tag = int(raw)
    except ValueError:
        raise CommValidationError(f"send/recv hint 'tag' must be an integer, got {raw!r}") from None
    if tag < 0:
        raise CommValidationError(f"send/recv hint 'tag' must be >= 0, got {tag}")
    return tag


def _cold_op(entry: optable.Op) -> Callable[..., TorchWork]:
    """An op without a fast path: its ``CpuOps`` method of the same name, run by ``_run``."""
    method = entry.method

    def dispatch(self: CpuDispatch, *args: Any) -> TorchWork:  # (*op's, async_op, options)
        body = getattr(self._ops or self._connected_ops(), method)
        return self._run(args[-1], args[-2], body, args[:-2])

    dispatch.__name__ = method
    return dispatch


@fill_ops(_cold_op)
class CpuDispatch(CommBackend):
    """A ``CommBackend`` whose ops run on a ``CpuOps`` transport (see the module docstring).

    It owns the connected transport (``_ops``) and the executor that keeps issue order
    (``_executor``), both ``None`` until its subclass connects; the subclass names errors
    (``_prefix``, ``_translate``) and says which transport's ops serve an op (``_connected_ops``)."""

    def __init__(self) -> None:
        super().__init__()
        self._ops: CpuOps | None = None
        self._executor: OpExecutor | None = None

    @abc.abstractmethod
    def _connected_ops(self) -> CpuOps: ...

    @abc.abstractmethod
    def _prefix(self, opts: OpOptions) -> str: ...

    @abc.abstractmethod
    def _translate(
        self, exc: BaseException, opts: OpOptions, peers: Sequence[int]
    ) -> BaseException: ...

    def _run_sync(
        self,
        opts: OpOptions,
        body: OpBody,
        args: tuple[Any, ...],
        peers: Sequence[int] = (),
        grad_free: bool = False,
    ) -> TorchWork:
        """``_run`` of a sync op: ``body(*args, deadline)`` inline, on the caller's thread,
        after any async op still queued (issue order), outside autograd (as in c10d: no
        graph, in-place writes to leaves allowed).  The hot ops call it directly.

        ``grad_free``: the caller checked that no tensor of the op requires grad, so
        autograd records nothing whatever its mode; the mode is then left alone (switching
        it off and on costs 0.3 us, a sixth of this layer on a small op)."""
        executor = self._executor
        if executor is None:
            raise CommStateError(self._prefix(opts) + "TorchCommGloo not initialized")
        if executor._unfinished:
            executor.drain(opts.timeout.total_seconds())
        if self._status.state is not _READY:
            self.check_usable(self._prefix(opts))
        grad = not grad_free and _is_grad_enabled()
        if grad:
            _set_grad_enabled(False)
        threads = _one_thread()
        try:
            completion = body(*args, Deadline(opts.timeout))
            if completion is not None:
                completion()
        except BaseException as exc:
            raise self._translate(exc, opts, peers) from exc
        finally:
            if threads > 1:
                _restore_threads(threads)
            if grad:
                _set_grad_enabled(True)
        return CompletedWork()

    def _run(
        self,
        opts: OpOptions,
        async_op: bool,
        body: OpBody,
        args: tuple[Any, ...] = (),
        peers: Sequence[int] = (),
    ) -> TorchWork:
        """Run ``body(*args, deadline)`` in issue order, inline (sync) or on the executor.

        ``peers`` (p2p) are named in the error if the op fails.  Bytes move outside autograd
        (as in c10d): no graph, in-place writes to leaves allowed."""
        executor = self._executor
        if executor is None:
            raise CommStateError(self._prefix(opts) + "TorchCommGloo not initialized")
        if not async_op:
            return self._run_sync(opts, body, args, peers)
        timeout, status = opts.timeout, self._status

        def guarded() -> Completion | None:
            if status.state is not CommState.READY:  # an earlier queued op may have failed
                self.check_usable(self._prefix(opts))
            try:
                with torch.no_grad():
                    completion = body(*args, Deadline(timeout))
            except BaseException as exc:
                raise self._translate(exc, opts, peers) from exc
            if completion is None:
                return None
            ops = self._ops
            if ops is not None:
                ops.unattended()  # no thread waits for it yet: the transport may help

            def finish() -> None:  # on the thread that waits
                threads = _one_thread()
                try:
                    with torch.no_grad():
                        completion()
                except BaseException as exc:
                    raise self._translate(exc, opts, peers) from exc
                finally:
                    if threads > 1:
                        _restore_threads(threads)

            return finish

        if status.state is not CommState.READY:
            self.check_usable(self._prefix(opts))
        work = AsyncWork(self._prefix(opts).rstrip(": "), timeout.total_seconds())
        return executor.submit(guarded, work)

    # -- the hot collectives (the others: ``_cold_op``) -----------------------------------------
    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp, async_op: bool, options: OpOptions
    ) -> TorchWork:
        ops = self._ops or self._connected_ops()
        if async_op:
            return self._run(options, True, ops.all_reduce, (tensor, op))
        free = not tensor.requires_grad and op._factor is None
        return self._run_sync(options, ops.all_reduce, (tensor, op), (), free)

    def broadcast(
        self, tensor: torch.Tensor, root: int, async_op: bool, options: OpOptions
    ) -> TorchWork:
        ops = self._ops or self._connected_ops()
        if async_op:
            return self._run(options, True, ops.broadcast, (tensor, root))
        free = not tensor.requires_grad
        return self._run_sync(options, ops.broadcast, (tensor, root), (), free)

    def barrier(self, async_op: bool, options: OpOptions) -> TorchWork:
        ops = self._ops or self._connected_ops()
        if async_op:
            return self._run(options, True, ops.barrier)
        return self._run_sync(options, ops.barrier, (), (), True)

    # -- persistent all-gather (``allgather_p``) -------------------------------------------
    def all_gather_p_init(
        self, output: torch.Tensor, options: OpOptions
    ) -> allgather_p.Registration:
        """Collective: the members agree on the registered outputs' size and dtype."""
        ops = self._connected_ops()
        mine = allgather_p.descriptor(output)
        table = torch.empty(2 * ops.size, dtype=torch.int64)
        self._run_sync(options, ops.all_gather_single, (table, mine), (), True)
        allgather_p.check_agreement(table, ops.rank, self._prefix(options))
        return allgather_p.Registration(output)

    def all_gather_p_exec(
        self,
        registration: allgather_p.Registration,
        input: torch.Tensor,
        async_op: bool,
        options: OpOptions,
    ) -> TorchWork:
        output = registration.output
        if output is None:  # TorchComm refuses a freed handle first; a plain backend call may not
            raise CommValidationError(f"{self._prefix(options)}the handle was freed")
        ops = self._connected_ops()
        return self._run(options, async_op, ops.all_gather_single, (output, input))

    def all_gather_p_free(self, registration: allgather_p.Registration) -> None:
        registration.output = None

    # -- point-to-point ------------------------------------------------------------------------
    def _p2p(self, p2p_ops: list[P2POp], async_op: bool, options: OpOptions) -> TorchWork:
        ops = self._connected_ops()
        tag = _tag_hint(options.hints)
        live = [op for op in p2p_ops if op.tensor.numel() > 0]

        def body(deadline: Deadline) -> Completion | None:
            return ops.post(live, tag, deadline) if live else None

        return self._run(options, async_op, body, peers=[op.peer for op in p2p_ops])

    def send(self, tensor: torch.Tensor, dst: int, async_op: bool, options: OpOptions) -> TorchWork:
        if async_op or options.hints or not tensor.numel():
            return self._p2p([P2POp(P2POpType.SEND, tensor, dst)], async_op, options)
        ops = self._ops or self._connected_ops()  # one untagged sync message: the latency path
        free = not tensor.requires_grad
        return self._run_sync(options, ops.transfer, (True, tensor, dst), (dst,), free)

    def recv(self, tensor: torch.Tensor, src: int, async_op: bool, options: OpOptions) -> TorchWork:
        if async_op or options.hints or not tensor.numel():
            return self._p2p([P2POp(P2POpType.RECV, tensor, src)], async_op, options)
        ops = self._ops or self._connected_ops()
        free = not tensor.requires_grad
        return self._run_sync(options, ops.transfer, (False, tensor, src), (src,), free)

    def batch_op_issue(self, ops: list[P2POp], async_op: bool, options: OpOptions) -> TorchWork:
        return self._p2p(list(ops), async_op, options)
