"""The CPU backend, registered as ``gloo``: collectives over torch's ``ProcessGroupGloo``.

The process group is built directly from the communicator's store (no global
``init_process_group``).  Ops run through an ``OpExecutor`` (issue order, async on
one thread).  Reductions gloo lacks (AVG, PREMUL_SUM) and the variable-size
collectives are composed here from gloo primitives.  Point-to-point ops are posted
to gloo without blocking and waited on by their work, so mutually dependent
send/recv pairs cannot deadlock.  A transport failure (timeout, dead peer)
poisons the communicator: later ops fail fast with the original cause.
"""

# Native backends take an extra OpOptions argument (see backends/base.py), on purpose.
# mypy: disable-error-code="override"

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch._C._distributed_c10d as c10d

from torchcomms import bootstrap, config
from torchcomms.backends import cpu_hier, cpu_shm
from torchcomms.backends._host import CPU_DTYPES, finish_average, host_flat
from torchcomms.backends._host import on_host as _on_host
from torchcomms.backends._host import overlaps as _overlaps
from torchcomms.backends.base import TorchCommBackend
from torchcomms.bootstrap import CommStore
from torchcomms.errors import (
    CollectiveMismatchError,
    CommError,
    CommStateError,
    CommTimeoutError,
    CommValidationError,
    PeerFailureError,
)
from torchcomms.executor import Completion, OpExecutor
from torchcomms.transport import shm_segment
from torchcomms.transport.shm_channel import (
    STATE_FAILED,
    STATE_FINALIZED,
    ShmWaitError,
    ranks_text,
)
from torchcomms.types import CommOptions, OpOptions, P2POp, P2POpType, RedOpType, ReduceOp
from torchcomms.work import AsyncWork, CompletedWork, TorchWork

logger = logging.getLogger("torchcomms.backends.cpu")

SUPPORTED_DTYPES = frozenset(CPU_DTYPES)

_C10D_OPS = {
    RedOpType.SUM: c10d.ReduceOp.SUM,
    RedOpType.PRODUCT: c10d.ReduceOp.PRODUCT,
    RedOpType.MIN: c10d.ReduceOp.MIN,
    RedOpType.MAX: c10d.ReduceOp.MAX,
    RedOpType.BAND: c10d.ReduceOp.BAND,
    RedOpType.BOR: c10d.ReduceOp.BOR,
    RedOpType.BXOR: c10d.ReduceOp.BXOR,
    RedOpType.AVG: c10d.ReduceOp.SUM,
    RedOpType.PREMUL_SUM: c10d.ReduceOp.SUM,
}

# On bool data a sum or max is a logical or, a product or min a logical and.
_BOOL_OPS = {
    RedOpType.SUM: c10d.ReduceOp.MAX,
    RedOpType.MAX: c10d.ReduceOp.MAX,
    RedOpType.BOR: c10d.ReduceOp.MAX,
    RedOpType.PRODUCT: c10d.ReduceOp.MIN,
    RedOpType.MIN: c10d.ReduceOp.MIN,
    RedOpType.BAND: c10d.ReduceOp.MIN,
    RedOpType.BXOR: c10d.ReduceOp.BXOR,
}

_TIMEOUT_MARKERS = ("timed out", "timeout")


# gloo tags are 32-bit: sequence numbers and user tags wrap within 2**30 (even / odd halves).
_TAG_SPAN = 2**30


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


_PEER_MARKERS = (
    "connection closed by peer",
    "connection reset",
    "pair closure",
    "broken pipe",
    "connection refused",
    "socket closed",
)


def _c10d_op(op: ReduceOp, dtype: torch.dtype) -> Any:
    if dtype is torch.bool:
        return _BOOL_OPS[op.type]
    return _C10D_OPS[op.type]


# Live communicators, released at interpreter exit: a ProcessGroupGloo destroyed during
# interpreter teardown can abort the process ("terminate called without an active exception").
_live: weakref.WeakSet[TorchCommGloo] = weakref.WeakSet()


@atexit.register
def _release_live_comms() -> None:
    for comm in list(_live):
        comm._release(join_timeout_s=1.0)


class _Deadline:
    """The absolute deadline of one op; composite ops split it across their gloo calls."""

    __slots__ = ("end",)

    def __init__(self, timeout: timedelta) -> None:
        self.end = time.monotonic() + timeout.total_seconds()

    def remaining(self) -> timedelta:
        left = self.end - time.monotonic()
        # gloo treats 0 as "no timeout"; never hand it a non-positive value.
        return timedelta(seconds=max(left, 0.001))

    def arm(self, gloo_options: Any) -> timedelta:
        """Give one gloo call the time left; the same budget then bounds its wait."""
        left = self.remaining()
        gloo_options.timeout = left
        return left


class TorchCommGloo(TorchCommBackend):
    """CPU communicator over gloo (TCP); see the module docstring for the concurrency model."""

    _native = True
    _self_p2p_allowed = False

    def __init__(self) -> None:
        super().__init__()
        self._name = ""
        self._rank = -1
        self._size = -1
        self._pg: Any = None
        self._shm: cpu_shm.ShmOps | None = None
        self._hier: cpu_hier.HierOps | None = None  # several hosts: shm inside, gloo between
        self._store: CommStore | None = None
        self._peers: list[tuple[str, int]] = []  # (host identity, pid) per comm rank
        self._executor: OpExecutor | None = None
        self._poison: BaseException | None = None
        self._poison_lock = threading.Lock()
        self._split_counts: dict[tuple[str, tuple[int, ...]], int] = defaultdict(int)
        self._send_seq: dict[int, int] = defaultdict(int)
        self._recv_seq: dict[int, int] = defaultdict(int)
        self._timeout = timedelta(seconds=600)
        self._hints: dict[str, str] = {}
        self.transport = (
            ""  # how this comm moves bytes, e.g. "tcp (loopback: all ranks on this host)"
        )

    # -- lifecycle -----------------------------------------------------------------------------
    def init(self, device: torch.device, name: str, options: CommOptions) -> None:
        rank, size = bootstrap.query_ranksize()
        persistent = _hint_bool(options.hints, "persistent_store", False)
        store = bootstrap.create_comm_store(
            name, rank, size, options.timeout, options.store, persistent
        )
        self._connect(device, name, options, store, rank, size)

    def _connect(
        self,
        device: torch.device,
        name: str,
        options: CommOptions,
        store: CommStore,
        rank: int,
        size: int,
    ) -> None:
        self._device = device
        self._options = options
        self._name = name
        self._rank = rank
        self._size = size
        self._timeout = options.timeout
        self._hints = dict(options.hints)
        self._store = store
        self._peers = self._exchange_identities(store.store)
        mode = config.transport(options.hints.get("transport"))
        if self._use_shm(mode):
            self._shm = cpu_shm.connect(
                c10d.PrefixStore("shm", store.store),
                rank,
                size,
                [pid for _, pid in self._peers],
                options.hints,
                options.timeout,
                f"comm={name}",
            )
            self.transport = self._shm.describe()
        else:
            gloo_opts = c10d.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            gloo_opts._timeout = options.timeout
            device_desc, gloo_device = self._gloo_device(options.hints)
            gloo_opts._devices = [gloo_device]
            self.transport = f"tcp ({device_desc})"
            self._pg = c10d.ProcessGroupGloo(
                c10d.PrefixStore("gloo", store.store), rank, size, gloo_opts
            )
            if mode != "tcp" and cpu_hier.wanted(self._peers) and not cpu_shm.unsupported_reason():
                # all_reduce/broadcast/barrier: shm inside each host, gloo between hosts.
                self._hier = cpu_hier.connect(
                    store.store,
                    rank,
                    self._peers,
                    options.hints,
                    options.timeout,
                    gloo_device,
                    device_desc,
                    _c10d_op,
                    f"comm={name}",
                )
                self.transport = self._hier.describe()
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

    def _use_shm(self, mode: str) -> bool:
        """Shared memory when every member shares this host (``tcp`` forces gloo)."""
        if mode == "tcp":
            return False
        me = self._peers[self._rank][0]
        local = all(host == me for host, _ in self._peers)
        reason = cpu_shm.unsupported_reason()
        if mode == "shm":
            if reason is not None:
                raise CommError(
                    f"[TorchCommGloo comm={self._name} rank={self._rank}] transport=shm "
                    f"requested but unavailable: {reason}"
                )
            if not local:
                hosts = len({host for host, _ in self._peers})
                raise CommError(
                    f"[TorchCommGloo comm={self._name} rank={self._rank}] transport=shm "
                    f"requested but the members span {hosts} hosts; use auto or tcp"
                )
        return local and reason is None

    def _exchange_identities(self, store: c10d.Store) -> list[tuple[str, int]]:
        """Every member's (host identity, pid), in comm rank order, through the store."""
        store.set(f"host/{self._rank}", f"{bootstrap.host_identity()}\n{os.getpid()}")
        keys = [f"host/{r}" for r in range(self._size)]
        store.wait(keys, self._timeout)
        peers = []
        for key in keys:
            host, _, pid = store.get(key).decode().rpartition("\n")
            peers.append((host, int(pid)))
        return peers

    def _dead_peers(self) -> list[int]:
        """Members on this host whose process is gone (a dead remote shows as a closed socket)."""
        me = self._peers[self._rank][0]
        return [
            r
            for r, (host, pid) in enumerate(self._peers)
            if r != self._rank and host == me and not shm_segment.process_alive(pid)
        ]

    def _gloo_device(self, hints: dict[str, str]) -> tuple[str, Any]:
        """Loopback when every member is on this host, else the configured/default interface."""
        hostname = hints.get("hostname") or config.gloo_hostname()
        interface = hints.get("interface") or config.gloo_interface()
        lazy = True if "lazy" in hints else None
        if hostname or interface:
            return f"hostname={hostname!r} interface={interface!r}", (
                c10d.ProcessGroupGloo.create_device(
                    hostname=hostname or "", interface=interface or "", lazy_init=lazy
                )
            )
        hosts = {host for host, _ in self._peers}
        if hosts == {self._peers[self._rank][0]}:
            return "loopback: all ranks on this host", c10d.ProcessGroupGloo.create_device(
                hostname="127.0.0.1", lazy_init=lazy
            )
        return f"default interface: {len(hosts)} hosts", (
            c10d.ProcessGroupGloo.create_default_device(lazy_init=lazy)
        )

    def finalize(self) -> None:
        self._release(join_timeout_s=self._timeout.total_seconds())

    def _release(self, join_timeout_s: float) -> None:
        """Finish queued ops (bounded), then drop the process group and the store."""
        _live.discard(self)
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.close(join_timeout_s)
        self._pg = None
        hier, self._hier = self._hier, None
        if hier is not None:
            hier.close(STATE_FAILED if self._poison is not None else STATE_FINALIZED)
        shm, self._shm = self._shm, None
        if shm is not None:
            shm.close(STATE_FAILED if self._poison is not None else STATE_FINALIZED)
        if self._store is not None:
            self._store.close()
        self._store = None

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

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
        self._options.timeout = timeout

    def set_hints(self, hints: dict[str, str]) -> None:
        self._hints.update(hints)

    def get_init_handle(self) -> str:
        return f"gloo:{self._rank}:-1:"

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
        self,
        opts: OpOptions,
        async_op: bool,
        body: Callable[[_Deadline], Completion | None],
        peers: Sequence[int] = (),
    ) -> TorchWork:
        """Run ``body`` in issue order, inline (sync) or on the executor (async).

        ``peers`` (point-to-point ops) are named in the error if the op fails.
        """
        executor = self._executor
        if executor is None:
            raise CommStateError(self._prefix(opts) + "TorchCommGloo not initialized")
        timeout = opts.timeout

        # Bytes move outside autograd (as in c10d): no graph, in-place writes to leaves allowed.
        def guarded() -> Completion | None:
            self._check_healthy(opts)
            deadline = _Deadline(timeout)
            try:
                with torch.no_grad():
                    completion = body(deadline)
            except BaseException as exc:
                raise self._translate(exc, opts, peers) from exc
            if completion is None:
                return None

            def finish() -> None:
                try:
                    with torch.no_grad():
                        completion()
                except BaseException as exc:
                    raise self._translate(exc, opts, peers) from exc

            return finish

        if not async_op:
            if executor._unfinished:
                executor.drain(timeout.total_seconds())
            self._check_healthy(opts)
            grad = torch.is_grad_enabled()
            if grad:
                torch._C._set_grad_enabled(False)
            try:
                completion = body(_Deadline(timeout))
                if completion is not None:
                    completion()
            except BaseException as exc:
                raise self._translate(exc, opts, peers) from exc
            finally:
                if grad:
                    torch._C._set_grad_enabled(True)
            return CompletedWork()
        self._check_healthy(opts)  # fail at issue when already poisoned; guarded() re-checks
        work = AsyncWork(self._prefix(opts).rstrip(": "), timeout.total_seconds())
        return executor.submit(guarded, work)

    def _prefix(self, opts: OpOptions) -> str:
        op_id = f" op_id={opts.op_id}" if opts.op_id is not None else ""
        return f"[TorchCommGloo comm={self._name} rank={self._rank}] {opts.op_name}{op_id}: "

    def _check_healthy(self, opts: OpOptions) -> None:
        poison = self._poison
        if poison is not None:
            raise type(poison)(
                self._prefix(opts) + f"communicator is unusable after an earlier failure: {poison}"
            ) from poison

    def _translate(
        self, exc: BaseException, opts: OpOptions, peers: Sequence[int] = ()
    ) -> BaseException:
        """Turn a gloo error into a typed error naming comm, op, op_id (and the p2p peers).

        A timeout or a broken connection poisons the communicator.
        """
        if isinstance(exc, CommError):
            return exc
        if isinstance(exc, ShmWaitError):
            return self._poisoned(self._shm_error(exc, opts))
        if not isinstance(exc, RuntimeError):
            return exc
        text = str(exc)
        lowered = text.lower()
        error: CommError
        timed_out = any(m in lowered for m in _TIMEOUT_MARKERS)
        if not timed_out and not any(m in lowered for m in _PEER_MARKERS):
            return CommError(self._prefix(opts) + text.strip())
        dead = self._dead_peers()
        if dead:
            # A dead local peer explains a broken connection or a timeout: say so, by rank.
            error = PeerFailureError(
                self._prefix(opts) + f"{ranks_text(dead)} died (process gone) ({text.strip()})"
            )
        elif timed_out:
            waiting = f" waiting for {ranks_text(peers)}" if peers else ""
            error = CommTimeoutError(
                self._prefix(opts)
                + f"timed out after {opts.timeout.total_seconds():g} s{waiting} ({text.strip()})"
            )
        else:
            who = ranks_text(peers) if peers else "a peer"
            error = PeerFailureError(self._prefix(opts) + f"{who} failed ({text.strip()})")
        return self._poisoned(error)

    def _shm_error(self, exc: ShmWaitError, opts: OpOptions) -> CommError:
        prefix = self._prefix(opts)
        if exc.kind == "timeout":
            return CommTimeoutError(
                prefix + f"timed out after {opts.timeout.total_seconds():g} s {exc}"
            )
        if exc.kind == "mismatch":
            return CollectiveMismatchError(prefix + str(exc))
        return PeerFailureError(prefix + str(exc))  # dead, peer_failed

    def _poisoned(self, error: CommError) -> CommError:
        """Record the first failure; shm peers see this rank's failed state and stop waiting."""
        with self._poison_lock:
            if self._poison is None:
                self._poison = error
                shm = self._shm
                if shm is not None:
                    shm.chan.set_state(STATE_FAILED)
                hier = self._hier
                if hier is not None:
                    hier.fail()
        return error

    def _pg_checked(self) -> Any:
        pg = self._pg
        if pg is None:
            raise CommStateError(f"[TorchCommGloo comm={self._name}] TorchCommGloo not initialized")
        return pg

    # -- reductions ----------------------------------------------------------------------------
    @staticmethod
    def _premultiply(tensor: torch.Tensor, op: ReduceOp) -> None:
        if op.type is RedOpType.PREMUL_SUM:
            tensor.mul_(op.factor_value())

    def _allreduce_inplace(self, tensor: torch.Tensor, op: ReduceOp, deadline: _Deadline) -> None:
        pg = self._pg_checked()
        o = c10d.AllreduceOptions()
        o.reduceOp = _c10d_op(op, tensor.dtype)
        left = deadline.arm(o)
        self._premultiply(tensor, op)
        pg.allreduce([tensor], o).wait(left)
        finish_average(tensor, op, self._size)

    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp, async_op: bool, options: OpOptions
    ) -> TorchWork:
        shm = self._shm
        if shm is not None:
            return self._run(options, async_op, lambda d: shm.all_reduce(tensor, op, d.end))
        hier = self._hier
        if hier is not None:
            return self._run(options, async_op, lambda d: hier.all_reduce(tensor, op, d.end))

        def body(deadline: _Deadline) -> None:
            if tensor.numel() == 0:
                return
            with _on_host(tensor) as host:
                self._allreduce_inplace(host, op, deadline)

        return self._run(options, async_op, body)

    def reduce(
        self, tensor: torch.Tensor, root: int, op: ReduceOp, async_op: bool, options: OpOptions
    ) -> TorchWork:
        shm = self._shm
        if shm is not None:
            return self._run(options, async_op, lambda d: shm.reduce(tensor, root, op, d.end))

        def body(deadline: _Deadline) -> None:
            if tensor.numel() == 0:
                return
            with _on_host(tensor) as host:
                self._reduce_into(host, root, op, deadline)

        return self._run(options, async_op, body)

    def _reduce_into(
        self, tensor: torch.Tensor, root: int, op: ReduceOp, deadline: _Deadline
    ) -> None:
        pg = self._pg_checked()
        o = c10d.ReduceOptions()
        o.reduceOp = _c10d_op(op, tensor.dtype)
        o.rootRank = root
        left = deadline.arm(o)
        self._premultiply(tensor, op)
        pg.reduce([tensor], o).wait(left)
        if self._rank == root:
            finish_average(tensor, op, self._size)

    def broadcast(
        self, tensor: torch.Tensor, root: int, async_op: bool, options: OpOptions
    ) -> TorchWork:
        shm = self._shm
        if shm is not None:
            return self._run(options, async_op, lambda d: shm.broadcast(tensor, root, d.end))
        hier = self._hier
        if hier is not None:
            return self._run(options, async_op, lambda d: hier.broadcast(tensor, root, d.end))

        def body(deadline: _Deadline) -> None:
            if tensor.numel() == 0:
                return
            with _on_host(tensor) as host:
                self._broadcast(host, root, deadline)

        return self._run(options, async_op, body)

    def _broadcast(self, tensor: torch.Tensor, root: int, deadline: _Deadline) -> None:
        pg = self._pg_checked()
        o = c10d.BroadcastOptions()
        o.rootRank = root
        left = deadline.arm(o)
        pg.broadcast([tensor], o).wait(left)

    # -- gathers -------------------------------------------------------------------------------
    def all_gather(
        self,
        tensor_list: list[torch.Tensor],
        tensor: torch.Tensor,
        async_op: bool,
        options: OpOptions,
    ) -> TorchWork:
        shm = self._shm
        if shm is not None:
            return self._run(
                options, async_op, lambda d: shm.all_gather_list(tensor_list, tensor, d.end)
            )

        def body(deadline: _Deadline) -> None:
            if tensor.numel() == 0:
                return
            flat = torch.empty(self._size * tensor.numel(), dtype=tensor.dtype)
            self._all_gather_flat(flat, tensor, deadline)
            for i, out in enumerate(tensor_list):
                out.copy_(flat[i * tensor.numel() : (i + 1) * tensor.numel()].view(out.shape))

        return self._run(options, async_op, body)

    def _all_gather_flat(
        self, flat: torch.Tensor, tensor: torch.Tensor, deadline: _Deadline
    ) -> None:
        pg = self._pg_checked()
        o = c10d.AllgatherOptions()
        left = deadline.arm(o)
        src = tensor.detach().to("cpu").reshape(-1)
        pg._allgather_base(flat, src, o).wait(left)

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool, options: OpOptions
    ) -> TorchWork:
        shm = self._shm
        if shm is not None:
            return self._run(options, async_op, lambda d: shm.all_gather_flat(output, input, d.end))

        def body(deadline: _Deadline) -> None:
            if input.numel() == 0:
                return
            with _on_host(output) as host_out:
                self._all_gather_flat(host_out.view(-1), input, deadline)

        return self._run(options, async_op, body)

    def all_gather_v(
        self,
        tensor_list: list[torch.Tensor],
        tensor: torch.Tensor,
        async_op: bool,
        options: OpOptions,
    ) -> TorchWork:
        shm = self._shm
        if shm is not None:
            return self._run(
                options, async_op, lambda d: shm.all_gather_v(tensor_list, tensor, d.end)
            )

        def body(deadline: _Deadline) -> None:
            for root in range(self._size):
                target = tensor_list[root]
                if root == self._rank:
                    target.copy_(tensor.view(target.shape))
                if target.numel() == 0:
                    continue
                with _on_host(target) as host:
                    self._broadcast(host, root, deadline)

        return self._run(options, async_op, body)

    def gather(
        self,
        output_tensor_list: list[torch.Tensor],
        input_tensor: torch.Tensor,
        root: int,
        async_op: bool,
        options: OpOptions,
    ) -> TorchWork:
        shm = self._shm
        if shm is not None:
            return self._run(
                options,
                async_op,
                lambda d: shm.gather(output_tensor_list, input_tensor, root, d.end),
            )

        def body(deadline: _Deadline) -> None:
            if input_tensor.numel() == 0:
                return
            self._gather(output_tensor_list, input_tensor, root, deadline)

        return self._run(options, async_op, body)

    def _gather(
        self,
        outputs: Sequence[torch.Tensor],
        input_tensor: torch.Tensor,
        root: int,
        deadline: _Deadline,
    ) -> None:
        pg = self._pg_checked()
        o = c10d.GatherOptions()
        o.rootRank = root
        left = deadline.arm(o)
        src = input_tensor.detach().to("cpu").contiguous()
        if self._rank == root:
            staging = [torch.empty_like(src) for _ in range(self._size)]
            pg.gather([staging], [src], o).wait(left)
            for out, got in zip(outputs, staging, strict=True):
                out.copy_(got.view(out.shape))
        else:
            pg.gather([], [src], o).wait(left)

    def gather_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        root: int,
        async_op: bool,
        options: OpOptions,
    ) -> TorchWork:
        shm = self._shm
        if shm is not None:

            def shm_body(d: _Deadline) -> None:
                assert shm is not None
                outs = list(output.view(-1).chunk(self._size)) if self._rank == root else []
                shm.gather(outs, input, root, d.end)

            return self._run(options, async_op, shm_body)

        def body(deadline: _Deadline) -> None:
            if input.numel() == 0:
                return
            outs = list(output.view(-1).chunk(self._size)) if self._rank == root else []
            self._gather(outs, input, root, deadline)

        return self._run(options, async_op, body)

    def scatter(
        self,
        output_tensor: torch.Tensor,
        input_tensor_list: list[torch.Tensor],
        root: int,
        async_op: bool,
        options: OpOptions,
    ) -> TorchWork:
        shm = self._shm
        if shm is not None:
            return self._run(
                options,
                async_op,
                lambda d: shm.scatter(output_tensor, input_tensor_list, root, d.end),
            )

        def body(deadline: _Deadline) -> None:
            if output_tensor.numel() == 0:
                return
            pg = self._pg_checked()
            o = c10d.ScatterOptions()
            o.rootRank = root
            left = deadline.arm(o)
            with _on_host(output_tensor) as host_out:
                if self._rank == root:
                    srcs = [t.detach().to("cpu").contiguous() for t in input_tensor_list]
                    pg.scatter([host_out], [srcs], o).wait(left)
                else:
                    pg.scatter([host_out], [], o).wait(left)

        return self._run(options, async_op, body)

    # -- reduce-scatters -----------------------------------------------------------------------
    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: ReduceOp,
        async_op: bool,
        options: OpOptions,
    ) -> TorchWork:
        shm = self._shm
        if shm is not None:
            return self._run(
                options, async_op, lambda d: shm.reduce_scatter_v(output, input_list, op, d.end)
            )

        def body(deadline: _Deadline) -> None:
            if output.numel() == 0:
                return
            flat = torch.cat([t.detach().to("cpu").reshape(-1) for t in input_list])
            with _on_host(output) as host_out:
                self._reduce_scatter_flat(host_out.view(-1), flat, op, deadline)

        return self._run(options, async_op, body)

    def _reduce_scatter_flat(
        self,
        out: torch.Tensor,
        flat_in: torch.Tensor,
        op: ReduceOp,
        deadline: _Deadline,
    ) -> None:
        pg = self._pg_checked()
        if op.type is RedOpType.PREMUL_SUM:
            flat_in = flat_in * op.factor_value()  # never scale the caller's input in place
        o = c10d.ReduceScatterOptions()
        o.reduceOp = _c10d_op(op, out.dtype)
        left = deadline.arm(o)
        pg._reduce_scatter_base(out, flat_in, o).wait(left)
        finish_average(out, op, self._size)

    def reduce_scatter_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp,
        async_op: bool,
        options: OpOptions,
    ) -> TorchWork:
        shm = self._shm
        if shm is not None:
            return self._run(
                options,
                async_op,
                lambda d: shm.reduce_scatter(output, host_flat(input), op, d.end),
            )

        def body(deadline: _Deadline) -> None:
            if output.numel() == 0:
                return
            src = input.detach().to("cpu").reshape(-1)
            with _on_host(output) as host_out:
                self._reduce_scatter_flat(host_out.view(-1), src, op, deadline)

        return self._run(options, async_op, body)

    def reduce_scatter_v(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: ReduceOp,
        async_op: bool,
        options: OpOptions,
    ) -> TorchWork:
        shm = self._shm
        if shm is not None:
            return self._run(
                options, async_op, lambda d: shm.reduce_scatter_v(output, input_list, op, d.end)
            )

        def body(deadline: _Deadline) -> None:
            for root, chunk in enumerate(input_list):
                if chunk.numel() == 0:
                    continue
                scratch = chunk.detach().to("cpu", copy=True).contiguous()
                self._reduce_into(scratch, root, op, deadline)
                if root == self._rank:
                    output.copy_(scratch.view(output.shape))

        return self._run(options, async_op, body)

    # -- all-to-all ----------------------------------------------------------------------------
    def _alltoall_flat(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        deadline: _Deadline,
    ) -> None:
        pg = self._pg_checked()
        if _overlaps(out, inp):
            inp = inp.clone()  # gloo reads the input while writing the output: never alias
        o = c10d.AllToAllOptions()
        left = deadline.arm(o)
        pg.alltoall_base(out, inp, out_splits, in_splits, o).wait(left)

    def all_to_all_single(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool, options: OpOptions
    ) -> TorchWork:
        shm = self._shm
        if shm is not None:
            return self._run(
                options, async_op, lambda d: shm.all_to_all_flat(output, input, [], [], d.end)
            )

        def body(deadline: _Deadline) -> None:
            if input.numel() == 0:
                return
            with _on_host(output) as host_out:
                src = input.detach().to("cpu").reshape(-1)
                self._alltoall_flat(host_out.view(-1), src, [], [], deadline)

        return self._run(options, async_op, body)

    def all_to_all_v_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        async_op: bool,
        options: OpOptions,
    ) -> TorchWork:
        def body(deadline: _Deadline) -> None:
            out_row = output[0].numel() if output.dim() > 0 and output.shape[0] > 0 else 1
            in_row = input[0].numel() if input.dim() > 0 and input.shape[0] > 0 else 1
            out_elems = [s * out_row for s in output_split_sizes]
            in_elems = [s * in_row for s in input_split_sizes]
            shm = self._shm
            if shm is not None:
                out_part = output.view(-1)[: sum(out_elems)]
                in_part = input.reshape(-1)[: sum(in_elems)]
                shm.all_to_all_flat(out_part, in_part, out_elems, in_elems, deadline.end)
                return
            with _on_host(output) as host_out:
                flat_out = host_out.view(-1)
                flat_in = input.detach().to("cpu").reshape(-1)
                self._alltoall_flat(
                    flat_out[: sum(out_elems)],
                    flat_in[: sum(in_elems)],
                    out_elems,
                    in_elems,
                    deadline,
                )

        return self._run(options, async_op, body)

    def all_to_all(
        self,
        output_tensor_list: list[torch.Tensor],
        input_tensor_list: list[torch.Tensor],
        async_op: bool,
        options: OpOptions,
    ) -> TorchWork:
        def body(deadline: _Deadline) -> None:
            in_elems = [t.numel() for t in input_tensor_list]
            out_elems = [t.numel() for t in output_tensor_list]
            if sum(in_elems) == 0 and sum(out_elems) == 0:
                return
            dtype = input_tensor_list[0].dtype
            flat_in = torch.cat([t.detach().to("cpu").reshape(-1) for t in input_tensor_list])
            flat_out = torch.empty(sum(out_elems), dtype=dtype)
            shm = self._shm
            if shm is not None:
                shm.all_to_all_flat(flat_out, flat_in, out_elems, in_elems, deadline.end)
            else:
                self._alltoall_flat(flat_out, flat_in, out_elems, in_elems, deadline)
            offset = 0
            for out, n in zip(output_tensor_list, out_elems, strict=True):
                out.copy_(flat_out[offset : offset + n].view(out.shape))
                offset += n

        return self._run(options, async_op, body)

    def barrier(self, async_op: bool, options: OpOptions) -> TorchWork:
        shm = self._shm
        if shm is not None:
            return self._run(options, async_op, lambda d: shm.barrier(d.end))
        hier = self._hier
        if hier is not None:
            return self._run(options, async_op, lambda d: hier.barrier(d.end))

        def body(deadline: _Deadline) -> None:
            pg = self._pg_checked()
            o = c10d.BarrierOptions()
            left = deadline.arm(o)
            pg.barrier(o).wait(left)

        return self._run(options, async_op, body)

    # -- point-to-point ------------------------------------------------------------------------
    def _post(self, op: P2POp, deadline: _Deadline, user_tag: int | None = None) -> Completion:
        """Post one send/recv to gloo without blocking; the completion waits for it.

        Untagged messages between two ranks match in issue order (even gloo tags, from a
        per-peer sequence number); a ``tag`` hint (the c10d bridge's tags) selects an odd
        gloo tag of its own, so differently tagged messages match by tag, as in c10d.
        """
        pg = self._pg_checked()
        tensor = op.tensor
        staged = tensor if tensor.device.type == "cpu" else tensor.detach().to("cpu")
        sending = op.type is P2POpType.SEND
        if user_tag is not None:
            tag = 2 * (user_tag % _TAG_SPAN) + 1
        else:
            seqs = self._send_seq if sending else self._recv_seq
            tag = 2 * (seqs[op.peer] % _TAG_SPAN)
            seqs[op.peer] += 1
        work = pg.send([staged], op.peer, tag) if sending else pg.recv([staged], op.peer, tag)

        def complete() -> None:
            work.wait(deadline.remaining())
            if staged is not tensor and op.type is P2POpType.RECV:
                tensor.copy_(staged)

        return complete

    def _p2p(self, ops: list[P2POp], async_op: bool, options: OpOptions) -> TorchWork:
        user_tag = _tag_hint(options.hints)

        def body(deadline: _Deadline) -> Completion | None:
            live = [op for op in ops if op.tensor.numel() > 0]
            if not live:
                return None
            shm = self._shm
            if shm is not None:
                posted = shm.post(live, user_tag)
                return lambda: shm.complete(posted, deadline.end)
            completions = [self._post(op, deadline, user_tag) for op in live]

            def complete_all() -> None:
                for complete in completions:
                    complete()

            return complete_all

        return self._run(options, async_op, body, peers=[op.peer for op in ops])

    def send(self, tensor: torch.Tensor, dst: int, async_op: bool, options: OpOptions) -> TorchWork:
        return self._p2p([P2POp(P2POpType.SEND, tensor, dst)], async_op, options)

    def recv(self, tensor: torch.Tensor, src: int, async_op: bool, options: OpOptions) -> TorchWork:
        return self._p2p([P2POp(P2POpType.RECV, tensor, src)], async_op, options)

    def batch_op_issue(self, ops: list[P2POp], async_op: bool, options: OpOptions) -> TorchWork:
        return self._p2p(list(ops), async_op, options)


def _hint_bool(hints: dict[str, str], key: str, default: bool) -> bool:
    raw = hints.get(key)
    if raw is None:
        return default
    return config.parse_bool(f"hint {key}", raw)
