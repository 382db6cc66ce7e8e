"""Which transport a CPU communicator uses, and connecting it (collective over the members).

* shm (``cpu.shm.ops``) when every member shares this host;
* hierarchical (``cpu.hier``) when members span hosts and some host holds several;
* flat tcp (``cpu.tcp.ops``: direct sockets, gloo for the rest) otherwise, or when
  ``transport=tcp`` is asked for.

Locality comes from the members' host identities (exchanged first, ``cpu.connect``), never
from being able to open a segment.  The tcp and hierarchical paths connect, in this order,
a point-to-point engine (``transport.tcp_p2p``, its listener), a lane
(``transport.tcp_lane``: the collectives), gloo's process group and a liveness watcher
(``cpu.tcp.liveness``).  Runs on the thread that creates the communicator.
"""

from __future__ import annotations

import secrets
import socket
from collections.abc import Callable, Mapping

import torch._C._distributed_c10d as c10d

from torchcomms import config
from torchcomms.backends.cpu import connect as cpu_connect
from torchcomms.backends.cpu import hier
from torchcomms.backends.cpu.ops import CpuOps
from torchcomms.backends.cpu.shm import ops as shm_ops
from torchcomms.backends.cpu.tcp.liveness import Liveness
from torchcomms.backends.cpu.tcp.ops import TcpOps
from torchcomms.backends.cpu.tcp.waits import GLOO_MARGIN
from torchcomms.deadline import Deadline
from torchcomms.errors import CommError
from torchcomms.transport import placement
from torchcomms.transport.gloo import process_group as gloo
from torchcomms.transport.tcp import lane as tcp_lane
from torchcomms.transport.tcp import p2p as tcp_p2p
from torchcomms.transport.wait_policy import WaitPolicy
from torchcomms.types import CommOptions


def check_settings(hints: Mapping[str, str]) -> None:
    """Parse every transport setting (hint or environment variable) once, raising on a bad one.

    Called before the bootstrap: a bad value then fails on every rank that has it before
    any store operation, instead of on rank 0 mid-connect while the others still wait on
    rank 0's store (which goes away with rank 0's failed ``new_comm``).
    """
    config.transport(hints.get("transport"))
    config.cpu_affinity(hints.get("cpu_affinity"))
    config.gloo_lazy_init(hints.get("lazy"))
    config.shm_slot_bytes(hints.get("shm_slot_bytes"))
    config.shm_pair_bytes(hints.get("shm_pair_bytes"))
    config.shm_oneshot_max(hints.get("shm_oneshot_max"))
    config.hier_small_max(hints.get("hier_small_max"))
    config.shm_wait_policy()
    config.liveness_period_s()


def open_transport(
    mode: str,
    store: c10d.Store,
    name: str,
    rank: int,
    peers: list[tuple[str, int]],
    options: CommOptions,
) -> CpuOps:
    """The one ops object of a comm; ``mode`` is ``auto``, ``shm`` or ``tcp``."""
    size = len(peers)
    here = [r for r, (host, _) in enumerate(peers) if host == peers[rank][0]]
    # Before any wait policy is built: they count the cores the ranks run on.
    placement.place(
        config.cpu_affinity(options.hints.get("cpu_affinity")), here.index(rank), len(here)
    )
    prefix = cpu_connect.connect_prefix(name, rank)
    if _use_shm(mode, peers, rank, name):
        return shm_ops.ShmOps(
            shm_ops.open_collectives(
                c10d.PrefixStore("shm", store),
                rank,
                size,
                [pid for _, pid in peers],
                options.hints,
                options.timeout,
                f"comm={name}",
            )
        )
    lazy = config.gloo_lazy_init(options.hints.get("lazy"))
    hosts = [host for host, _ in peers]
    desc, device = gloo.choose_device(options.hints, hosts, hosts[rank], lazy)
    local = cpu_connect.local_pids(peers, rank)
    deadline = Deadline(options.timeout)
    lane_host = "127.0.0.1" if len(set(hosts)) == 1 else None
    p2p_listener = _Listener(store, lane_host, options.hints)
    lane_listener = _Listener(store, lane_host, options.hints)
    # One gather of both listeners' addresses (O(1) store round trips per rank), which is
    # also where the members meet before gloo's connect: that holds the GIL while it waits
    # for a peer, so a member that died since the identity exchange is named now.
    try:
        addresses = cpu_connect.gather(
            store,
            "listeners",
            rank,
            size,
            f"{p2p_listener.entry}|{lane_listener.entry}",
            deadline,
            local,
            prefix,
            "the gloo connect",
        )
    except BaseException:
        p2p_listener.sock.close()
        lane_listener.sock.close()
        raise
    p2p = listen_p2p(p2p_listener, rank, [a.split("|")[0] for a in addresses], local)
    try:
        lane = connect_lane(
            lane_listener,
            store,
            rank,
            size,
            [a.split("|")[1] for a in addresses],
            deadline,
            local,
            prefix,
        )
    except BaseException:
        p2p.close()
        raise
    try:
        pg, pg_store = cpu_connect.guarded(
            lambda: gloo.connect_process_group(
                c10d.PrefixStore("gloo", store),
                rank,
                size,
                options.timeout + GLOO_MARGIN,
                device,
                lazy,
            ),
            deadline,
            local,
            list(local),
            prefix,
            "the gloo connect",
        )
    except BaseException:
        lane.goodbye("FAILED failed")
        lane.close()
        p2p.close()
        raise
    liveness = Liveness(
        c10d.PrefixStore("lv", store), rank, peers, name, config.liveness_period_s()
    )
    flat = TcpOps(
        pg,
        lane,
        p2p,
        rank,
        size,
        peers,
        desc,
        liveness,
        config.mismatch_check(),
        options.timeout,
        c10d.PrefixStore("mm", store),
        pg_store,
    )
    if mode != "tcp" and hier.wanted(peers) and not shm_ops.unsupported_reason():
        # With torch 2.13's lazy gloo, a second process group on the same device never
        # completes its first op (both sides wait out the timeout): the cross group gets a
        # device of its own then.  Eager groups share one.
        if lazy:
            device = gloo.choose_device(options.hints, hosts, hosts[rank], lazy)[1]
        try:
            return hier.connect(
                store, flat, peers, options.hints, options.timeout, device, lazy, f"comm={name}"
            )
        except BaseException:
            flat.close(failed=True)
            raise
    return flat


class _Listener:
    """A listening socket of this rank on ``host`` (loopback when every member is on this
    host), else on the address peers reach this host by; ``entry`` (``token port host``)
    is what the members gather so that peers can dial it."""

    def __init__(self, store: c10d.Store, host: str | None, hints: Mapping[str, str]) -> None:
        bind = host or gloo.reachable_address(store, hints.get("hostname"))
        self.sock = tcp_lane.listen(bind)
        advertised = socket.gethostname() if bind in ("0.0.0.0", "::") else bind
        self.token = secrets.token_hex(8)
        self.entry = f"{self.token} {self.sock.getsockname()[1]} {advertised}"


def _dialable(entries: list[str]) -> Callable[[int], tuple[str, int, str]]:
    """Rank -> ``(host, port, token)`` from the gathered ``token port host`` entries."""
    parsed = []
    for entry in entries:
        token, port, host = entry.split(" ", 2)
        parsed.append((host, int(port), token))
    return parsed.__getitem__


def listen_p2p(
    listener: _Listener, rank: int, entries: list[str], local: Mapping[int, int]
) -> tcp_p2p.P2P:
    """This rank's point-to-point engine (``transport.tcp_p2p``) on ``listener``; peers
    (their gathered ``entries``) are dialled on first use."""
    policy = WaitPolicy(len(local) + 1)
    # Ranks sharing cores: no spin (it would hold a peer's core), but yield for as long
    # as an shm wait does before sleeping in ``poll``.
    spin_s, yield_s = (0.0, policy.yield_s) if policy.oversubscribed else (tcp_p2p.SPIN_S, 0.0)
    return tcp_p2p.P2P(rank, listener.sock, listener.token, _dialable(entries), spin_s, yield_s)


def connect_lane(
    listener: _Listener,
    store: c10d.Store,
    rank: int,
    size: int,
    entries: list[str],
    deadline: Deadline,
    local: Mapping[int, int],
    prefix: str,
) -> tcp_lane.Lane:
    """This rank's ``transport.tcp.lane`` connections (collective over the members), to the peers
    whose listeners' ``entries`` were gathered; no store operation but rank 0's verdict."""
    what = "the tcp lane connect"
    verdict = "connected/all"  # where rank 0 says that connecting failed (``backends.cpu``)

    def between(missing: list[int]) -> None:
        cpu_connect.check_dead(local, missing, prefix, what)
        cpu_connect.check_verdict(store, verdict, prefix, what)
        if deadline.passed():
            raise cpu_connect.timed_out(prefix, deadline, what, missing, "never connected")

    # Spin before blocking only when this host's members each have a core (``local``: the
    # members on this host, by pid), as the shm wait policy does.
    spin_s = 0.0 if WaitPolicy(len(local) + 1).oversubscribed else tcp_lane.SPIN_S
    try:
        return tcp_lane.connect(
            listener.sock,
            listener.token,
            rank,
            size,
            _dialable(entries),
            deadline.end,
            between,
            spin_s,
        )
    except OSError as exc:
        raise CommError(f"{prefix}{what} failed: {exc}") from exc


def _use_shm(mode: str, peers: list[tuple[str, int]], rank: int, name: str) -> bool:
    """Shared memory when every member shares this host (``tcp`` forces gloo)."""
    if mode == "tcp":
        return False
    me = peers[rank][0]
    local = all(host == me for host, _ in peers)
    reason = shm_ops.unsupported_reason()
    if mode == "shm":
        where = f"[TorchCommGloo comm={name} rank={rank}] transport=shm requested but"
        if reason is not None:
            raise CommError(f"{where} unavailable: {reason}")
        if not local:
            hosts = len({host for host, _ in peers})
            raise CommError(f"{where} the members span {hosts} hosts; use auto or tcp")
    return local and reason is None
