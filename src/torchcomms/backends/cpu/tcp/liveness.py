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
  plain int store, no lock); the watcher publishes it to the store when it changed
  (``lv/seq/{rank}``: one ``set`` per publish period at most, O(1) per rank).  The
  publish period is the watch period, stretched at scale so that all members together
  publish at most ``PUBLISH_BUDGET_PER_S`` times a second (``publish_period_s``): the
  store's load stays bounded at any N.  On a timeout the failing rank waits two publish
  periods, reads every member's value once (the failure path only) and names the ranks
  that never entered.

Threads: one daemon watcher per communicator (``torchcomms-liveness-NAME``); ``dead``
is replaced whole (a tuple), so readers on any thread need no lock.  ``close`` stops the
watcher within a period.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch._C._distributed_c10d as c10d

from torchcomms.backends.cpu.tcp.probe import probe
from torchcomms.transport.gloo.process_group import reachable_address
from torchcomms.transport.procs import process_alive

logger = logging.getLogger("torchcomms.backends.cpu.tcp.liveness")

T = TypeVar("T")

#: How often the watcher checks pids and publishes this rank's op sequence number.
PERIOD_S = 0.05
#: Liveness publishes per second that all members of a comm may send the store together
#: (at most; ops must run for any to be sent): about an eighth of what one TCPStore
#: served here with 8 clients (``benchmarks/diagnostics/scale_model.py``).  Up to 250
#: members this leaves the period at ``PERIOD_S``.
PUBLISH_BUDGET_PER_S = 5000.0


def publish_period_s(size: int, period_s: float = PERIOD_S) -> float:
    """How often a member of a ``size``-member comm publishes its op sequence number."""
    return max(period_s, size / PUBLISH_BUDGET_PER_S)


#: How long a timed-out op may spend asking the store who entered it.
_STORE_READ_S = 1.0


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
    ) -> None:
        self.rank = rank
        self.size = len(peers)
        self._store = store
        self._period_s = period_s
        me = peers[rank][0]
        self._local = [(r, pid) for r, (host, pid) in enumerate(peers) if r != rank and host == me]
        self._pids = {r: pid for r, (host, pid) in enumerate(peers) if host == me}
        #: The collective this rank entered last (written by the op thread).
        self.seq = 0
        self._published = 0
        self._publishing = True
        self._publish_every_s = publish_period_s(self.size, period_s)
        self._next_publish = 0.0
        #: Ranks whose process is known gone, sorted.
        self.dead: tuple[int, ...] = ()
        self._stop = threading.Event()
        self._ring = _Ring(self, store, peers) if len({h for h, _ in peers}) > 1 else None
        self._thread = threading.Thread(
            target=self._watch, name=f"torchcomms-liveness-{name}", daemon=True
        )
        self._thread.start()

    def _watch(self) -> None:
        ring = self._ring
        while not self._stop.is_set():
            if ring is not None:
                ring.poll(self._period_s)
            elif self._stop.wait(self._period_s):
                break
            self.check_pids()
            seq = self.seq
            now = time.monotonic()
            if seq != self._published and self._publishing and now >= self._next_publish:
                self._next_publish = now + self._publish_every_s
                try:
                    self._store.set(f"seq/{self.rank}", str(seq))
                    self._published = seq
                except Exception:
                    # The store's server is gone (its rank died): stop, or c10d would log a
                    # broken pipe every period.  Pids and the ring still tell who is alive.
                    self._publishing = False
                    logger.debug("liveness: publishing seq failed; stopped", exc_info=True)
        if ring is not None:
            ring.close()

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
        return any(
            r == self.rank or (r in pids and process_alive(pids[r])) for r in ranks
        )

    def answers(self, rank: int) -> bool:
        """Whether ``rank``, on another host, is shown alive by its listener (failure path
        only: a probe, bounded by about a second; False when it cannot tell)."""
        if self._ring is None or rank in self._pids:
            return False
        ring = self._ring

        def ask() -> bool | None:
            address = ring.address(rank)
            return None if address is None else probe(address)

        # The store's host may be behind a cut link: never wait on it for long.
        return bool(within(_STORE_READ_S, ask, "probe"))

    def check_pids(self) -> tuple[int, ...]:
        """Refresh and return ``dead`` from the local peers' pids."""
        dead = [
            r for r, pid in self._local if r not in self.dead and not process_alive(pid)
        ]
        if dead:
            self.dead = tuple(sorted(set(self.dead) | set(dead)))
        return self.dead

    def stopped(self) -> list[int]:
        """Local peers that are stopped (state T): alive, but not running."""
        return [r for r, pid in self._local if process_stopped(pid)]

    def missing(self, seq: int, ranks: Sequence[int] | None = None) -> list[int] | None:
        """Ranks (of ``ranks``, default all) that never entered collective ``seq``, or
        None when the store cannot tell within a second (its host unreachable).

        Failure path only: waits two publish periods so live peers' watchers publish, then
        reads every member's published sequence number (a rank with none entered nothing).
        """
        time.sleep(2 * self._publish_every_s)
        among = [r for r in (range(self.size) if ranks is None else ranks) if r != self.rank]

        def read() -> list[int]:
            keys = [f"seq/{r}" for r in among]
            store = self._store
            if store.check(keys):  # all published: one round trip
                values = [int(bytes(v).decode()) for v in store.multi_get(keys)]
            else:
                values = [int(store.get(k).decode()) if store.check([k]) else 0 for k in keys]
            return [r for r, v in zip(among, values, strict=True) if v < seq]

        # A store behind a cut link would block for its timeout.
        return within(_STORE_READ_S, read, "read")

    def elsewhere(self) -> list[int]:
        """The members on other hosts than this rank's."""
        return [r for r in range(self.size) if r != self.rank and r not in self._pids]

    def close(self) -> None:
        self._stop.set()


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


class _Conn:
    """One side connection: the peer's rank (once it said ``HI``) and unparsed bytes."""

    __slots__ = ("peer", "pending")

    def __init__(self, peer: int | None) -> None:
        self.peer = peer
        self.pending = b""


class _Ring:
    """The side connections of a multi-host communicator (watcher thread only)."""

    def __init__(
        self, owner: Liveness, store: c10d.Store, peers: Sequence[tuple[str, int]]
    ) -> None:
        self.owner = owner
        self.rank = owner.rank
        self.size = len(peers)
        self.store = store
        self.sel = selectors.DefaultSelector()
        host = reachable_address(store)
        self.listener = socket.create_server((host, 0), backlog=16)
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ, None)
        store.set(f"addr/{self.rank}", f"{host}:{self.listener.getsockname()[1]}")
        self.conns: dict[socket.socket, _Conn] = {}
        self.succ: socket.socket | None = None
        self._addresses: dict[int, tuple[str, int]] = {}
        self._connect_successor(self.rank)

    def _connect_successor(self, after: int) -> None:
        """Connect to the first live rank after ``after`` (ranks refusing are dead)."""
        owner = self.owner
        r = (after + 1) % self.size
        while r != self.rank:
            if r not in owner.dead:
                try:
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
        found = self._addresses.get(rank)
        if found is None:
            key = f"addr/{rank}"
            if not self.store.check([key]):
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
