"""Rank/size discovery, store creation and host identity: everything a comm needs before connecting.

Protocol.  Stores are always c10d stores.  Without an explicit store, rank 0 serves
``MASTER_ADDR:MASTER_PORT`` (or, under torchrun's agent store or when someone else already
listens there, everyone connects to it as a client).  Every rank registers on it (its
``join`` key carries its host identity); rank 0 then starts a private ``TCPStore`` on an
OS-assigned port and publishes its address; all ranks move there, and the bootstrap store is
dropped, so ``MASTER_PORT`` is free again for the next ``new_comm``.  With
``TORCHCOMM_STORE_PATH`` set (as upstream), the bootstrap store is a ``FileStore`` at that path
instead (no port at all).  A comm of size 1 has nobody to meet and opens no socket.

Listening addresses.  A server listens where its clients dial, not on every interface: on the
loopback address when the dialled address is loopback (``MASTER_ADDR=127.0.0.1``) and, for
the private store, whenever every rank is on this host; on the dialled IP when it is a
literal address of this host; on all interfaces only for a host name (the other hosts may
resolve it to any of this host's addresses) or an address this host does not have (NAT)
(``transport.listen``).  The socket is bound here and handed to ``TCPStore`` (``master_listen_fd``), which owns it from
then on; so "port taken" is known from ``bind`` (``EADDRINUSE``), never guessed from a failed
server start.

Deadlines and errors.  One ``Deadline(timeout)`` per ``new_comm`` bounds every connect and
wait of the bootstrap; a wait that runs out raises ``CommTimeoutError`` naming the ranks
whose keys are missing ("rank 1 never joined"), never a raw c10d ``DistStoreError``.  A
non-zero rank whose bootstrap server disappears under it (rank 0 finished a previous comm's
bootstrap on that port) reconnects and registers again, within the same deadline.

Threads.  ``create_comm_store`` may run on several threads at once.  Concurrent bootstraps
in one process share rank 0's ``MASTER_PORT`` server (``_served``, guarded by
``_served_lock``); the last one to finish closes it.  Nothing else is shared.

Lifetime.  A ``TCPStore`` server lives as long as any reference to it (there is no close).
No store made here outlives ``create_comm_store`` except the returned one: on failure the
frames of the exception's traceback are cleared, so an exception the caller keeps does not
keep a server, and its port, alive.
"""

from __future__ import annotations

import atexit
import errno
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch._C._distributed_c10d as c10d

from torchcomms import config
from torchcomms.bridge import c10d_caller
from torchcomms.errors import CommError, CommTimeoutError, PeerFailureError, forget_frames
from torchcomms.ranks import ranks_text
from torchcomms.runtime.deadline import Deadline
from torchcomms.runtime.store_counts import CountingStore
from torchcomms.transport import listen
from torchcomms.transport.gloo.process_group import underlying_tcp_host
from torchcomms.transport.procs import host_identity

logger = logging.getLogger("torchcomms.bootstrap")

RANKSIZE_ERROR = (
    "Unable to determine rank and size from environment variables. Please set TORCHCOMM_RANK "
    "and TORCHCOMM_SIZE, or ensure you are running in a supported environment "
    "(Torchrun, MPI, or PALS)."
)

LOOPBACK = "127.0.0.1"
#: Starts of a store server tried before giving up (each bounded by the deadline).
_SERVE_ATTEMPTS = 5
#: Below this many seconds left, a deadline counts as passed.
_MIN_WAIT_S = 0.01


def _pair(rank_var: str, size_vars: tuple[str, ...]) -> tuple[int, int] | None:
    rank = config.env_int(rank_var)
    if rank is None or rank < 0:
        return None
    for size_var in size_vars:
        size = config.env_int(size_var)
        if size is not None and size > 0:
            return rank, size
    return None


def query_ranksize() -> tuple[int, int]:
    """This process's rank and world size: c10d's, when it is creating a group through us
    (``c10d_caller``: the explicit ranks of ``init_process_group``), else from the environment
    in upstream's order."""
    given = c10d_caller.group_rank_and_size()
    if given is not None:
        return given
    method = config.ranksize_query_method()
    candidates: list[tuple[str, tuple[str, ...]]] = [("TORCHCOMM_RANK", ("TORCHCOMM_SIZE",))]
    if method in ("auto", "mpi"):
        candidates += [
            ("OMPI_COMM_WORLD_RANK", ("OMPI_COMM_WORLD_SIZE",)),
            ("PMI_RANK", ("PMI_SIZE",)),
        ]
    if method in ("auto", "pals"):
        candidates.append(
            ("PALS_RANKID", ("PALS_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "WORLD_SIZE"))
        )
    if method in ("auto", "torchrun"):
        candidates.append(("RANK", ("WORLD_SIZE",)))
    for rank_var, size_vars in candidates:
        found = _pair(rank_var, size_vars)
        if found is not None:
            rank, size = found
            if rank >= size:
                raise RuntimeError(
                    f"Rank {rank} from {rank_var} is out of range for world size {size}"
                )
            return found
    raise RuntimeError(RANKSIZE_ERROR)


def _advertised_host(bootstrap: c10d.Store) -> str:
    """An address of this host that the other ranks can reach."""
    explicit = config.gloo_hostname()
    if explicit:
        return explicit
    addr, _ = config.master_addr_port()
    if addr:
        return addr
    tcp_host = underlying_tcp_host(bootstrap)
    if tcp_host:
        return tcp_host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return LOOPBACK


def _serve(dial: str, port: int, deadline: Deadline, where: str) -> c10d.TCPStore:
    """A TCPStore server for clients of ``dial:port`` (``OSError(EADDRINUSE)``: port taken).

    A failed start on a port we did bind is not "taken": c10d's server and its own client
    can stall on a slow reverse DNS lookup at connect. It is retried, within the deadline.
    """
    for attempt in range(_SERVE_ATTEMPTS):
        sock = listen.listen_socket(dial, port)
        bound_host, bound_port = sock.getsockname()[:2]
        host = dial if bound_host in ("::", "0.0.0.0") else str(bound_host)
        try:
            # The store owns the socket from here on (and closes it, also when it fails).
            return c10d.TCPStore(
                host,
                int(bound_port),
                None,
                True,
                deadline.remaining(),
                wait_for_workers=False,
                master_listen_fd=sock.detach(),
            )
        except RuntimeError as exc:
            failure = exc
            if deadline.left_s() <= _MIN_WAIT_S or attempt + 1 == _SERVE_ATTEMPTS:
                break
            logger.warning(
                "%s: starting a store server on %s:%s failed (%s); retrying",
                where,
                host,
                bound_port,
                _first_line(exc),
            )
            time.sleep(min(0.05 * 2**attempt, deadline.left_s()))
    raise CommTimeoutError(
        f"{where}: could not start a store server for {dial}:{port} within "
        f"{_seconds(deadline)} ({_first_line(failure)})"
    ) from failure


def serve_free_port(dial: str, deadline: Deadline, where: str) -> c10d.TCPStore:
    """A TCPStore server on a free port for clients that dial ``dial`` (e.g. a reconfigure
    handle's own server)."""
    return _serve(dial, 0, deadline, where)


def connect_client(
    host: str, port: int, deadline: Deadline, where: str, what: str
) -> c10d.TCPStore:
    """A client of the TCPStore at ``host:port``; ``what`` names it in errors."""
    return _client(host, port, deadline, where, what, None)


# -- rank 0's MASTER_PORT server, shared by this process's concurrent bootstraps -----------------
class _Served:
    __slots__ = ("store", "users")

    def __init__(self, store: c10d.TCPStore) -> None:
        self.store: c10d.TCPStore | None = store
        self.users = 1


_served: dict[tuple[str, int], _Served] = {}
_served_lock = threading.Lock()


class _BootstrapStore:
    """One bootstrap's hold on the store at ``MASTER_ADDR:MASTER_PORT``; ``close`` lets go."""

    def __init__(self, store: c10d.Store, served_key: tuple[str, int] | None = None) -> None:
        self.store: c10d.Store | None = store
        self._served_key = served_key  # set when this process serves the port

    @property
    def serving(self) -> bool:
        return self._served_key is not None

    def close(self) -> None:
        self.store = None
        key, self._served_key = self._served_key, None
        if key is None:
            return
        with _served_lock:
            entry = _served.get(key)
            if entry is None:
                return
            entry.users -= 1
            if entry.users == 0:
                del _served[key]
                entry.store = None  # the last reference: the server stops and the port is free


def _serve_or_join_master(addr: str, port: int, deadline: Deadline, where: str) -> _BootstrapStore:
    """Rank 0: this process's server on MASTER_PORT (started if needed), else a client of it.

    A taken port nobody listens on is held by a connection's local end (a MASTER_PORT in
    the ephemeral range, free between two bootstraps): the bind is retried until the
    connection is gone (up to a minute after it closed, if this host closed it first and
    it sits in TIME_WAIT) or the deadline passes."""
    key, pause = (addr, port), 0.001
    while True:
        with _served_lock:
            entry = _served.get(key)
            if entry is not None and entry.store is not None:
                entry.users += 1
                return _BootstrapStore(entry.store, key)
            try:
                server = _serve(addr, port, deadline, where)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise CommError(
                        f"{where}: cannot listen on MASTER_ADDR:MASTER_PORT {addr}:{port} ({exc})"
                    ) from exc
                server = None
            if server is not None:
                _served[key] = _Served(server)
                return _BootstrapStore(server, key)
        if listen.accepts(addr, port, min(deadline.left_s(), 1.0)):
            break
        if deadline.left_s() <= _MIN_WAIT_S:
            raise CommTimeoutError(
                f"{where}: MASTER_ADDR:MASTER_PORT {addr}:{port} stayed in use for "
                f"{_seconds(deadline)} with nothing listening on it (a connection of this host "
                "holds it as its local port: choose a MASTER_PORT outside the range in "
                "/proc/sys/net/ipv4/ip_local_port_range)"
            )
        time.sleep(min(pause, deadline.left_s()))
        pause = min(pause * 2, 0.05)
    # Someone else (a launcher, a user's own store) serves MASTER_PORT: use it.
    logger.debug("%s: MASTER_PORT %s is taken; connecting as a client", where, port)
    return _BootstrapStore(_client(addr, port, deadline, where, "another process", None))


def _client(
    addr: str, port: int, deadline: Deadline, where: str, server: str, server_rank: int | None
) -> c10d.TCPStore:
    """A client of the store at ``addr:port`` (c10d retries a refused connect until the deadline)."""
    try:
        return c10d.TCPStore(addr, port, None, False, deadline.remaining())
    except RuntimeError as exc:
        error = CommTimeoutError(
            f"{where}: could not connect to the store at {addr}:{port} ({server}) within "
            f"{_seconds(deadline)} ({_first_line(exc)})"
        )
        if server_rank is not None:
            error.ranks = (server_rank,)
        raise error from exc


# -- waits with a deadline ------------------------------------------------------------------------
class _StoreGone(PeerFailureError):
    """The store stopped answering while this rank waited on it (its server is gone)."""


def _seconds(deadline: Deadline) -> str:
    return f"{deadline.timeout.total_seconds():g} s"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _wait_keys(
    store: c10d.Store,
    keys: dict[int, str],
    deadline: Deadline,
    where: str,
    never: str,
    served_by: int | None,
    gone_error: type[CommError] = PeerFailureError,
) -> None:
    """Wait for ``keys`` (rank -> key); a timeout names the ranks whose keys are missing.

    ``served_by``: the rank whose process serves ``store`` (blamed, with ``gone_error``, if
    it stops answering), None for this rank's own server or a store served by someone else.
    """
    try:
        store.wait(list(keys.values()), deadline.remaining())
        return
    except RuntimeError as exc:
        wait_error: RuntimeError = exc
    try:
        missing = [r for r, key in keys.items() if not store.check([key])]
    except RuntimeError as exc:
        who = "its server" if served_by is None else f"rank {served_by}, its server,"
        gone = gone_error(
            f"{where}: the store stopped answering: {who} went away ({_first_line(exc)})"
        )
        if served_by is not None:
            gone.ranks = (served_by,)
        raise gone from wait_error
    if not missing:  # everything arrived just as the wait gave up
        return
    error = CommTimeoutError(
        f"{where}: {ranks_text(missing, 'rank')} {never} within {_seconds(deadline)} "
        f"(missing: {', '.join(keys[r] for r in missing)})"
    )
    error.ranks = tuple(missing)
    raise error from wait_error


# -- the comm's store -----------------------------------------------------------------------------
@dataclass
class CommStore:
    """The store a communicator talks through, plus what must stay alive with it."""

    store: c10d.Store  # on rank 0 this TCPStore is also the server the other ranks use
    parent: CommStore | None = None  # a split child keeps its parent's store alive
    # (store, key) set on close, so the name can be claimed again (see ``_claim_name``)
    release: tuple[c10d.Store, str] | None = None
    #: A store that outlives every member (the one given to ``new_comm``, or a file):
    #: where the survivors of a failure agree and reconnect (``shrink``).  ``None`` when
    #: the comm's only store is served by one of its members.
    durable: c10d.Store | None = None
    #: Kept alive with the store (e.g. the reconfigure server whose store this is).
    keep: object = None

    def close(self) -> None:
        self.parent = None
        release, self.release = self.release, None
        if release is not None:
            store, key = release
            try:
                store.set(key, "1")
            except Exception as exc:  # the store's server may already be gone at shutdown
                logger.debug("could not release communicator name (%s)", exc)


def _claim_name(store: c10d.Store, rank: int) -> int:
    """Claim this comm name on ``store`` for ``rank``: returns its generation (1, 2, ...).

    A name is live from creation until ``finalize`` releases it; claiming a live name is
    refused on every rank (upstream's error). Re-creating a finalized name (as
    ``destroy_process_group`` + ``init_process_group`` on one store does) gets the next
    generation, whose keys live under their own prefix so no stale key is ever read.
    """
    generation = store.add(f"init_count/{rank}", 1)
    if generation > 1 and not store.check([f"released/{generation - 1}/{rank}"]):
        store.add(f"init_count/{rank}", -1)
        raise RuntimeError(
            "detected multiple communicators on same store! Communicator names must be unique "
            "per store among live communicators (finalize the first one to reuse its name)"
        )
    return generation


def _dup_store(
    bootstrap: c10d.Store,
    rank: int,
    size: int,
    timeout: timedelta,
    deadline: Deadline,
    tag: str,
    where: str,
    served_by: int | None,
) -> CommStore:
    """Move all ranks from ``bootstrap`` to a fresh private TCPStore served by rank 0.

    Keys on ``bootstrap``: ``join<tag>/<rank>`` (each rank's host identity) and
    ``dup_store<tag>`` (the private store's ``host:port``, set by rank 0 once all joined).
    """
    _bootstrap_op(lambda: bootstrap.set(f"join{tag}/{rank}", host_identity()), where)
    private: c10d.TCPStore
    if rank == 0:
        joins = {r: f"join{tag}/{r}" for r in range(size)}
        _wait_keys(bootstrap, joins, deadline, where, "never joined", served_by, _StoreGone)
        hosts = _bootstrap_op(lambda: set(bootstrap.multi_get(list(joins.values()))), where)
        # Every rank on this host: the private store needs no more than loopback.
        host = LOOPBACK if len(hosts) == 1 else _advertised_host(bootstrap)
        try:
            private = _serve(host, 0, deadline, where)
        except OSError as exc:
            error = CommError(f"{where}: cannot listen for the private store on {host} ({exc})")
            raise error from exc
        address = f"{host}:{private.port}"
        _bootstrap_op(lambda: bootstrap.set(f"dup_store{tag}", address), where)
    else:
        key = f"dup_store{tag}"
        never = "never published the private store's address"
        _wait_keys(bootstrap, {0: key}, deadline, where, never, served_by, _StoreGone)
        value = _bootstrap_op(lambda: bootstrap.get(key), where)
        host, _, port = value.decode().rpartition(":")
        private = _client(host, int(port), deadline, where, "rank 0's private store", 0)
    private.set_timeout(timeout)
    # Everyone announces it reached the private store, so rank 0 may drop the bootstrap
    # one; only rank 0 waits for that (a member waiting for every key would send O(N)
    # bytes of key names: the connect's first gather names a member that never came).
    if rank == 0:
        joined = {r: f"joined/{r}" for r in range(1, size)}
        _wait_keys(private, joined, deadline, where, "never joined the private store", None)
    else:
        private.set(f"joined/{rank}", "1")
    return CommStore(store=private)


_T = TypeVar("_T")


def _bootstrap_op(op: Callable[[], _T], where: str) -> _T:
    """``op()`` on the bootstrap store; a broken connection becomes ``_StoreGone``."""
    try:
        return op()
    except RuntimeError as exc:
        raise _StoreGone(
            f"{where}: the bootstrap store stopped answering ({_first_line(exc)})"
        ) from exc


def _generation_dup(
    bootstrap: c10d.Store,
    name: str,
    rank: int,
    size: int,
    timeout: timedelta,
    deadline: Deadline,
    where: str,
    served_by: int | None,
    durable: bool = False,
) -> CommStore:
    """``_dup_store`` under ``torchcomms/<name>``, numbered per creation of the name;
    ``durable``: ``bootstrap`` outlives the members (a file), so recovery may use it."""
    prefixed = c10d.PrefixStore(f"torchcomms/{name}", bootstrap)
    # A launcher's store outlives our comms: number each creation of this name per rank.
    generation = _bootstrap_op(lambda: prefixed.add(f"generation/{rank}", 1), where)
    tag = f"/{generation}"
    comm_store = _dup_store(prefixed, rank, size, timeout, deadline, tag, where, served_by)
    if durable:
        comm_store.durable = c10d.PrefixStore(f"recovery{tag}", prefixed)
    return comm_store


#: ``TORCHCOMM_STORE_PATH``'s store, one per (path, size) for the process's life.  c10d
#: removes the file once ``size`` of its store objects were destroyed, anywhere: with one
#: per comm, a rank that finalized a comm and created the next lost its keys (and its
#: creation count) when a slower rank dropped the first comm's store, and hung.
_file_stores: dict[tuple[str, int], c10d.FileStore] = {}
_file_stores_lock = threading.Lock()


def _file_store(path: str, size: int) -> c10d.FileStore:
    with _file_stores_lock:
        store = _file_stores.get((path, size))
        if store is None:
            if not _file_stores:
                atexit.register(_drop_file_stores)  # at exit: the last process removes it
            store = _file_stores[(path, size)] = c10d.FileStore(path, size)
        return store


def _drop_file_stores() -> None:
    with _file_stores_lock:
        _file_stores.clear()


def _storeless(
    name: str, rank: int, size: int, timeout: timedelta, deadline: Deadline, where: str
) -> CommStore:
    """Bootstrap through ``TORCHCOMM_STORE_PATH`` or ``MASTER_ADDR:MASTER_PORT``."""
    path = config.store_path()
    if path:
        if size == 1:
            return CommStore(store=c10d.HashStore())
        file_store = _file_store(path, size)
        file_store.set_timeout(timeout)
        return _generation_dup(
            file_store, name, rank, size, timeout, deadline, where, None, durable=True
        )
    addr, port = config.master_addr_port()
    if not addr:
        raise RuntimeError("MASTER_ADDR env is not set (needed when new_comm gets no store)")
    if port is None:
        raise RuntimeError("MASTER_PORT env is not set (needed when new_comm gets no store)")
    if size == 1:
        return CommStore(store=c10d.HashStore())
    agent = config.torchelastic_agent_store()
    while True:
        if agent:
            held = _BootstrapStore(_client(addr, port, deadline, where, "torchrun's agent", None))
        elif rank == 0:
            held = _serve_or_join_master(addr, port, deadline, where)
        else:
            listen.await_listener(addr, port, deadline, _MIN_WAIT_S)
            held = _BootstrapStore(_client(addr, port, deadline, where, "rank 0", 0))
        try:
            assert held.store is not None
            served_by = 0 if not agent and rank != 0 else None
            return _generation_dup(
                held.store, name, rank, size, timeout, deadline, where, served_by
            )
        except _StoreGone as exc:
            # Rank 0's server went away under this rank (rank 0 finished another bootstrap
            # on this port before starting ours): connect again and register anew.
            if served_by is None or deadline.left_s() <= _MIN_WAIT_S:
                raise
            logger.debug("%s: %s; reconnecting", where, exc)
        finally:
            held.close()  # rank 0: stops the server (frees MASTER_PORT) unless still shared


def create_comm_store(
    name: str,
    rank: int,
    size: int,
    timeout: timedelta,
    store: c10d.Store | None,
    persistent: bool,
) -> CommStore:
    """Build the store of a new communicator (see the module docstring for the protocol)."""
    deadline = Deadline(timeout)
    where = f"[comm={name} rank={rank}] new_comm bootstrap"
    counting = config.store_counts()
    if counting and store is not None:
        store = CountingStore(store)
    try:
        if store is None:
            comm_store = _storeless(name, rank, size, timeout, deadline, where)
            if counting:
                comm_store.store = CountingStore(comm_store.store)
            return comm_store
        prefixed = c10d.PrefixStore(name, store)
        generation = _claim_name(prefixed, rank)
        scoped = prefixed if generation == 1 else c10d.PrefixStore(f"gen{generation}", prefixed)
        release = (prefixed, f"released/{generation}/{rank}")
        durable = c10d.PrefixStore("recovery", scoped)
        if persistent:
            return CommStore(store=scoped, release=release, durable=durable)
        if size == 1:
            comm_store = CommStore(store=c10d.HashStore())
        else:
            comm_store = _dup_store(scoped, rank, size, timeout, deadline, "", where, None)
            if counting:
                comm_store.store = CountingStore(comm_store.store)
        comm_store.release = release
        comm_store.durable = durable
        return comm_store
    except BaseException as exc:
        forget_frames(exc)  # a caller that keeps the exception must not keep our servers
        raise


def new_token() -> str:
    """A random token for names that must not collide across jobs."""
    return uuid.uuid4().hex
