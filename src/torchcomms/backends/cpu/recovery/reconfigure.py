"""Reconfigure for the CPU backend: init handles, who is who, and where the members meet.

In reconfigure mode (``new_comm(..., enable_reconfigure=True)``) a communicator connects
only at ``reconfigure(uuid, init_handles)``.  A handle reads
``gloo:{rank}:{uuid}:{host}:{port}`` (upstream's shape; uuid is -1 until the first
reconfigure) and names a store the members can meet on, one of two kinds:

* **This process's own server** (``HandleServer``, started by the first
  ``get_init_handle``): the handle is unique per process and self-sufficient, so the
  members need no common store beforehand (torchft's replicas, each a world of its own).
  The rank field is the comm rank when the handle was made (-1 before).
* **The launcher's store** (``LauncherStore``): under torchrun (its agent serves
  ``MASTER_ADDR:MASTER_PORT``) in a world of more than one process, with no ``store=``,
  every process's handle names that store, as upstream's gloo does; the rank field is the
  launcher rank, so handles stay distinct per process.

``plan`` orders the handles (a list by position, a set sorted, which is the same order
on every member).  Two ways to meet:

* **By position** (every handle distinct): this process's rank is its own handle's
  position; the members meet on the first handle's store under
  ``reconfigure/{uuid}/{digest}``, the digest covering every handle.  Members given
  different handle lists never meet: they time out, naming who did not arrive, instead
  of connecting wrongly.
* **By arrival** (upstream's gloo shape: the same launcher store named more than once,
  as ``[comm.get_init_handle()] * world_size`` gives): the size is the number of handles
  and ranks go in order of arrival, an ``add`` on ``reconfigure/{name}/{uuid}/n{size}``.

Runs on the thread that calls ``get_init_handle`` or ``reconfigure``.
"""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Iterable
from dataclasses import dataclass

import torch._C._distributed_c10d as c10d

from torchcomms import config
from torchcomms.backends.cpu import bootstrap
from torchcomms.errors import CommError, CommValidationError
from torchcomms.runtime.deadline import Deadline
from torchcomms.runtime.store_counts import CountingStore
from torchcomms.transport.gloo.process_group import reachable_address

BACKEND = "gloo"


@dataclass(frozen=True)
class InitHandle:
    """One member's handle: its rank and uuid when it made the handle, and its server."""

    rank: int
    uuid: int
    host: str
    port: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def __str__(self) -> str:
        return f"{BACKEND}:{self.rank}:{self.uuid}:{self.address}"

    @classmethod
    def parse(cls, text: object, where: str) -> InitHandle:
        if not isinstance(text, str):
            raise CommValidationError(
                f"{where}init_handles must hold str handles, got {type(text).__name__}"
            )
        parts = text.split(":", 3)
        host, _, port = parts[3].rpartition(":") if len(parts) == 4 else ("", "", "")
        try:
            if parts[0] != BACKEND or not host:
                raise ValueError
            return cls(int(parts[1]), int(parts[2]), host, int(port))
        except (ValueError, IndexError):
            raise CommValidationError(
                f"{where}{text!r} is not a gloo init handle "
                f"(expected 'gloo:<rank>:<uuid>:<host>:<port>' from get_init_handle())"
            ) from None


class HandleServer:
    """This process's own store server for one reconfigurable communicator."""

    shared = False
    launcher_rank = -1

    def __init__(self, store: c10d.Store | None, hints: dict[str, str], where: str) -> None:
        host = _dial_address(store, hints)
        deadline = Deadline(config.default_timeout())
        self.store: c10d.TCPStore = bootstrap.serve_free_port(host, deadline, where)
        self.host = host
        self.port = int(self.store.port)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def handle(self, rank: int, uuid: int) -> InitHandle:
        return InitHandle(rank, uuid, self.host, self.port)


class LauncherStore:
    """The store torchrun's agent serves on ``MASTER_ADDR:MASTER_PORT``, shared by every
    process of the launcher's world (``endpoint``)."""

    shared = True

    def __init__(self, host: str, port: int, launcher_rank: int, where: str) -> None:
        deadline = Deadline(config.default_timeout())
        self.store: c10d.TCPStore = bootstrap.connect_client(
            host, port, deadline, where, "torchrun's store (MASTER_ADDR:MASTER_PORT)"
        )
        self.host, self.port, self.launcher_rank = host, port, launcher_rank

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def handle(self, rank: int, uuid: int) -> InitHandle:
        return InitHandle(self.launcher_rank, uuid, self.host, self.port)


Endpoint = HandleServer | LauncherStore


def endpoint(store: c10d.Store | None, hints: dict[str, str], where: str) -> Endpoint:
    """Which store this process's handles name (module docstring): torchrun's when it runs
    a world of several processes and the comm got no ``store=``, else a server of its own."""
    addr, port = config.master_addr_port()
    if store is None and config.torchelastic_agent_store() and addr and port:
        try:
            rank, size = bootstrap.query_ranksize()
        except RuntimeError:
            size = 1
        if size > 1:
            return LauncherStore(addr, port, rank, where)
    return HandleServer(store, hints, where)


def _dial_address(store: c10d.Store | None, hints: dict[str, str]) -> str:
    """Where the other members can reach this process's server.

    A ``hostname`` hint or ``TORCHCOMM_GLOO_HOSTNAME`` first; else this host's address on
    the route to the comm's store, or to ``MASTER_ADDR``; else loopback (one host).
    """
    if store is not None:
        chosen = reachable_address(store, hints.get("hostname"))
        if chosen != "0.0.0.0":
            return chosen
    elif hints.get("hostname") or config.gloo_hostname():
        return hints.get("hostname") or config.gloo_hostname() or ""
    addr, port = config.master_addr_port()
    if addr and addr not in ("localhost", bootstrap.LOOPBACK):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as route:
                route.connect((addr, port or 9))  # no packet is sent: only the route is chosen
                return str(route.getsockname()[0])
        except OSError:
            pass
    return bootstrap.LOOPBACK


@dataclass(frozen=True)
class Plan:
    """Who this process is in the reconfigured communicator, and where the members meet."""

    rank: int  # -1 when ranks go by arrival (``meet``)
    size: int
    leader: InitHandle  # whose store the members meet on
    prefix: str  # the key prefix of this reconfigure on that store


def plan(
    uuid: object,
    init_handles: object,
    own: Endpoint,
    name: str,
    used: Iterable[int],
    where: str,
) -> Plan:
    """Validate the arguments of ``reconfigure`` and work out the plan (module docstring)."""
    if isinstance(uuid, bool) or not isinstance(uuid, int):
        raise CommValidationError(f"{where}uuid must be an int, got {type(uuid).__name__}")
    if uuid < 0:
        raise CommValidationError(f"{where}uuid must be >= 0, got {uuid}")
    if uuid in set(used):
        raise CommValidationError(
            f"{where}uuid {uuid} already used by an earlier reconfigure of this communicator"
        )
    if isinstance(init_handles, (list, tuple)):
        texts = list(init_handles)
    elif isinstance(init_handles, (set, frozenset)):
        texts = sorted(init_handles, key=str)  # the same order on every member
    else:
        raise CommValidationError(
            f"{where}init_handles must be a list or a set of handles, "
            f"got {type(init_handles).__name__}"
        )
    if not texts:
        raise CommValidationError(f"{where}init_handles must not be empty")
    handles = [InitHandle.parse(t, where) for t in texts]
    size = len(handles)
    same_store = own.shared and all(h.address == own.address for h in handles)
    if same_store and len({(h.rank, h.address) for h in handles}) < size:  # [handle] * n
        return Plan(-1, size, handles[0], f"reconfigure/{name}/{uuid}/n{size}")
    mine = [
        i
        for i, h in enumerate(handles)
        if h.address == own.address and (not own.shared or h.rank == own.launcher_rank)
    ]
    if not mine:
        raise CommValidationError(
            f"{where}init_handles do not include this process's handle (address "
            f"{own.address}); pass every member's get_init_handle(), this one's too"
        )
    keys = [(h.rank, h.address) if own.shared else h.address for h in handles]
    twice = sorted({str(handles[i]) for i, k in enumerate(keys) if keys.count(k) > 1})
    if twice or len(mine) > 1:
        raise CommValidationError(
            f"{where}init_handles name the same process more than once "
            f"({', '.join(twice or [str(handles[mine[0]])])})"
        )
    digest = hashlib.sha1("\n".join(map(str, handles)).encode()).hexdigest()[:16]
    return Plan(mine[0], size, handles[0], f"reconfigure/{uuid}/{digest}")


def meet(own: Endpoint, chosen: Plan, deadline: Deadline, where: str) -> tuple[c10d.Store, int]:
    """The store the members meet on (this process's own when it leads), and this
    process's rank: its position, or (by arrival) one more than the members before it."""
    leader = chosen.leader
    if chosen.size == 1:
        return c10d.PrefixStore(chosen.prefix, c10d.HashStore()), 0
    if leader.address == own.address:
        base: c10d.Store = own.store
    else:
        base = bootstrap.connect_client(
            leader.host, leader.port, deadline, where, "the first handle's server (new rank 0)"
        )
    if config.store_counts():
        base = CountingStore(base)
    store = c10d.PrefixStore(chosen.prefix, base)
    if chosen.rank >= 0:
        return store, chosen.rank
    rank = int(store.add("rank_counter", 1)) - 1
    if rank >= chosen.size:
        raise CommError(
            f"{where}more processes than the {chosen.size} handles given joined "
            f"{chosen.prefix} on {leader.address}: every member must pass as many handles "
            "as there are members, and each uuid is used by one group at a time"
        )
    return store, rank
