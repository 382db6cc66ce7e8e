"""``Liveness``: who of a gloo communicator is gone, and who never entered a timed-out op.

gloo's own errors neither name a peer nor reach the survivors that are not a dead
rank's ring neighbours, so the tcp and hierarchical paths keep their own facts:

* **Dead peers on this host**, from their pids (a zombie counts as dead), checked by a
  watcher thread every ``period_s``; an op waiting in gloo polls ``dead`` between
  short wait slices, so every survivor learns within about a period, whether or not it
  talks to the dead rank.
* **Dead peers on other hosts**, from a ring of side connections (only when the members
  span hosts): each rank listens on one socket and connects to its successor, so every
  rank is watched by its two ring neighbours at no cost while nothing happens (the
  watcher blocks in ``select``).  A connection that ends without the peer's goodbye
  (``BYE``, sent by ``close``) means its process is gone: the watcher marks it dead,
  tells its neighbours (``DEAD r``; each forwards what is news to it, so the whole ring
  learns in a few hops) and, if it lost its successor, connects to the next live rank.
  A peer that is alive but silent (stopped, a cut link) is not declared dead: the op's
  timeout names it.  Nor is one whose listener still answers (``cpu.tcp.probe``): a
  connection can end while its process lives, and a rank whose connections were all
  cut would otherwise believe, and gossip, that everyone it lost is gone.
* **Who entered which op**: the op thread bumps ``seq`` as it enters a collective (a
  plain int, no lock, never sent anywhere while ops run).  On a timeout the failing rank
  asks the members over a tree of their listeners (``cpu.tcp.census``) and names the ranks
  that are behind, silent or could not be asked, in bounded time at any N.

Threads: one daemon watcher per communicator (``torchcomms-liveness-NAME``), which also
accepts census requests and hands each to a census thread; ``dead`` is replaced whole (a
tuple), so readers on any thread need no lock.  ``close`` stops the watcher and waits for
it (bounded: ``CLOSE_WAIT_S``); on its way out the watcher closes its sockets and lets go
of the store, so nothing of the communicator (rank 0's store server above all) outlives
it waiting for the garbage collector.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch._C._distributed_c10d as c10d

from torchcomms.backends.cpu.tcp.census import Census, Verdict
from torchcomms.backends.cpu.tcp.probe import probe
from torchcomms.transport.gloo.process_group import reachable_address
from torchcomms.transport.procs import process_alive

logger = logging.getLogger("torchcomms.backends.cpu.tcp.liveness")

T = TypeVar("T")

#: How often the watcher checks pids.
PERIOD_S = 0.05


#: How long a timed-out op may spend asking the store who entered it.
_STORE_READ_S = 1.0
#: How long ``close`` waits for the watcher to end (it ends within a period unless it is
#: connecting to a successor, a failure path bounded by its connect timeout).
CLOSE_WAIT_S = 2.5


def process_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP, a debugger): alive, but never answers."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


class Liveness:
    """Per-communicator facts about the peers (see the module docstring)."""

    def __init__(
        self,
        store: c10d.Store,
        rank: int,
        peers: Sequence[tuple[str, int]],
        name: str,
        period_s: float = PERIOD_S,
        listener: socket.socket | None = None,
        address_of: Callable[[int], tuple[str, int] | None] | None = None,
    ) -> None:
        """``listener``: this rank's, whose address its neighbours learnt at connect, and
        ``address_of(rank)``: a member's (``cpu.select``); without them the watcher listens
        on a socket of its own and the members find each other under ``addr/{rank}``."""
        self.rank = rank
        self.size = len(peers)
        self._period_s = period_s
        me = peers[rank][0]
        self._hosts = [host for host, _ in peers]
        self._local = [(r, pid) for r, (host, pid) in enumerate(peers) if r != rank and host == me]
        self._pids = {r: pid for r, (host, pid) in enumerate(peers) if host == me}
        #: The collective this rank entered last (written by the op thread).
        self.seq = 0
        #: Ranks whose process is known gone, sorted.
        self.dead: tuple[int, ...] = ()
        #: The last census's verdict (``missing``), for the error's wording.
        self.verdict = Verdict()
        self.census = Census(self)
        self._stop = threading.Event()
        multi_host = len({h for h, _ in peers}) > 1
        self._ring = _Ring(self, store, listener, address_of, link=multi_host)
        self._thread = threading.Thread(
            target=self._watch, name=f"torchcomms-liveness-{name}", daemon=True
        )
        self._thread.start()

    def _watch(self) -> None:
        ring = self._ring
        try:
            while not self._stop.is_set():
                ring.poll(self._period_s)
                self.check_pids()
        finally:
            ring.close()

    def census_address(self, rank: int) -> tuple[str, int] | None:
        """Where ``rank``'s watcher listens (``cpu.tcp.census``)."""
        return self._ring.address(rank)

    def mark_dead(self, ranks: Sequence[int]) -> list[int]:
        """Add ``ranks`` to ``dead``; return those that are news (watcher thread).

        A rank on this host whose process is alive, or one on another host whose listener
        answers, is never dead, whoever says so (a peer whose connections were cut
        believes everyone it lost is gone)."""
        news = sorted(
            r
            for r in set(ranks) - set(self.dead)
            if not self.known_alive([r]) and not self.answers(r)
        )
        if news:
            self.dead = tuple(sorted(set(self.dead) | set(news)))
            logger.warning(
                "peer rank(s) %s of this communicator died",
                ", ".join(map(str, news)),
                extra={"rank": self.rank, "dead": news},
            )
        return news

    def known_alive(self, ranks: Sequence[int]) -> bool:
        """Whether one of ``ranks`` is this rank or a member on this host whose process is
        alive: what this rank can refute of a claim that they are dead."""
        pids = self._pids
        return any(r == self.rank or (r in pids and process_alive(pids[r])) for r in ranks)

    def answers(self, rank: int) -> bool:
        """Whether ``rank``, on another host, is shown alive by its listener (failure path
        only: a probe, bounded by about a second; False when it cannot tell)."""
        return self.probe_peer(rank) is True

    def probe_peer(self, rank: int) -> bool | None:
        """``rank``'s listener, on another host, asked (``cpu.tcp.probe``): True alive,
        False gone, None unreachable or not asked (failure path only, about a second)."""
        if not self._ring.link or rank in self._pids:
            return None
        ring = self._ring

        def ask() -> bool | None:
            address = ring.address(rank)
            return None if address is None else probe(address)

        # The store's host may be behind a cut link: never wait on it for long.
        return within(_STORE_READ_S, ask, "probe")

    def check_pids(self) -> tuple[int, ...]:
        """Refresh and return ``dead`` from the local peers' pids."""
        dead = [r for r, pid in self._local if r not in self.dead and not process_alive(pid)]
        if dead:
            self.dead = tuple(sorted(set(self.dead) | set(dead)))
        return self.dead

    def stopped(self) -> list[int]:
        """Local peers that are stopped (state T): alive, but not running."""
        return [r for r, pid in self._local if process_stopped(pid)]

    def missing(self, seq: int, ranks: Sequence[int] | None = None) -> list[int]:
        """Ranks (of ``ranks``, default all) that never entered collective ``seq``, did not
        answer, or could not be asked (``cpu.tcp.census``; the failure path only, bounded
        by ``census.BUDGET_S``).  ``verdict`` keeps the census's answer."""
        self.verdict = self.census.missing(seq)
        among = set(range(self.size) if ranks is None else ranks) - {self.rank}
        return sorted(self.verdict.missing() & among)

    def host_of(self, rank: int) -> str:
        """The host identity ``rank`` gave at connect (for messages)."""
        return self._hosts[rank]

    def elsewhere(self) -> list[int]:
        """The members on other hosts than this rank's."""
        return [r for r in range(self.size) if r != self.rank and r not in self._pids]

    def close(self) -> None:
        """Stop the watcher and wait for it (``CLOSE_WAIT_S``): its sockets are closed then."""
        self._stop.set()
        self._ring.wake()
        if self._thread is not threading.current_thread():
            self._thread.join(CLOSE_WAIT_S)


def within(seconds: float, call: Callable[[], T], what: str) -> T | None:
    """``call()`` on a daemon thread, given up after ``seconds`` (None; also if it raised).

    For failure-path reads of the store and probes of peers, which a cut link could block
    for a store's or socket's full timeout; the thread is left to end on its own."""
    found: list[T] = []

    def run() -> None:
        with contextlib.suppress(Exception):
            found.append(call())

    runner = threading.Thread(target=run, name=f"torchcomms-liveness-{what}", daemon=True)
    runner.start()
    runner.join(seconds)
    return found[0] if found else None


def _no_address(rank: int) -> tuple[str, int] | None:
    """Where a closed watcher looks members up: nowhere."""
    return None


class _Conn:
    """One side connection: the peer's rank (once it said ``HI``) and unparsed bytes."""

    __slots__ = ("peer", "pending")

    def __init__(self, peer: int | None) -> None:
        self.peer = peer
        self.pending = b""


class _Ring:
    """The watcher's listener and, across hosts (``link``), its side connections to the
    ring neighbours (watcher thread only)."""

    def __init__(
        self,
        owner: Liveness,
        store: c10d.Store,
        listener: socket.socket | None,
        address_of: Callable[[int], tuple[str, int] | None] | None,
        link: bool,
    ) -> None:
        self.owner = owner
        self.rank = owner.rank
        self.size = owner.size
        self.store: c10d.Store | None = store
        self.link = link
        self.sel = selectors.DefaultSelector()
        self._address_of = address_of
        if listener is None:
            host = reachable_address(store) if link else "127.0.0.1"
            listener = socket.create_server((host, 0), backlog=64)
            store.set(f"addr/{self.rank}", f"{host}:{listener.getsockname()[1]}")
        self.listener = listener
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ, None)
        # ``wake`` (any thread) ends the watcher's current ``select`` at once: a finalize
        # need not wait out a period for the watcher to see it.
        self._waker, self._woken = socket.socketpair()
        self._woken.setblocking(False)
        self.sel.register(self._woken, selectors.EVENT_READ, None)
        self.conns: dict[socket.socket, _Conn] = {}
        self.succ: socket.socket | None = None
        self._addresses: dict[int, tuple[str, int]] = {}
        if link:
            self._connect_successor(self.rank)

    def _connect_successor(self, after: int) -> None:
        """Connect to the first live rank after ``after`` (ranks refusing are dead)."""
        owner = self.owner
        r = (after + 1) % self.size
        while r != self.rank:
            if r not in owner.dead:
                try:
                    if self._address_of is None and self.store is not None:
                        self.store.wait([f"addr/{r}"])
                    address = self.address(r)
                    assert address is not None
                    sock = socket.create_connection(address, timeout=2.0)
                except ConnectionRefusedError:  # its listener is gone: so is it
                    self._learned([r])
                except Exception:
                    logger.debug("liveness: cannot reach rank %d", r, exc_info=True)
                    return  # unreachable is not dead; stay without a successor
                else:
                    sock.setblocking(False)
                    sock.sendall(f"HI {self.rank}\n".encode())
                    self._register(sock, r)
                    self.succ = sock
                    return
            r = (r + 1) % self.size

    def address(self, rank: int) -> tuple[str, int] | None:
        """``rank``'s listener, once it published it (any thread; cached)."""
        if self._address_of is not None:
            return self._address_of(rank)
        found = self._addresses.get(rank)
        if found is None:
            key = f"addr/{rank}"
            if self.store is None or not self.store.check([key]):
                return None
            host, _, port = self.store.get(key).decode().rpartition(":")
            found = self._addresses[rank] = (host, int(port))
        return found

    def _register(self, sock: socket.socket, peer: int | None) -> None:
        self.conns[sock] = _Conn(peer)
        self.sel.register(sock, selectors.EVENT_READ, None)

    def poll(self, timeout_s: float) -> None:
        for key, _ in self.sel.select(timeout_s):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            if sock is self._woken:
                with contextlib.suppress(OSError):
                    self._woken.recv(64)
                continue
            if sock is self.listener:
                try:
                    conn, _ = self.listener.accept()
                except OSError:
                    continue
                conn.setblocking(False)
                self._register(conn, None)
                continue
            try:
                data = sock.recv(4096)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            if data:
                self._handle(sock, data)
            else:
                self._lost(sock)

    def _handle(self, sock: socket.socket, data: bytes) -> None:
        state = self.conns[sock]
        *lines, state.pending = (state.pending + data).split(b"\n")
        for line in lines:
            word, _, arg = line.decode(errors="replace").partition(" ")
            if word == "HI":
                state.peer = int(arg)
            elif word == "PING":  # a probe (``cpu.tcp.probe``): yes, alive
                with contextlib.suppress(OSError):
                    sock.send(b"PONG\n")
            elif word in ("ASK", "FULL"):  # a census request: the census thread owns it now
                with contextlib.suppress(OSError):
                    sock.send(b"ACK\n")
                self.conns.pop(sock, None)
                with contextlib.suppress(KeyError, ValueError):
                    self.sel.unregister(sock)
                self.owner.census.answer(sock, line.decode(errors="replace"))
                return
            elif word == "DEAD":
                claimed = [int(x) for x in arg.split(",") if x]
                if self.owner.known_alive(claimed):
                    # A peer whose own connections were cut believes everyone it lost is
                    # gone: a claim this rank can refute discredits the whole message.
                    logger.debug("liveness: ignoring DEAD %s from a confused peer", arg)
                else:
                    self._learned(claimed)
            elif word == "BYE":
                state.peer = None  # an orderly close: not a death
                self._drop(sock)
                return

    def _lost(self, sock: socket.socket) -> None:
        peer = self.conns[sock].peer
        was_succ = sock is self.succ
        self._drop(sock)
        if peer is not None:
            self._learned([peer])
            if was_succ:  # from the next live rank on: ``peer`` itself if it answered
                self._connect_successor(peer if peer in self.owner.dead else peer - 1)

    def _drop(self, sock: socket.socket) -> None:
        if sock is self.succ:
            self.succ = None
        self.conns.pop(sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(sock)
        sock.close()

    def _learned(self, ranks: Sequence[int]) -> None:
        news = self.owner.mark_dead(ranks)
        if news:
            self._send(f"DEAD {','.join(map(str, self.owner.dead))}\n".encode())

    def wake(self) -> None:
        """End the watcher's current wait (any thread)."""
        with contextlib.suppress(OSError):
            self._waker.send(b"x")

    def _send(self, msg: bytes) -> None:
        for sock in list(self.conns):
            with contextlib.suppress(OSError):
                sock.send(msg)

    def close(self) -> None:
        self._send(b"BYE\n")
        for sock in list(self.conns):
            self._drop(sock)
        self.sel.unregister(self.listener)
        self.listener.close()
        self.sel.close()
        self._woken.close()
        self._waker.close()
        # The store (rank 0's server, for rank 0) and the addresses read from it go with
        # the comm, not with whatever still refers to this object.
        self.store = None
        self._address_of = _no_address
