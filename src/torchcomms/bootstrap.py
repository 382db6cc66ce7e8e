"""Rank/size discovery, store creation and host identity: everything a comm needs before connecting.

Stores are always c10d stores.  Without an explicit store, rank 0 binds
``MASTER_ADDR:MASTER_PORT`` (or, under torchrun's agent store, everyone connects
to it as a client), then all ranks move to a private ``TCPStore`` on an
OS-assigned port and the bootstrap store is dropped, so ``MASTER_PORT`` is free
again for the next ``new_comm``.  With ``TORCHCOMM_STORE_PATH`` set (as upstream), the
bootstrap store is a ``FileStore`` at that path instead (no port at all).
"""

from __future__ import annotations

import logging
import socket
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch._C._distributed_c10d as c10d

from torchcomms import config

logger = logging.getLogger("torchcomms.bootstrap")

RANKSIZE_ERROR = (
    "Unable to determine rank and size from environment variables. Please set TORCHCOMM_RANK "
    "and TORCHCOMM_SIZE, or ensure you are running in a supported environment "
    "(Torchrun, MPI, or PALS)."
)


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
    """Find this process's rank and world size from the environment, in upstream's order."""
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


def host_identity() -> str:
    """This host's identity for locality decisions (``TORCHCOMM_HOST_ID`` overrides it)."""
    override = config.env_str("TORCHCOMM_HOST_ID")
    if override:
        return override
    boot_id = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        pass
    return f"{socket.gethostname()}/{boot_id}"


def _underlying_tcp_host(store: c10d.Store) -> str | None:
    """The host of the TCPStore under a (chain of) PrefixStore(s), if any."""
    current: object = store
    for _ in range(16):
        if isinstance(current, c10d.TCPStore):
            return str(current.host)
        if isinstance(current, c10d.PrefixStore):
            current = current.underlying_store
            continue
        return None
    return None


def _advertised_host(bootstrap: c10d.Store) -> str:
    """An address of this host that the other ranks can reach."""
    explicit = config.gloo_hostname()
    if explicit:
        return explicit
    addr, _ = config.master_addr_port()
    if addr:
        return addr
    tcp_host = _underlying_tcp_host(bootstrap)
    if tcp_host:
        return tcp_host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


@dataclass
class CommStore:
    """The store a communicator talks through, plus what must stay alive with it."""

    store: c10d.Store  # on rank 0 this TCPStore is also the server the other ranks use
    parent: CommStore | None = None  # a split child keeps its parent's store alive
    # (store, key) set on close, so the name can be claimed again (see ``_claim_name``)
    release: tuple[c10d.Store, str] | None = None

    def close(self) -> None:
        self.parent = None
        release, self.release = self.release, None
        if release is not None:
            store, key = release
            try:
                store.set(key, "1")
            except Exception as exc:  # the store's server may already be gone at shutdown
                logger.debug("could not release communicator name (%s)", exc)


def _connect_bootstrap(rank: int, size: int, timeout: timedelta) -> c10d.Store:
    """The FileStore at ``TORCHCOMM_STORE_PATH``, else ``MASTER_ADDR:MASTER_PORT`` (rank 0
    serves it unless someone already does)."""
    path = config.store_path()
    if path:
        store = c10d.FileStore(path, size)
        store.set_timeout(timeout)
        return store
    addr, port = config.master_addr_port()
    if not addr:
        raise RuntimeError("MASTER_ADDR env is not set (needed when new_comm gets no store)")
    if port is None:
        raise RuntimeError("MASTER_PORT env is not set (needed when new_comm gets no store)")
    if config.torchelastic_agent_store() or rank != 0:
        return c10d.TCPStore(addr, port, None, False, timeout)
    try:
        return c10d.TCPStore(addr, port, size, True, timeout, wait_for_workers=False)
    except RuntimeError as exc:
        # Someone (a launcher, a user's own store) already serves MASTER_PORT: use it.
        logger.debug("MASTER_PORT %s is taken (%s); connecting as a client", port, exc)
        return c10d.TCPStore(addr, port, None, False, timeout)


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
    bootstrap: c10d.Store, rank: int, size: int, timeout: timedelta, key: str
) -> CommStore:
    """Move all ranks from ``bootstrap`` to a fresh private TCPStore served by rank 0."""
    if size == 1:
        return CommStore(store=c10d.HashStore())
    if rank == 0:
        host = _advertised_host(bootstrap)
        server = c10d.TCPStore(host, 0, size, True, timeout, wait_for_workers=False)
        bootstrap.set(key, f"{host}:{server.port}")
        private: c10d.Store = server
    else:
        bootstrap.wait([key], timeout)
        host, _, port = bootstrap.get(key).decode().rpartition(":")
        private = c10d.TCPStore(host, int(port), None, False, timeout)
    # Everyone announces it reached the private store, so rank 0 may drop the bootstrap one.
    private.set(f"joined/{rank}", "1")
    private.wait([f"joined/{r}" for r in range(size)], timeout)
    return CommStore(store=private)


def create_comm_store(
    name: str,
    rank: int,
    size: int,
    timeout: timedelta,
    store: c10d.Store | None,
    persistent: bool,
) -> CommStore:
    """Build the store of a new communicator (see the module docstring for the protocol)."""
    if store is not None:
        prefixed = c10d.PrefixStore(name, store)
        generation = _claim_name(prefixed, rank)
        scoped = prefixed if generation == 1 else c10d.PrefixStore(f"gen{generation}", prefixed)
        release = (prefixed, f"released/{generation}/{rank}")
        if persistent:
            return CommStore(store=scoped, release=release)
        comm_store = _dup_store(scoped, rank, size, timeout, "dup_store")
        comm_store.release = release
        return comm_store
    bootstrap = _connect_bootstrap(rank, size, timeout)
    prefixed = c10d.PrefixStore(f"torchcomms/{name}", bootstrap)
    # A launcher's store outlives our comms: number each creation of this name per rank.
    generation = prefixed.add(f"generation/{rank}", 1)
    result = _dup_store(prefixed, rank, size, timeout, f"dup_store/{generation}")
    del bootstrap, prefixed  # frees MASTER_PORT on rank 0
    return result


def new_token() -> str:
    """A random token for names that must not collide across jobs."""
    return uuid.uuid4().hex
