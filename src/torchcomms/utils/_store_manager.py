"""``_create_prefix_store`` / ``_dup_prefix_store``: upstream's store helpers, over our bootstrap.

Upstream's semantics, which code written against it (and PyTorch-side helpers) relies on:

* ``_create_prefix_store(prefix)``: a ``PrefixStore(prefix, TCPStore)`` at
  ``MASTER_ADDR:MASTER_PORT``, served by rank 0 (the rank ``new_comm`` would get, from the
  environment in upstream's order); the others connect.  Under torchrun's agent store
  (``TORCHELASTIC_USE_AGENT_STORE=True``) the launcher already serves that port, so every
  rank connects to it, as ``new_comm``'s own bootstrap does.
* ``_dup_prefix_store(prefix, bootstrap_store)``: rank 0 serves a fresh ``TCPStore`` on an
  OS-assigned port and publishes the port under ``dup_store_port`` on ``bootstrap_store``;
  the others read it and connect.  The result is independent of the bootstrap store, which
  may be dropped (freeing ``MASTER_PORT``).  One call per bootstrap store (the key is fixed).

A store server lives as long as the returned store does, and listens where its clients dial
(``transport.listen``: loopback for a loopback ``MASTER_ADDR``), as the bootstrap's do.  Errors are the package's: a
missing rank never publishing or a server that cannot be reached within ``timeout`` is a
``CommTimeoutError`` naming it; a missing ``MASTER_ADDR``/``MASTER_PORT`` a ``CommError``.
"""

from __future__ import annotations

from datetime import timedelta

import torch._C._distributed_c10d as c10d

from torchcomms import config
from torchcomms.backends.cpu import bootstrap
from torchcomms.errors import CommError, CommTimeoutError, PeerFailureError
from torchcomms.runtime.deadline import Deadline
from torchcomms.transport.listen import listen_socket

#: Upstream's default (``std::chrono::milliseconds(60000)``).
DEFAULT_TIMEOUT = timedelta(seconds=60)
#: The key ``_dup_prefix_store`` publishes rank 0's port under (upstream's).
DUP_STORE_PORT_KEY = "dup_store_port"


def _check(where: str, prefix: object, timeout: object) -> timedelta:
    if not isinstance(prefix, str):
        raise TypeError(f"{where}: prefix must be a str, got {type(prefix).__name__}")
    if not isinstance(timeout, timedelta):
        raise TypeError(f"{where}: timeout must be a timedelta, got {type(timeout).__name__}")
    if timeout <= timedelta(0):
        raise ValueError(f"{where}: timeout must be positive, got {timeout}")
    return timeout


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _master_addr(where: str) -> str:
    addr, _ = config.master_addr_port()
    if not addr:
        raise CommError(f"{where}: MASTER_ADDR env is not set")
    return addr


def _create_prefix_store(prefix: str, timeout: timedelta = DEFAULT_TIMEOUT) -> c10d.Store:
    """A ``PrefixStore(prefix, TCPStore at MASTER_ADDR:MASTER_PORT)``; rank 0 serves it."""
    where = "_create_prefix_store"
    timeout = _check(where, prefix, timeout)
    addr = _master_addr(where)
    _, port = config.master_addr_port()
    if port is None:
        raise CommError(f"{where}: MASTER_PORT env is not set")
    rank, _ = bootstrap.query_ranksize()
    where = f"[rank={rank}] {where}"
    deadline = Deadline(timeout)
    store: c10d.TCPStore
    if rank == 0 and not config.torchelastic_agent_store():
        store = _serve(addr, port, timeout, where)
    else:
        server = "torchrun's agent" if config.torchelastic_agent_store() else "rank 0"
        store = bootstrap.connect_client(addr, port, deadline, where, server)
    return c10d.PrefixStore(prefix, store)


def _serve(addr: str, port: int, timeout: timedelta, where: str) -> c10d.TCPStore:
    """Rank 0's server on MASTER_PORT, listening where its clients dial (``transport.listen``),
    as the bootstrap's servers do: loopback for a loopback ``MASTER_ADDR``."""
    try:
        sock = listen_socket(addr, port)
    except OSError as exc:
        raise CommError(
            f"{where}: rank 0 could not serve a store on MASTER_ADDR:MASTER_PORT {addr}:{port} "
            f"({exc})"
        ) from exc
    bound = str(sock.getsockname()[0])
    host = addr if bound in ("::", "0.0.0.0") else bound
    try:
        # The store owns the socket from here on (and closes it, also when it fails).
        return c10d.TCPStore(
            host, port, None, True, timeout, wait_for_workers=False, master_listen_fd=sock.detach()
        )
    except RuntimeError as exc:
        raise CommError(
            f"{where}: rank 0 could not serve a store on MASTER_ADDR:MASTER_PORT {addr}:{port} "
            f"({_first_line(exc)})"
        ) from exc


def _dup_prefix_store(
    prefix: str, bootstrap_store: c10d.Store, timeout: timedelta = DEFAULT_TIMEOUT
) -> c10d.Store:
    """A ``PrefixStore(prefix, a new TCPStore served by rank 0)``, met through ``bootstrap_store``."""
    where = "_dup_prefix_store"
    timeout = _check(where, prefix, timeout)
    if not isinstance(bootstrap_store, c10d.Store):
        raise TypeError(
            f"{where}: bootstrap_store must be a torch.distributed Store, got "
            f"{type(bootstrap_store).__name__}"
        )
    host = _master_addr(where)
    rank, _ = bootstrap.query_ranksize()
    where = f"[rank={rank}] {where}"
    deadline = Deadline(timeout)
    store: c10d.TCPStore
    if rank == 0:
        store = bootstrap.serve_free_port(host, deadline, where)
        bootstrap_store.set(DUP_STORE_PORT_KEY, str(store.port))
    else:
        _wait_key(bootstrap_store, deadline, where)
        port = int(bootstrap_store.get(DUP_STORE_PORT_KEY).decode())
        store = bootstrap.connect_client(host, port, deadline, where, "rank 0's store")
    store.set_timeout(timeout)
    return c10d.PrefixStore(prefix, store)


def _wait_key(store: c10d.Store, deadline: Deadline, where: str) -> None:
    """Wait for rank 0's port; a timeout or a store that stopped answering names rank 0."""
    try:
        store.wait([DUP_STORE_PORT_KEY], deadline.remaining())
        return
    except RuntimeError as exc:
        failure = exc
    try:
        published = store.check([DUP_STORE_PORT_KEY])
    except RuntimeError as exc:
        gone = PeerFailureError(f"{where}: the bootstrap store stopped answering ({exc})")
        gone.ranks = (0,)
        raise gone from failure
    if published:  # it arrived just as the wait gave up
        return
    error = CommTimeoutError(
        f"{where}: rank 0 never published {DUP_STORE_PORT_KEY!r} on the bootstrap store "
        f"within {deadline.timeout.total_seconds():g} s"
    )
    error.ranks = (0,)
    raise error from failure
