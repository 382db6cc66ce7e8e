"""The CPU backend, registered as ``gloo``: one transport per communicator, chosen at connect.

``TorchCommGloo`` owns what every transport shares: the communicator's store, the
members' identities (host, pid), the op executor (issue order; async ops run on the
comm's one executor thread, sync ops inline on the caller's), deadlines, and turning
transport errors into typed errors that name the comm, op and peers.  Which bytes move
how is one ``CpuOps`` object (``cpu_ops``), picked once in ``_connect`` by
``cpu_transport`` (shm on one host, hierarchical across hosts when some host holds
several members, flat gloo otherwise).  Connecting is collective and names a member that
dies or never arrives (``cpu_connect``): it ends with a rendezvous, so every member gets
a communicator or every member raises.

Each op method is one dispatch to that object.  A timeout, a dead peer or a mismatch is
reported to the communicator's state machine (``report_failure``): later ops fail fast
with the original cause, and shm peers see this rank's failed state and stop waiting.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import weakref
from collections import defaultdict
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch._C._distributed_c10d as c10d

from torchcomms import bootstrap, config
from torchcomms.backends import cpu_connect, cpu_errors, cpu_shm, cpu_transport
from torchcomms.backends._host import CPU_DTYPES
from torchcomms.backends.contract import CommBackend
from torchcomms.backends.cpu_ops import Completion, CpuOps
from torchcomms.backends.cpu_window import CpuWindow, WindowContext
from torchcomms.backends.window_net import WindowNet
from torchcomms.bootstrap import CommStore
from torchcomms.deadline import Deadline
from torchcomms.errors import (
    CommError,
    CommStateError,
    CommTimeoutError,
    CommValidationError,
)
from torchcomms.executor import OpExecutor
from torchcomms.state import CommState
from torchcomms.transport import gloo
from torchcomms.types import CommOptions, OpOptions, P2POp, P2POpType, ReduceOp
from torchcomms.work import AsyncWork, CompletedWork, TorchWork

logger = logging.getLogger("torchcomms.backends.cpu")

SUPPORTED_DTYPES = frozenset(CPU_DTYPES)

#: One op's work on a transport: runs with the op's deadline, may leave a completion.
OpBody = Callable[[Deadline], "Completion | None"]


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


def _hint_bool(hints: dict[str, str], key: str, default: bool) -> bool:
    raw = hints.get(key)
    if raw is None:
        return default
    return config.parse_bool(f"hint {key}", raw)


# Live communicators, released at interpreter exit: a ProcessGroupGloo destroyed during
# interpreter teardown can abort the process ("terminate called without an active exception").
_live: weakref.WeakSet[TorchCommGloo] = weakref.WeakSet()


@atexit.register
def _release_live_comms() -> None:
    for comm in list(_live):
        comm._release(join_timeout_s=1.0)


class TorchCommGloo(CommBackend):
    """CPU communicator; see the module docstring for which thread runs what."""

    def __init__(self) -> None:
        super().__init__()
        self._name = ""
        self._rank = -1
        self._size = -1
        self._ops: CpuOps | None = None
        self._store: CommStore | None = None
        self._peers: list[tuple[str, int]] = []  # (host identity, pid) per comm rank
        self._executor: OpExecutor | None = None
        self._split_counts: dict[tuple[str, tuple[int, ...]], int] = defaultdict(int)
        self._timeout = timedelta(seconds=600)
        self._hints: dict[str, str] = {}
        #: How this comm moves bytes, e.g. "tcp (loopback: all ranks on this host)".
        self.transport = ""
        self._window_count = 0
        self._window_net: WindowNet | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    def init(self, device: torch.device, name: str, options: CommOptions) -> None:
        rank, size = bootstrap.query_ranksize()
        persistent = _hint_bool(options.hints, "persistent_store", False)
        store = bootstrap.create_comm_store(
            name, rank, size, options.timeout, options.store, persistent
        )
        try:
            self._connect(device, name, options, store, rank, size)
        except BaseException:
            # A kept exception must not keep rank 0's store server (and its port) alive.
            store.close()
            self._store = None
            raise

    def _connect(
        self,
        device: torch.device,
        name: str,
        options: CommOptions,
        store: CommStore,
        rank: int,
        size: int,
    ) -> None:
        self._set_device_and_options(device, options)
        self._name = name
        self._rank = rank
        self._size = size
        self._timeout = options.timeout
        self._hints = dict(options.hints)
        self._store = store
        self._peers = cpu_connect.exchange_identities(
            store.store,
            rank,
            size,
            bootstrap.host_identity(),
            Deadline(options.timeout),
            cpu_connect.connect_prefix(name, rank),
        )
        try:
            self._ops = cpu_transport.open_transport(
                config.transport(options.hints.get("transport")),
                store.store,
                name,
                rank,
                self._peers,
                options,
            )
        except CommError as exc:
            if rank == 0 and size > 1:  # members past this step wait for rank 0's verdict
                for step in ("preconnect", "connected"):
                    cpu_connect.publish_failure(store.store, f"{step}/all", exc)
            raise
        try:
            # The last step: a member that died after its transport was up is named by all.
            cpu_connect.rendezvous(
                store.store,
                "connected",
                rank,
                size,
                Deadline(options.timeout),
                cpu_connect.local_pids(self._peers, rank),
                cpu_connect.connect_prefix(name, rank),
                "the final handshake",
            )
        except BaseException:
            self._ops.close(failed=True)
            self._ops = None
            raise
        self.transport = self._ops.describe()
        self._executor = OpExecutor(name)
        _live.add(self)
        logger.debug(
            "gloo communicator %s connected: rank %d of %d over %s",
            name,
            rank,
            size,
            self.transport,
            extra={"comm": name, "rank": rank, "size": size, "transport": self.transport},
        )

    def finalize(self) -> None:
        self._release(join_timeout_s=self._timeout.total_seconds())

    def _release(self, join_timeout_s: float) -> None:
        """Finish queued ops (bounded), then drop the transport and the store."""
        _live.discard(self)
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.close(join_timeout_s)
        net, self._window_net = self._window_net, None
        if net is not None:
            net.close()
        ops, self._ops = self._ops, None
        if ops is not None:
            ops.close(failed=self._status.cause is not None or self._status.aborted)
        if self._store is not None:
            self._store.close()
        self._store = None

    def on_failure(self, error: CommError) -> None:
        ops = self._ops
        if ops is not None:
            # shm peers see this rank's failed state (and who died) and stop waiting for it
            missing = error.ranks if isinstance(error, CommTimeoutError) else ()
            ops.fail(error.dead_ranks, missing, error.ranks)

    # -- abort -----------------------------------------------------------------------------------
    def is_abort_supported(self) -> bool:
        return True

    def is_aborted(self) -> bool:
        return self._status.state is CommState.ABORTED

    def abort(self) -> None:
        """Local and prompt, from any thread: pending ops fail with ``CommAbortedError``.

        The state moves to ``aborted`` first (later ops are refused, errors that surface
        from running ops are reported as aborts), then the executor fails every queued
        and running work at once (their ``wait()`` returns even if the transport does not),
        then the transport makes its waits raise.  Nothing here joins a thread.
        """
        self._status.abort()
        executor = self._executor
        if executor is not None:
            executor.abort()
        ops = self._ops
        if ops is not None:
            try:
                ops.abort()
            except Exception:
                logger.warning(
                    "transport abort of comm %s raised",
                    self._name,
                    exc_info=True,
                    extra={"comm": self._name, "rank": self._rank},
                )

    # -- getters and settings --------------------------------------------------------------------
    def get_rank(self) -> int:
        return self._rank

    def get_size(self) -> int:
        return self._size

    def get_backend_name(self) -> str:
        return "gloo"

    def get_comm_name(self) -> str:
        return self._name

    def get_backend_version(self) -> str:
        return f"gloo (torch {torch.__version__})"

    def supported_dtypes(self) -> frozenset[torch.dtype]:
        return SUPPORTED_DTYPES

    def self_p2p_allowed(self) -> bool:
        return False  # gloo: "Cannot send to self"

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
        self._options.timeout = timeout

    def set_hints(self, hints: dict[str, str]) -> None:
        self._hints.update(hints)

    def get_init_handle(self) -> str:
        return f"gloo:{self._rank}:-1:"

    # -- windows -------------------------------------------------------------------------------
    def new_window(self, tensor: torch.Tensor | None = None) -> CpuWindow:
        """A window matched across ranks by creation order (``cpu_window``); ``TorchComm``
        registers ``tensor`` through the public window (validation first)."""
        self._transport()
        me = self._peers[self._rank][0]
        shm = config.transport(self._hints.get("transport")) != "tcp"
        shm = shm and cpu_shm.unsupported_reason() is None
        ctx = WindowContext(
            rank=self._rank,
            size=self._size,
            pids=[pid for _, pid in self._peers],
            unified=[shm and host == me for host, _ in self._peers],
            run=self._run,
            prefix=self._prefix,
            ops=self._transport,
            net=self._net,
        )
        self._window_count += 1
        return CpuWindow(ctx, self._window_count)

    def _net(self) -> WindowNet:
        """The comm's window server and links, started at the first registration needing them."""
        net = self._window_net
        if net is None:
            assert self._store is not None
            hosts = {host for host, _ in self._peers}
            bind = (
                "127.0.0.1"
                if len(hosts) == 1
                else gloo.reachable_address(self._store.store, self._hints.get("hostname"))
            )
            net = self._window_net = WindowNet(self._rank, bind, self._name)
        return net

    # -- split ---------------------------------------------------------------------------------
    def split(self, ranks: list[int], name: str, options: CommOptions) -> TorchCommGloo:
        assert self._store is not None
        key = (name, tuple(ranks))
        generation = self._split_counts[key]
        self._split_counts[key] += 1
        digest = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:16]
        child_store = c10d.PrefixStore(f"split/{name}/{digest}/{generation}", self._store.store)
        child = TorchCommGloo()
        # The child keeps the parent's store (and rank 0's server) alive while it lives.
        child._connect(
            self._device or torch.device("cpu"),
            name,
            options,
            CommStore(store=child_store, parent=self._store),
            ranks.index(self._rank),
            len(ranks),
        )
        return child

    # -- execution plumbing --------------------------------------------------------------------
    def _run(
        self, opts: OpOptions, async_op: bool, body: OpBody, peers: Sequence[int] = ()
    ) -> TorchWork:
        """Run ``body`` in issue order, inline (sync) or on the executor (async).

        ``peers`` (point-to-point ops) are named in the error if the op fails.  Bytes move
        outside autograd (as in c10d): no graph, in-place writes to leaves allowed.
        """
        executor = self._executor
        if executor is None:
            raise CommStateError(self._prefix(opts) + "TorchCommGloo not initialized")
        timeout = opts.timeout
        status = self._status
        if not async_op:
            if executor._unfinished:
                executor.drain(timeout.total_seconds())
            if status.state is not CommState.READY:
                self.check_usable(self._prefix(opts))
            grad = torch.is_grad_enabled()
            if grad:
                torch._C._set_grad_enabled(False)
            try:
                completion = body(Deadline(timeout))
                if completion is not None:
                    completion()
            except BaseException as exc:
                raise self._translate(exc, opts, peers) from exc
            finally:
                if grad:
                    torch._C._set_grad_enabled(True)
            return CompletedWork()

        def guarded() -> Completion | None:
            if status.state is not CommState.READY:  # an earlier queued op may have failed
                self.check_usable(self._prefix(opts))
            try:
                with torch.no_grad():
                    completion = body(Deadline(timeout))
            except BaseException as exc:
                raise self._translate(exc, opts, peers) from exc
            if completion is None:
                return None
            ops = self._ops
            if ops is not None:
                ops.unattended()  # no thread waits for it yet: the transport may help

            def finish() -> None:
                try:
                    with torch.no_grad():
                        completion()
                except BaseException as exc:
                    raise self._translate(exc, opts, peers) from exc

            return finish

        if status.state is not CommState.READY:
            self.check_usable(self._prefix(opts))
        work = AsyncWork(self._prefix(opts).rstrip(": "), timeout.total_seconds())
        return executor.submit(guarded, work)

    def _prefix(self, opts: OpOptions) -> str:
        op_id = f" op_id={opts.op_id}" if opts.op_id is not None else ""
        return f"[TorchCommGloo comm={self._name} rank={self._rank}] {opts.op_name}{op_id}: "

    def _translate(
        self, exc: BaseException, opts: OpOptions, peers: Sequence[int] = ()
    ) -> BaseException:
        """The typed error for ``exc``; a timeout, dead peer or mismatch fails the comm."""
        dead = self._ops.dead_peers if self._ops is not None else list
        error, failed = cpu_errors.typed_error(exc, self._prefix(opts), opts.timeout, peers, dead)
        if failed and isinstance(error, CommError):
            self.report_failure(error)
        return error

    def _transport(self) -> CpuOps:
        ops = self._ops
        if ops is None:
            raise CommStateError(f"[TorchCommGloo comm={self._name}] TorchCommGloo not initialized")
        return ops

    # -- collectives: one dispatch each --------------------------------------------------------
    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp, async_op: bool, options: OpOptions
    ) -> TorchWork:
        ops = self._transport()
        return self._run(options, async_op, lambda d: ops.all_reduce(tensor, op, d))

    def reduce(
        self, tensor: torch.Tensor, root: int, op: ReduceOp, async_op: bool, options: OpOptions
    ) -> TorchWork:
        ops = self._transport()
        return self._run(options, async_op, lambda d: ops.reduce(tensor, root, op, d))

    def broadcast(
        self, tensor: torch.Tensor, root: int, async_op: bool, options: OpOptions
    ) -> TorchWork:
        ops = self._transport()
        return self._run(options, async_op, lambda d: ops.broadcast(tensor, root, d))

    def all_gather(
        self,
        tensor_list: list[torch.Tensor],
        tensor: torch.Tensor,
        async_op: bool,
        options: OpOptions,
    ) -> TorchWork:
        ops = self._transport()
        return self._run(options, async_op, lambda d: ops.all_gather(tensor_list, tensor, d))

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool, options: OpOptions
    ) -> TorchWork:
        ops = self._transport()
        return self._run(options, async_op, lambda d: ops.all_gather_single(output, input, d))

    def all_gather_v(
        self,
        tensor_list: list[torch.Tensor],
        tensor: torch.Tensor,
        async_op: bool,
        options: OpOptions,
    ) -> TorchWork:
        ops = self._transport()
        return self._run(options, async_op, lambda d: ops.all_gather_v(tensor_list, tensor, d))

    def gather(
        self,
        output_tensor_list: list[torch.Tensor],
        input_tensor: torch.Tensor,
        root: int,
        async_op: bool,
        options: OpOptions,
    ) -> TorchWork:
        ops = self._transport()
        return self._run(
            options, async_op, lambda d: ops.gather(output_tensor_list, input_tensor, root, d)
        )

    def gather_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        root: int,
        async_op: bool,
        options: OpOptions,
    ) -> TorchWork:
        ops = self._transport()
        return self._run(options, async_op, lambda d: ops.gather_single(output, input, root, d))

    def scatter(
        self,
        output_tensor: torch.Tensor,
        input_tensor_list: list[torch.Tensor],
        root: int,
        async_op: bool,
        options: OpOptions,
    ) -> TorchWork:
        ops = self._transport()
        return self._run(
            options, async_op, lambda d: ops.scatter(output_tensor, input_tensor_list, root, d)
        )

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: ReduceOp,
        async_op: bool,
        options: OpOptions,
    ) -> TorchWork:
        ops = self._transport()
        return self._run(options, async_op, lambda d: ops.reduce_scatter(output, input_list, op, d))

    def reduce_scatter_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp,
        async_op: bool,
        options: OpOptions,
    ) -> TorchWork:
        ops = self._transport()
        return self._run(
            options, async_op, lambda d: ops.reduce_scatter_single(output, input, op, d)
        )

    def reduce_scatter_v(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: ReduceOp,
        async_op: bool,
        options: OpOptions,
    ) -> TorchWork:
        ops = self._transport()
        return self._run(
            options, async_op, lambda d: ops.reduce_scatter_v(output, input_list, op, d)
        )

    def all_to_all_single(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool, options: OpOptions
    ) -> TorchWork:
        ops = self._transport()
        return self._run(options, async_op, lambda d: ops.all_to_all_single(output, input, d))

    def all_to_all_v_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        async_op: bool,
        options: OpOptions,
    ) -> TorchWork:
        ops = self._transport()
        return self._run(
            options,
            async_op,
            lambda d: ops.all_to_all_v_single(
                output, input, output_split_sizes, input_split_sizes, d
            ),
        )

    def all_to_all(
        self,
        output_tensor_list: list[torch.Tensor],
        input_tensor_list: list[torch.Tensor],
        async_op: bool,
        options: OpOptions,
    ) -> TorchWork:
        ops = self._transport()
        return self._run(
            options, async_op, lambda d: ops.all_to_all(output_tensor_list, input_tensor_list, d)
        )

    def barrier(self, async_op: bool, options: OpOptions) -> TorchWork:
        ops = self._transport()
        return self._run(options, async_op, ops.barrier)

    # -- point-to-point ------------------------------------------------------------------------
    def _p2p(self, p2p_ops: list[P2POp], async_op: bool, options: OpOptions) -> TorchWork:
        ops = self._transport()
        tag = _tag_hint(options.hints)
        live = [op for op in p2p_ops if op.tensor.numel() > 0]

        def body(deadline: Deadline) -> Completion | None:
            return ops.post(live, tag, deadline) if live else None

        return self._run(options, async_op, body, peers=[op.peer for op in p2p_ops])

    def send(self, tensor: torch.Tensor, dst: int, async_op: bool, options: OpOptions) -> TorchWork:
        return self._p2p([P2POp(P2POpType.SEND, tensor, dst)], async_op, options)

    def recv(self, tensor: torch.Tensor, src: int, async_op: bool, options: OpOptions) -> TorchWork:
        return self._p2p([P2POp(P2POpType.RECV, tensor, src)], async_op, options)

    def batch_op_issue(self, ops: list[P2POp], async_op: bool, options: OpOptions) -> TorchWork:
        return self._p2p(list(ops), async_op, options)
