"""Reconfigure for the CPU backend: init handles, who is who, and where the members meet.

In reconfigure mode (``new_comm(..., enable_reconfigure=True)``) a communicator connects
only at ``reconfigure(uuid, init_handles)``.  Each process serves a small TCPStore of
its own, started by its first ``get_init_handle``; its handle carries that server's
address, ``gloo:{rank}:{uuid}:{host}:{port}`` (upstream's shape; rank and uuid are -1
until the first reconfigure).  The address makes a handle unique per process and
self-sufficient: the members need no common store beforehand.

``plan`` orders the handles (a list by position, a set sorted, which is the same order
on every member), finds this process's own handle by its address, and names where the
members meet: the first handle's server, under ``reconfigure/{uuid}/{digest}``, where
the digest covers every handle's address.  Members given different handle lists never
meet: they time out, naming who did not arrive, instead of connecting wrongly.

Runs on the thread that calls ``get_init_handle`` or ``reconfigure``.
"""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Iterable
from dataclasses import dataclass

import torch._C._distributed_c10d as c10d

from torchcomms import bootstrap, config
from torchcomms.deadline import Deadline
from torchcomms.errors import CommValidationError
from torchcomms.store_counts import CountingStore
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

    def __init__(self, store: c10d.Store | None, hints: dict[str, str], where: str) -> None:
        host = _dial_address(store, hints)
        deadline = Deadline(config.default_timeout())
        self.store: c10d.TCPStore = bootstrap.serve_free_port(host, deadline, where)
        self.host = host
        self.port = int(self.store.port)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


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

    rank: int
    size: int
    leader: InitHandle  # whose server the members meet on
    prefix: str  # the key prefix of this reconfigure on that server


def plan(uuid: object, init_handles: object, own: str, used: Iterable[int], where: str) -> Plan:
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
    addresses = [h.address for h in handles]
    if len(set(addresses)) != len(addresses):
        twice = sorted({a for a in addresses if addresses.count(a) > 1})
        raise CommValidationError(
            f"{where}init_handles name the same process more than once ({', '.join(twice)})"
        )
    if own not in addresses:
        raise CommValidationError(
            f"{where}init_handles do not include this process's handle (address {own}); "
            "pass every member's get_init_handle(), this one's too"
        )
    digest = hashlib.sha1("\n".join(addresses).encode()).hexdigest()[:16]
    return Plan(addresses.index(own), len(handles), handles[0], f"reconfigure/{uuid}/{digest}")


def meeting_store(server: HandleServer, chosen: Plan, deadline: Deadline, where: str) -> c10d.Store:
    """The store the members meet on: this process's own server when it leads."""
    leader = chosen.leader
    if chosen.size == 1:
        return c10d.PrefixStore(chosen.prefix, c10d.HashStore())
    if leader.address == server.address:
        base: c10d.Store = server.store
    else:
        base = bootstrap.connect_client(
            leader.host, leader.port, deadline, where, "the first handle's server (new rank 0)"
        )
    if config.store_counts():
        base = CountingStore(base)
    return c10d.PrefixStore(chosen.prefix, base)
