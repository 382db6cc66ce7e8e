"""The CPU backend, registered as ``gloo``: one transport per communicator, chosen at connect.

``TorchCommGloo`` owns what every transport shares: the communicator's store, the
members' identities (host, pid), the op executor (issue order; async ops run on the
comm's one executor thread, sync ops inline on the caller's), deadlines, and turning
transport errors into typed errors that name the comm, op and peers.  Which bytes move
how is one ``CpuOps`` object (``cpu.ops``), picked once in ``_connect`` by
``cpu.select`` (shm on one host, hierarchical across hosts when some host holds
several members, flat tcp otherwise).  Connecting is collective and names a member that
dies or never arrives (``cpu.connect``): it ends with a rendezvous, so every member gets
a communicator or every member raises.

Each op method is one dispatch to that object.  A timeout, a dead peer or a mismatch is
reported to the communicator's state machine (``report_failure``): later ops fail fast
with the original cause, and shm peers see this rank's failed state and stop waiting.
"""

from __future__ import annotations

import atexit
import copy
import hashlib
import logging
import sys
import weakref
from collections import defaultdict
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch._C._distributed_c10d as c10d

from torchcomms import config
from torchcomms.backends.cpu import bootstrap, select
from torchcomms.backends.cpu import connect as cpu_connect
from torchcomms.backends.cpu import errors as cpu_errors
from torchcomms.backends.cpu.bootstrap import CommStore
from torchcomms.backends.cpu.dispatch import CpuDispatch
from torchcomms.backends.cpu.hier import leaders
from torchcomms.backends.cpu.ops import CpuOps
from torchcomms.backends.cpu.recovery import agree, reconfigure
from torchcomms.backends.cpu.shm import ops as shm_ops
from torchcomms.backends.cpu.staging import CPU_DTYPES
from torchcomms.backends.cpu.tcp import liveness
from torchcomms.backends.cpu.window.net import WindowNet
from torchcomms.backends.cpu.window.window import CpuWindow, WindowContext
from torchcomms.errors import (
    CommError,
    CommRevokedError,
    CommStateError,
    CommTimeoutError,
    PeerFailureError,
    forget_frames,
)
from torchcomms.runtime.deadline import Deadline
from torchcomms.runtime.executor import OpExecutor
from torchcomms.runtime.state import CommState
from torchcomms.runtime.work import CompletedWork, TorchWork
from torchcomms.transport.gloo import process_group as gloo
from torchcomms.transport.procs import process_alive
from torchcomms.types import CommOptions, OpOptions

logger = logging.getLogger("torchcomms.backends.cpu.backend")

SUPPORTED_DTYPES = frozenset(CPU_DTYPES)


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


class TorchCommGloo(CpuDispatch):
    """CPU communicator; see the module docstring for which thread runs what."""

    def __init__(self) -> None:
        super().__init__()
        self._name = ""
        self._rank = -1
        self._size = -1
        self._store: CommStore | None = None
        self._peers: list[tuple[str, int]] = []  # (host, pid) per rank: ``cpu.hier.members``
        self._split_counts: dict[tuple[str, tuple[int, ...]], int] = defaultdict(int)
        self._split_calls = 0  # every split of this comm, this rank in a group or not
        self._timeout = timedelta(seconds=600)
        self._hints: dict[str, str] = {}
        #: How this comm moves bytes, e.g. "tcp (loopback: all ranks on this host)".
        self.transport = ""
        self._window_count = 0
        self._window_net: WindowNet | None = None
        self._handle_server: reconfigure.Endpoint | None = None  # reconfigure mode
        self._uuids: list[int] = []  # every uuid a reconfigure of this comm was given
        self._shrinks = 0

    # -- lifecycle -----------------------------------------------------------------------------
    def init(self, device: torch.device, name: str, options: CommOptions) -> None:
        select.check_settings(options.hints)  # before any store op (see there)
        if options.enable_reconfigure:  # members connect at reconfigure (cpu_recovery)
            self._set_device_and_options(device, options)
            self._name = name
            self._timeout = options.timeout
            self._hints = dict(options.hints)
            return
        rank, size = bootstrap.query_ranksize()
        persistent = _hint_bool(options.hints, "persistent_store", False)
        store = bootstrap.create_comm_store(
            name, rank, size, options.timeout, options.store, persistent
        )
        try:
            self._connect(device, name, options, store, rank, size)
        except BaseException as exc:
            # A kept exception must not keep rank 0's store server (and its port) alive.
            store.close()
            self._store = None
            lost = cpu_connect.store_lost(exc, name, rank, self._peers)
            if lost is None:
                raise
            raise lost from exc

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
        members = leaders.exchange_identities(
            store.store,
            rank,
            size,
            bootstrap.host_identity(),
            Deadline(options.timeout),
            cpu_connect.connect_prefix(name, rank),
        )
        self._peers = members.peers()
        try:
            self._ops = select.open_ops(
                config.transport(options.hints.get("transport")),
                store.store,
                name,
                rank,
                members,
                options,
            )
        except CommError as exc:
            if rank == 0:
                cpu_connect.publish_transport_failure(store.store, size, exc)
            raise
        self._peers = members.peers()  # with the pids the transport learnt
        try:
            # The last step: a member that died after its transport was up is named by all.
            leaders.rendezvous(
                store.store,
                "connected",
                members,
                Deadline(options.timeout),
                cpu_connect.local_pids(self._peers, rank),
                cpu_connect.connect_prefix(name, rank),
                "the final handshake",
                ack=True,
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
        self._handle_server = None  # its store server stops once no comm store keeps it

    def __del__(self) -> None:
        """Dropped without ``finalize``: release everything now, waiting for nobody (the
        objects of a communicator refer to each other, so the garbage collector, not a
        reference count, gets here; threads and sockets must not wait for it for ever)."""
        if sys.is_finalizing():  # interpreter teardown: ``_release_live_comms`` ran
            return
        try:
            if self._ops is not None or self._store is not None or self._executor is not None:
                self._release(join_timeout_s=0.2, detach=False)  # an idle executor ends at once
            self._handle_server = None
        except Exception:  # nothing may escape a destructor
            logger.debug("releasing a dropped communicator raised", exc_info=True)

    def _release(self, join_timeout_s: float, detach: bool = True) -> None:
        """Finish queued ops (bounded), then drop the transport and the store.

        Every way out of a connected comm (``finalize``, the next ``reconfigure``, exit,
        garbage collection) comes here: rank 0 first waits (bounded by the comm's timeout)
        until the members read the final handshake's verdict from the store it serves
        (``connect.members_detached``; ``detach=False`` skips that)."""
        _live.discard(self)
        store, status, ops = self._store, self._status, self._ops
        healthy = status.cause is None and not status.aborted
        if detach and healthy and self._rank == 0 and ops is not None and store is not None:
            dead_peers = ops.dead_peers
            cpu_connect.members_detached(
                store.store,
                "connected",
                self._size,
                Deadline(self._timeout),
                lambda: len(dead_peers()),
            )
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

        The state moves to ``aborted`` first (later ops are refused, errors from running
        ops are reported as aborts), then the executor fails every queued and running work
        at once (their ``wait()`` returns even if the transport does not), then the
        transport makes its waits raise.  Nothing here joins a thread."""
        self._status.abort()
        executor = self._executor
        if executor is not None:
            executor.abort()
        ops = self._ops
        if ops is not None:
            try:
                ops.abort()
            except Exception:
                extra = {"comm": self._name, "rank": self._rank}
                logger.warning(
                    "transport abort of %s raised", self._name, exc_info=True, extra=extra
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

    def members_store(self) -> c10d.Store | None:
        return self._store.store if self._store is not None else None

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
        self._options.timeout = timeout

    def set_hints(self, hints: dict[str, str]) -> None:
        self._hints.update(hints)

    # -- recovery: reconfigure, shrink, revoke ---------------------------------------------------
    def supports_reconfigure(self) -> bool:
        return True

    def get_init_handle(self) -> str:
        if not self._options.enable_reconfigure:
            return f"gloo:{self._rank}:-1:"
        uuid = self._uuids[-1] if self._rank >= 0 else -1
        return str(self._server().handle(self._rank, uuid))

    def _server(self) -> reconfigure.Endpoint:
        server = self._handle_server
        if server is None:
            where = f"[TorchCommGloo comm={self._name}] get_init_handle: "
            server = reconfigure.endpoint(self._options.store, self._hints, where)
            self._handle_server = server
        return server

    def reconfigure(self, uuid: int, init_handles: Any, timeout: Any, hints: Any) -> TorchWork:
        """Connect the members named by ``init_handles`` (``cpu.recovery.reconfigure``); blocking."""
        where = f"[TorchCommGloo comm={self._name} rank={self._rank}] reconfigure: "
        if not self._options.enable_reconfigure:
            raise CommStateError(
                f"{where}reconfigure needs a communicator made with enable_reconfigure=True"
            )
        server = self._server()
        plan = reconfigure.plan(uuid, init_handles, server, self._name, self._uuids, where)
        options = copy.copy(self._options)
        options.timeout = timeout if timeout is not None else self._timeout
        options.hints = {**self._hints, **(hints or {})}
        self._uuids.append(uuid)
        self._release(join_timeout_s=min(options.timeout.total_seconds(), 5.0))
        self._rank = self._size = -1
        self._status.set(CommState.UNINITIALIZED)
        deadline = Deadline(options.timeout)
        store, rank = reconfigure.meet(server, plan, deadline, where)
        self._connect(
            self._device or torch.device("cpu"),
            self._name,
            options,
            CommStore(store=store, keep=server),
            rank,
            plan.size,
        )
        self._status.revive()
        return CompletedWork()

    def shrink(
        self, exclude: list[int] | None, name: str, options: CommOptions
    ) -> tuple[TorchCommGloo, list[int]]:
        """A new comm of the members not excluded and not failed, agreed on (``cpu.recovery.agree``)."""
        where = f"[TorchCommGloo comm={self._name} rank={self._rank}] shrink: "
        assert self._store is not None
        known = set(exclude or ())
        cause = self._status.cause
        if cause is not None:
            known.update(cause.dead_ranks)  # gone for sure; the agreement finds the rest
        if self._store.durable is None and 0 in known:
            raise CommError(
                f"{where}rank 0 served this communicator's store and failed; to shrink "
                "past it, create the communicator with store= (or TORCHCOMM_STORE_PATH)"
            )
        durable = self._recovery_store()
        deadline = Deadline(options.timeout)
        self._shrinks += 1
        for attempt in range(self._size):
            base = c10d.PrefixStore(f"shrink/{self._shrinks}/{attempt}", durable)
            failed = agree.agree_failed(
                c10d.PrefixStore("agree", base),
                self._rank,
                self._size,
                known,
                self._peer_gone,
                deadline,
                where,
            )
            if self._rank in failed:
                raise CommRevokedError(
                    f"{where}the other members found this rank failed and shrank without it"
                )
            members = [r for r in range(self._size) if r not in failed]
            store = CommStore(
                store=c10d.PrefixStore("comm", base),
                parent=self._store,
                durable=c10d.PrefixStore("next", base),
            )
            try:
                child = self._child(name, options, store, members)
            except CommError as exc:  # a member died after the agreement: agree again
                if not exc.dead_ranks or deadline.passed():
                    raise
                known = set(failed) | {members[r] for r in exc.dead_ranks}
                continue
            return child, members
        raise CommError(f"{where}no attempt to shrink succeeded")

    def revoke(self) -> None:
        """Non-collective: this rank's pending and later ops raise ``CommRevokedError``.

        The mark goes to the store first (a member whose op fails reads it, on the failure
        path only), then this rank fails its transport: every member waiting on it stops at
        once, learns it was a revoke, and passes it on the same way.
        """
        where = f"[TorchCommGloo comm={self._name} rank={self._rank}] revoke: "
        ops = self._connected_ops()
        store = self._recovery_store()
        liveness.within(1.0, lambda: store.set("revoked", str(self._rank)), "revoke")
        error = CommRevokedError(f"{where}rank {self._rank} revoked the communicator")
        error.ranks = (self._rank,)
        self._status.revoke(error)
        self.on_failure(error)
        ops.abort()  # this rank's own waits end within a second

    def _revoker(self) -> int | None:
        """The rank that revoked this comm, if one did (a bounded store read)."""
        if self._store is None:
            return None
        store = self._recovery_store()
        return liveness.within(
            1.0, lambda: int(store.get("revoked")) if store.check(["revoked"]) else None, "revoked"
        )

    def _recovery_store(self) -> c10d.Store:
        """Where revoke and shrink meet: the durable store, else the comm's own."""
        assert self._store is not None
        durable = self._store.durable
        return durable if durable is not None else c10d.PrefixStore("recovery", self._store.store)

    def c10d_meeting(self) -> tuple[c10d.Store, list[str], str]:
        """Where a c10d group over these members can connect: (store, hosts, my host)."""
        assert self._store is not None
        hosts = [host for host, _ in self._peers]
        return self._store.store, hosts, hosts[self._rank]

    def _peer_gone(self, rank: int) -> bool:
        """Whether member ``rank``'s process is known gone (pid on this host, liveness ring)."""
        ops = self._ops
        if ops is not None and rank in ops.dead_peers():
            return True
        host, pid = self._peers[rank]
        return host == self._peers[self._rank][0] and not process_alive(pid)

    # -- windows -------------------------------------------------------------------------------
    def new_window(self, tensor: torch.Tensor | None = None) -> CpuWindow:
        """A window matched across ranks by creation order (``cpu.window``); ``TorchComm``
        registers ``tensor`` through the public window (validation first)."""
        self._connected_ops()
        me = self._peers[self._rank][0]
        shm = config.transport(self._hints.get("transport")) != "tcp"
        shm = shm and shm_ops.unsupported_reason() is None
        ctx = WindowContext(
            rank=self._rank,
            size=self._size,
            pids=[pid for _, pid in self._peers],
            unified=[shm and host == me for host, _ in self._peers],
            run=self._run,
            prefix=self._prefix,
            ops=self._connected_ops,
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
        where = f"split/{name}/{digest}/{generation}"
        child_store = c10d.PrefixStore(where, self._store.store)
        parent_durable = self._store.durable
        durable = None if parent_durable is None else c10d.PrefixStore(where, parent_durable)
        # The child keeps the parent's store (and rank 0's server) alive while it lives.
        store = CommStore(store=child_store, parent=self._store, durable=durable)
        try:
            return self._child(name, options, store, ranks)
        finally:
            self.split_outside(name, options)  # done with the parent's store, as outsiders are

    def _child(
        self, name: str, options: CommOptions, store: CommStore, members: list[int]
    ) -> TorchCommGloo:
        """A new communicator of ``members`` (this comm's ranks, this rank among them)."""
        child = TorchCommGloo()
        device = self._device or torch.device("cpu")
        child._connect(device, name, options, store, members.index(self._rank), len(members))
        return child

    def split_outside(self, name: str, options: CommOptions) -> None:
        """Done with the parent's store for this split: rank 0 waits (``connect.split_done``)."""
        self._split_calls += 1
        if self._store is not None:
            key, deadline = f"split_done/{self._split_calls}", Deadline(options.timeout)
            cpu_connect.split_done(self._store, key, self._rank, self._peers, deadline)

    # -- execution plumbing (``_run`` and ``_run_sync``: ``cpu.dispatch``) -----------------------
    def _prefix(self, opts: OpOptions) -> str:
        op_id = f" op_id={opts.op_id}" if opts.op_id is not None else ""
        return f"[TorchCommGloo comm={self._name} rank={self._rank}] {opts.op_name}{op_id}: "

    def _translate(
        self, exc: BaseException, opts: OpOptions, peers: Sequence[int] = ()
    ) -> BaseException:
        """The typed error for ``exc``; a timeout, dead peer or mismatch fails the comm.

        The frames ``exc`` went through lose their locals: the error lives on (the caller's,
        the flight recorder's, the comm's cause), and must not keep the op's gloo call, and
        through it the comm's store server, alive after ``finalize``."""
        forget_frames(exc)
        dead = self._ops.dead_peers if self._ops is not None else list
        prefix = self._prefix(opts)
        error, failed = cpu_errors.typed_error(exc, prefix, opts.timeout, peers, dead)
        cause = self._status.cause
        if isinstance(cause, CommRevokedError) and isinstance(error, CommError):
            # This rank revoked, or learned of it: the op ends as revoked, whatever it saw.
            revoked = CommRevokedError(f"{prefix}the communicator was revoked ({cause})")
            revoked.ranks = cause.ranks
            return revoked
        if failed and isinstance(error, CommError):
            # A peer that failed without dying may have revoked: ask the store (the failure
            # path only; never for a death or a timeout, whose store may be out of reach).
            revoker = None
            if isinstance(error, PeerFailureError) and not error.dead_ranks:
                revoker = self._revoker()
            if revoker is not None:
                error = CommRevokedError(
                    f"{prefix}rank {revoker} revoked the communicator ({type(error).__name__}: "
                    f"{str(error).removeprefix(prefix)})"
                )
                error.ranks = (revoker,)
                self._status.revoke(error)
                self.on_failure(error)  # pass it on: members waiting on this rank stop too
                return error
            self.report_failure(error)
        return error

    def _connected_ops(self) -> CpuOps:
        ops = self._ops
        if ops is None:
            raise CommStateError(f"[TorchCommGloo comm={self._name}] TorchCommGloo not initialized")
        return ops
