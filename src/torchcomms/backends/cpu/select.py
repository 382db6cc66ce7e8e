"""Which transport a CPU communicator uses, and connecting it (collective over the members).

* shm (``cpu.shm.ops``) when every member shares this host;
* hierarchical (``cpu.hier.ops``) when members span hosts and some host holds several;
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
from torchcomms.backends.cpu.hier import leaders
from torchcomms.backends.cpu.hier import ops as hier
from torchcomms.backends.cpu.hier.members import Members
from torchcomms.backends.cpu.ops import CpuOps
from torchcomms.backends.cpu.shm import ops as shm_ops
from torchcomms.backends.cpu.tcp import census
from torchcomms.backends.cpu.tcp.liveness import Liveness, within
from torchcomms.backends.cpu.tcp.ops import TcpOps
from torchcomms.backends.cpu.tcp.waits import GLOO_MARGIN
from torchcomms.errors import CommError
from torchcomms.runtime.deadline import Deadline
from torchcomms.transport import placement
from torchcomms.transport.gloo import process_group as gloo
from torchcomms.transport.tcp import lane as tcp_lane
from torchcomms.transport.tcp import meet as tcp_meet
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


def open_ops(
    mode: str,
    store: c10d.Store,
    name: str,
    rank: int,
    members: Members,
    options: CommOptions,
) -> CpuOps:
    """The one ops object of a comm; ``mode`` is ``auto``, ``shm`` or ``tcp``.

    Learns what it needs of ``members`` on the way: this host's pids (from the segment on
    shm, ``host/pids/{h}`` otherwise)."""
    size = members.size
    here = members.local_ranks()
    # Before any wait policy is built: they count the cores the ranks run on.
    placement.place(
        config.cpu_affinity(options.hints.get("cpu_affinity")), here.index(rank), len(here)
    )
    prefix = cpu_connect.connect_prefix(name, rank)
    if _use_shm(mode, members, name):
        if rank == 0:  # it writes every member's pid into the segment
            cpu_connect.read_host_pids(store, members)
        collectives = shm_ops.open_collectives(
            c10d.PrefixStore("shm", store),
            rank,
            size,
            members.pids,
            options.hints,
            options.timeout,
            f"comm={name}",
        )
        members.learn(range(size), collectives.chan.pids)
        return shm_ops.ShmOps(collectives)
    cpu_connect.read_host_pids(store, members)
    peers = members.peers()
    lazy = config.gloo_lazy_init(options.hints.get("lazy"))
    hosts = [host for host, _ in peers]
    desc, device = gloo.choose_device(options.hints, hosts, hosts[rank], lazy)
    local = cpu_connect.local_pids(peers, rank)
    deadline = Deadline(options.timeout)
    lane_host = "127.0.0.1" if members.all_local else None
    listeners = [_Listener(store, lane_host, options.hints) for _ in range(3)]
    p2p_listener, lane_listener, watch_listener = listeners
    # The listeners' addresses (O(1) store round trips and bytes per rank): each member
    # reads its successor's; the lane's handshakes pass on the rest of its
    # neighbours' (``transport.tcp.meet``); point-to-point peers are read at a pair's
    # first use.  Also where the members meet before gloo's connect: that holds the GIL
    # while it waits for a peer, so a member that died since the identity exchange is
    # named now.
    card = "|".join(listener.entry for listener in listeners)
    try:
        successor = _successor_card(store, members, card, deadline, local, prefix)
    except BaseException:
        for listener in listeners:
            listener.sock.close()
        raise
    p2p = listen_p2p(p2p_listener, rank, _StoreAddresses(store, _P2P), local)
    try:
        lane = connect_lane(
            lane_listener, store, rank, size, card, successor, deadline, local, prefix
        )
    except BaseException:
        p2p.close()
        watch_listener.sock.close()
        raise
    near = _Neighbours(store, lane.cards)
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
        watch_listener.sock.close()
        raise
    liveness = Liveness(
        c10d.PrefixStore("lv", store),
        rank,
        peers,
        name,
        config.liveness_period_s(),
        watch_listener.sock,
        near.watch_address,
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


#: The fields of a member's ``connect.LISTENERS`` entry: ``p2p|lane|watch``.
_P2P, _LANE, _WATCH = range(3)


def _parse_entry(entry: str) -> tuple[str, int, str]:
    """``(host, port, token)`` from a listener's ``token port host`` entry."""
    token, port, host = entry.split(" ", 2)
    return host, int(port), token


class _Neighbours:
    """The watch listeners of this rank's lane neighbours (r +- 2^j: its ring successor
    and its census tree links among them), from the lane's handshakes; any other
    member's is read from the store."""

    def __init__(self, store: c10d.Store, cards: Mapping[int, str]) -> None:
        self._watch = {r: _parse_entry(c.split("|")[_WATCH])[:2] for r, c in cards.items()}
        self._others = _StoreAddresses(store, _WATCH)

    def watch_address(self, rank: int) -> tuple[str, int] | None:
        """A member's watch listener (any thread; the store only past the neighbours)."""
        found = self._watch.get(rank)
        if found is not None:
            return found
        # The store's host may be behind a cut link: never wait on it for long.
        entry = within(census.ADDRESS_S, lambda: self._others(rank), "address")
        return None if entry is None else entry[:2]


def _lane_address(card: str) -> tuple[str, int, str]:
    """A member's lane listener, from its ``p2p|lane|watch`` card."""
    return _parse_entry(card.split("|")[_LANE])


def _successor_card(
    store: c10d.Store,
    members: Members,
    card: str,
    deadline: Deadline,
    local: Mapping[int, int],
    prefix: str,
) -> str:
    """Publish this rank's listeners (``card``); once every member has (``cpu.hier.leaders``:
    through the host leaders), read rank + 1's: O(1) store round trips and bytes."""
    key = cpu_connect.LISTENERS
    store.set(f"{key}/{members.rank}", card)
    what = "the gloo connect"
    leaders.rendezvous(
        store, cpu_connect.LISTENERS_MET, members, deadline, local, prefix, what, posted=key
    )
    return store.get(f"{key}/{(members.rank + 1) % members.size}").decode()


class _StoreAddresses:
    """Rank -> a peer's ``(host, port, token)`` for one of its three listeners, read from the
    store at the first dial of that peer (one ``get``; cached): what each pair costs the
    store, instead of every member reading every member's address."""

    def __init__(self, store: c10d.Store, which: int) -> None:
        self._store = store
        self._which = which
        self._known: dict[int, tuple[str, int, str]] = {}

    def __call__(self, rank: int) -> tuple[str, int, str]:
        found = self._known.get(rank)
        if found is None:
            value = self._store.get(f"{cpu_connect.LISTENERS}/{rank}").decode()
            found = self._known[rank] = _parse_entry(value.split("|")[self._which])
        return found


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


def listen_p2p(
    listener: _Listener,
    rank: int,
    address_of: Callable[[int], tuple[str, int, str]],
    local: Mapping[int, int],
) -> tcp_p2p.P2P:
    """This rank's point-to-point engine (``transport.tcp_p2p``) on ``listener``; a peer
    (``address_of(rank)``: ``(host, port, token)``) is dialled on first use."""
    policy = WaitPolicy(len(local) + 1, pids=local.values())
    # Ranks sharing cores: no spin (it would hold a peer's core), but yield for as long
    # as an shm wait does before sleeping in ``poll``.
    spin_s, yield_s = (0.0, policy.yield_s) if policy.oversubscribed else (tcp_p2p.SPIN_S, 0.0)
    return tcp_p2p.P2P(rank, listener.sock, listener.token, address_of, spin_s, yield_s)


def connect_lane(
    listener: _Listener,
    store: c10d.Store,
    rank: int,
    size: int,
    card: str,
    successor: str,
    deadline: Deadline,
    local: Mapping[int, int],
    prefix: str,
) -> tcp_lane.Lane:
    """This rank's ``transport.tcp.lane`` connections (collective over the members), met
    through ``transport.tcp.meet`` from its successor's ``card``; no store operation but
    rank 0's verdict."""
    what = "the tcp lane connect"
    verdict = "connected/all"  # where rank 0 says that connecting failed (``backends.cpu``)

    def between(missing: list[int]) -> None:
        cpu_connect.check_dead(local, missing, prefix, what)
        cpu_connect.check_verdict(store, verdict, prefix, what)
        if deadline.passed():
            raise cpu_connect.timed_out(prefix, deadline, what, missing, "never connected")

    # Spin before blocking only when this host's members each have a core (``local``: the
    # members on this host, by pid), as the shm wait policy does.
    spin_s = (
        0.0 if WaitPolicy(len(local) + 1, pids=local.values()).oversubscribed else tcp_lane.SPIN_S
    )
    try:
        return tcp_meet.connect(
            listener.sock,
            listener.token,
            rank,
            size,
            card,
            successor,
            _lane_address,
            deadline.end,
            between,
            spin_s,
        )
    except OSError as exc:
        raise CommError(f"{prefix}{what} failed: {exc}") from exc


def _use_shm(mode: str, members: Members, name: str) -> bool:
    """Shared memory when every member shares this host (``tcp`` forces gloo)."""
    if mode == "tcp":
        return False
    reason = shm_ops.unsupported_reason()
    if mode == "shm":
        where = f"[TorchCommGloo comm={name} rank={members.rank}] transport=shm requested but"
        if reason is not None:
            raise CommError(f"{where} unavailable: {reason}")
        if not members.all_local:
            raise CommError(f"{where} the members span {members.host_count} hosts; use auto or tcp")
    return members.all_local and reason is None
