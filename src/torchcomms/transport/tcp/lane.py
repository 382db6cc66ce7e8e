"""``Lane``: a communicator's small all_gathers over direct TCP connections, on the op's thread.

Why not gloo: from Python, every gloo call crosses three threads on each rank (the
caller, the process group's worker, gloo's socket loop).  On a small or busy host those
hand-offs, not the bytes, are most of a small op's time (hundreds of microseconds on 2
cores).  The lane writes to its sockets and blocks in ``poll`` on the calling thread: one
wake-up per round.  The tcp path sends every collective's header (and small payloads)
through it, so the mismatch check rides in the same messages as the data.

**Algorithm.**  Bruck's all_gather: ``ceil(log2 n)`` rounds; in round ``k`` (``d = 2**k``)
rank ``r`` sends the blocks it holds, ``r .. r+c-1`` (``c = min(d, n - d)``), to ``r - d``
and receives ``r+d .. r+d+c-1`` from ``r + d`` (mod ``n``).  Each rank holds one
connection per round and direction: it dials the rank it receives from in that round
and accepts the one it sends to (``transport.tcp.meet``, which also passes the peers'
addresses along), so ``2 ceil(log2 n)`` sockets per rank, with ``TCP_NODELAY``.

**Frames.**  ``u32 length`` then the body: ``c`` blocks, each ``u32 length`` + bytes.  A
length of ``0xFFFFFFFF`` starts a control frame (``u32 length`` + UTF-8 text): ``BYE``
(the communicator was finalized) or ``FAILED kind ranks`` (it failed, blaming ``ranks``).
A connection that ends without either means the peer's process is gone.

**Waits.**  First a spin (only when every rank of this host has a core: a poll wake-up
of an idle vCPU costs 0.1-4 ms on a small VM, far more than the bytes; a millisecond, or
a tenth of that while every core is taken, and none for a peer queued on this core:
``spin_budget``), then ``poll`` in slices of
``SLICE_MS``; between slices the caller's ``between``
callback checks the abort flag, the peers' liveness and the deadline (it raises).
Sends are non-blocking, progressed in the same loop, so no pair of ranks can deadlock.

Threads: one op at a time per communicator runs ``all_gather`` (the op's thread);
``goodbye`` and ``close`` run on the thread that fails or closes the communicator.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

from torchcomms.transport.contention import cores_busy, on_this_core
from torchcomms.transport.tcp.posted import Owed, OwedCheck
from torchcomms.transport.tcp.sockets import LowWater

#: How long one ``poll`` may block before the caller's checks run.
SLICE_MS = 50
#: How long a receive spins (non-blocking reads) before it blocks in ``poll``, when
#: spinning is allowed (``Lane(spin_s=...)``) and the cores are free
#: (``transport.contention``); ``BUSY_SPIN_S`` when they are all taken.
SPIN_S = 1e-3
BUSY_SPIN_S = 100e-6
#: A transfer at least this large streams: its waits block from the start (no spin), so
#: the cores go to the network stack and the peer, which set its pace (2 simulated hosts,
#: 64 MiB broadcast: 1.73 cores busy spinning against gloo's 1.2, at 0.78 of its speed).
#: Below it a wake-up of an idle vCPU costs more than the spin (1 MiB over loopback:
#: 0.8 of Open MPI's time with the spin, 0.46 without).
STREAM_BYTES = 4 << 20
#: How long what a peer's header said of its core is trusted (``Lane.shares_core``): the
#: scheduler moves ranks, and a wait skips its spin on that word alone.
CORES_FRESH_S = 0.05
_U32 = struct.Struct("<I")
_CONTROL = 0xFFFF_FFFF
_START_CAP = 1 << 16
_IN = select.POLLIN | select.POLLPRI
_BAD = select.POLLERR | select.POLLHUP | select.POLLNVAL


class LanePeerGone(Exception):
    """A peer's connection ended: ``said`` is its goodbye (``BYE``, ``FAILED …``) or None;
    ``cause`` what the socket raised when the connection broke (a reset, the kernel giving
    it up), None when it simply ended."""

    def __init__(self, peer: int, said: str | None, cause: str | None = None) -> None:
        ended = said or (f"connection broke ({cause})" if cause else "connection ended")
        super().__init__(f"rank {peer}: {ended}")
        self.peer = peer
        self.said = said
        self.cause = cause


def broken(exc: OSError) -> str:
    """What a socket's error says, for a message: ``ETIMEDOUT (Connection timed out)``."""
    name = errno.errorcode.get(exc.errno or 0, "")
    text = exc.strerror or str(exc)
    return f"{name} ({text})" if name else text


def socket_error(sock: socket.socket) -> str:
    """The pending error of a socket ``poll`` reported as broken."""
    try:
        code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    except OSError:  # closed meanwhile
        code = 0
    return broken(OSError(code, os.strerror(code))) if code else "the connection was closed"


class LaneProtocolError(RuntimeError):
    """A peer sent bytes that are not a lane frame (another program on the port?)."""


class LaneOversize(LaneProtocolError):
    """A block larger than the exchange's rows: the peer runs another op (a ring op's frame
    carries more).  ``head`` is the block's first bytes (where a header sits)."""

    def __init__(self, peer: int, length: int, cap: int, head: bytes) -> None:
        super().__init__(f"rank {peer} sent a block of {length} B (at most {cap} fit)")
        self.peer = peer
        self.head = head


def rounds(rank: int, size: int) -> list[tuple[int, int]]:
    """``(send_to, recv_from)`` of each round of Bruck's all_gather."""
    out = []
    d = 1
    while d < size:
        out.append(((rank - d) % size, (rank + d) % size))
        d *= 2
    return out


class _Inbox:
    """Bytes read from one connection and not consumed yet (one frame at a time)."""

    __slots__ = ("_body", "buf", "end", "eof", "error", "low_water", "sock", "start", "view")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        #: Raised only inside a ring step that streams into a tensor (``ring.Ring.step``).
        self.low_water = LowWater(sock)
        self.buf = bytearray(_START_CAP)
        self.view = memoryview(self.buf)
        self.start = 0
        self.end = 0
        self.eof = False
        #: What the socket raised when the connection broke (``broken``), or None.
        self.error: str | None = None
        self._body = 0

    def fill(self) -> None:
        """Read what is there (non-blocking); at the end of the stream set ``eof``."""
        if self.end == len(self.buf):
            self._make_room(self.end - self.start + 1)
        try:
            got = self.sock.recv_into(self.view[self.end :])
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # reset, or given up by the kernel: the connection is gone
            self.error, got = broken(exc), 0
        if got == 0:
            self.eof = True
        self.end += got

    def _make_room(self, need: int) -> None:
        held = self.end - self.start
        if need > len(self.buf):
            grown = bytearray(max(need, 2 * len(self.buf)))
            grown[:held] = self.view[self.start : self.end]
            self.view.release()
            self.buf, self.view = grown, memoryview(grown)
        else:
            self.view[:held] = self.view[self.start : self.end]
        self.start, self.end = 0, held

    def frame(self, peer: int) -> memoryview | None:
        """The next complete frame's body, or None; raises on a goodbye or a lost peer."""
        held = self.end - self.start
        if held >= 4:
            length = _U32.unpack_from(self.buf, self.start)[0]
            if length == _CONTROL:
                if held >= 8:
                    text_len = _U32.unpack_from(self.buf, self.start + 4)[0]
                    if held >= 8 + text_len:
                        at = self.start + 8
                        said = bytes(self.view[at : at + text_len]).decode(errors="replace")
                        raise LanePeerGone(peer, said)
            elif held >= 4 + length:
                self._body = length
                return self.view[self.start + 4 : self.start + 4 + length]
            elif 4 + length > len(self.buf) - self.start:
                self._make_room(4 + length)
        if self.eof:
            raise LanePeerGone(peer, None, self.error)
        return None

    def consume(self) -> None:
        self.start += 4 + self._body
        if self.start == self.end:
            self.start = self.end = 0

    def read_into(self, dst: memoryview) -> int:
        """Bytes into ``dst``: buffered ones first, then straight from the socket (no copy
        through the buffer).  How many; 0 when none are there yet; -1 at the end."""
        held = self.end - self.start
        if held:
            n = min(held, len(dst))
            dst[:n] = self.view[self.start : self.start + n]
            self.start += n
            if self.start == self.end:
                self.start = self.end = 0
            return n
        if self.eof:
            return -1
        try:
            got = self.sock.recv_into(dst)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as exc:
            self.error, got = broken(exc), 0
        if got == 0:
            self.eof = True
            return -1
        return got


class LaneRound:
    """One round's two connections: ``out`` to ``send_to``, ``inbox`` from ``recv_from``.
    ``out_failed``: why ``out`` broke, once that was left to the receive side to explain
    (``out_error``); ``out`` is then no longer polled or sent on."""

    __slots__ = ("inbox", "out", "out_failed", "poller", "recv_from", "send_to")

    def __init__(self, send_to: int, recv_from: int, out: socket.socket, inp: socket.socket):
        self.send_to = send_to
        self.recv_from = recv_from
        self.out = out
        self.inbox = _Inbox(inp)
        self.poller = select.poll()
        self.poller.register(inp, _IN)
        # ``out`` too, for no event but its errors (POLLERR/POLLHUP are always reported): a
        # connection the kernel gave up or the peer's host reset shows while this rank waits
        # to receive, not only at its next send (``transport.tcp.sockets``).
        self.poller.register(out, 0)
        self.out_failed: str | None = None

    def wants_room(self, on: bool) -> None:
        """Poll ``out`` for room to send (``on``) or for its errors alone."""
        if self.out_failed is None:
            self.poller.modify(self.out, select.POLLOUT if on else 0)


#: Socket errors that mean this rank's own kernel gave the connection up (its bytes went
#: unacknowledged for the user timeout, a keepalive went unanswered, no route): nobody else
#: will explain it, so the op fails at once.
GAVE_UP = ("ETIMEDOUT", "EHOSTUNREACH", "ENETUNREACH", "EHOSTDOWN", "ENETDOWN")


def out_error(rd: LaneRound, cause: str) -> None:
    """``rd.out`` broke (``poll`` said so, or a send raised ``cause``).  Raise now when this
    rank's kernel gave it up, or when the same peer sends this round's inbox (a goodbye
    waiting there is reported as what it is: an orderly end, a failure the peer explained).
    Otherwise (a reset or closed end, n > 2) the receive side says who failed and why, as
    the failure travels the lane: ``out`` is only set aside."""
    if cause.startswith(GAVE_UP) or rd.recv_from == rd.send_to:
        inbox = rd.inbox
        inbox.fill()
        try:
            inbox.frame(rd.recv_from)  # a data frame is left where it is: the op fails anyway
        except LanePeerGone as gone:
            if gone.said is not None:
                raise
        raise LanePeerGone(rd.send_to, None, cause)
    if rd.out_failed is None:
        rd.out_failed = cause
        with contextlib.suppress(KeyError, ValueError):
            rd.poller.unregister(rd.out)


class Lane:
    """The connected lane of one rank (see the module docstring)."""

    def __init__(
        self,
        rank: int,
        size: int,
        send_socks: Sequence[socket.socket],
        recv_socks: Sequence[socket.socket],
        spin_s: float = 0.0,
    ) -> None:
        self.rank = rank
        self.size = size
        #: How long a receive spins before blocking (0: never; see the module docstring).
        self.spin_s = spin_s
        self._rounds = [
            LaneRound(to, frm, s, r)
            for (to, frm), s, r in zip(rounds(rank, size), send_socks, recv_socks, strict=True)
        ]
        self._said_goodbye = False
        # Each rank's core when it last sent, and its kernel (``peer_cores``).
        self._cores: Any = None
        self._kernels: Any = None
        self._heard = -CORES_FRESH_S  # when they were last updated (``heard_cores``)
        #: Rank -> card (``transport.tcp.meet``): what each lane neighbour said of itself.
        self.cards: dict[int, str] = {}
        #: Two ranks: the frames the peer owes for ops this rank posted (``post``).
        rd0 = self._rounds[0] if size == 2 else None
        self.owed = Owed(rd0, lambda: self.await_in(rd0)) if rd0 is not None else None

    def all_gather(
        self,
        rows: memoryview,
        cap: int,
        lengths: list[int],
        between: Callable[[], None],
    ) -> None:
        """Every rank's block into ``rows`` (``size`` rows of ``cap`` bytes).

        The caller wrote its own block into its row and its length into ``lengths[rank]``;
        on return ``lengths`` holds every rank's.  ``between`` runs between wait slices and
        raises to give up (the connections then hold a partial exchange: the communicator
        must not be used again).
        """
        size, rank = self.size, self.rank
        if self.owed is not None and self.owed.checks:
            self.owed.settle(between)
        have = 1
        pack = _U32.pack
        for rd in self._rounds:
            count = min(have, size - have)
            parts: list[bytes | memoryview] = [b""]
            total = 0
            for j in range(count):
                b = (rank + j) % size
                length = lengths[b]
                parts.append(pack(length))
                parts.append(rows[b * cap : b * cap + length])
                total += 4 + length
            parts[0] = pack(total)
            unsent = None
            if rd.out_failed is None:
                try:
                    unsent = _send(rd.out, parts, 4 + total)
                except OSError as exc:
                    out_error(rd, broken(exc))
            inbox = rd.inbox
            body = inbox.frame(rd.recv_from)
            if body is None:
                inbox.fill()
                body = inbox.frame(rd.recv_from)
                if body is None and unsent is None and self.spin_s:
                    body = self._spin(rd)
            while body is None or unsent is not None:
                if unsent is not None:
                    rd.wants_room(True)
                events = rd.poller.poll(SLICE_MS)
                if unsent is not None:
                    rd.wants_room(False)
                if not events:
                    between()
                    continue
                for fd, ev in events:
                    if fd == rd.out.fileno():
                        if ev & _BAD:
                            out_error(rd, socket_error(rd.out))
                        if unsent is not None and rd.out_failed is None:
                            try:
                                unsent = _send_rest(rd.out, unsent)
                            except OSError as exc:
                                out_error(rd, broken(exc))
                        if rd.out_failed is not None:
                            unsent = None  # set aside: the receive side explains
                    elif ev & (_IN | _BAD) and body is None:
                        inbox.fill()
                if body is None:
                    body = inbox.frame(rd.recv_from)
            at = 0
            for j in range(count):
                b = (rank + have + j) % size
                length = _U32.unpack_from(body, at)[0]
                if length > cap or at + 4 + length > len(body):
                    head = bytes(body[at + 4 : at + 4 + min(length, 64)])
                    raise LaneOversize(rd.recv_from, length, cap, head)
                rows[b * cap : b * cap + length] = body[at + 4 : at + 4 + length]
                lengths[b] = length
                at += 4 + length
            inbox.consume()
            have += count

    def post(
        self,
        rows: memoryview,
        cap: int,
        lengths: list[int],
        check: OwedCheck,
        between: Callable[[], None],
    ) -> None:
        """Two ranks: this rank's block to the peer, as ``all_gather`` sends it, without
        waiting for the peer's: that one is owed, and ``check`` sees it later
        (``transport.tcp.posted``)."""
        assert self.size == 2 and self.owed is not None
        rd = self._rounds[0]
        length = lengths[self.rank]
        at = self.rank * cap
        parts: list[memoryview | bytes] = [
            _U32.pack(4 + length),
            _U32.pack(length),
            rows[at : at + length],
        ]
        while True:
            if rd.out_failed is not None:
                raise LanePeerGone(rd.send_to, None, rd.out_failed)
            left = send_some(rd.out, parts)
            if left is None:
                out_error(rd, socket_error(rd.out))
                continue
            if not left:
                break
            parts = left
            rd.wants_room(True)
            try:
                if not self.await_in(rd):
                    between()
            finally:
                rd.wants_room(False)
        self.owed.add(check, between)

    def await_in(self, rd: LaneRound) -> bool:
        """Block one slice for ``rd``'s peer; read what came into the inbox.  Whether
        anything happened; a connection that broke raises (``out_error``)."""
        events = rd.poller.poll(SLICE_MS)
        for fd, ev in events:
            if fd == rd.out.fileno():
                if ev & _BAD:
                    out_error(rd, socket_error(rd.out))
            elif ev & (_IN | _BAD):
                rd.inbox.fill()
        return bool(events)

    def peer_cores(self, cores: Any, kernels: Any) -> None:
        """Where to read each rank's core when it last sent and its kernel (indexable by
        rank, kept up to date by the caller: ``backends.cpu.tcp.exchange``'s headers,
        which calls ``heard_cores`` when they change)."""
        self._cores, self._kernels = cores, kernels

    def heard_cores(self) -> None:
        """The peers' cores were just updated (``peer_cores``)."""
        self._heard = time.monotonic()

    def spin_budget(self, peer: int = -1) -> float:
        """How long a wait for ``peer`` spins now: 0 when spinning is off, else ``spin_s``,
        or, while every core is taken (``transport.contention``), ``BUSY_SPIN_S``, and 0
        when ``peer`` last sent from the core this thread runs on.

        Why the last: with every core taken, the scheduler may leave both ranks on one
        core's queue (and the load on the other), where a spin holds the core the peer
        needs to answer: 0.35-0.45 ms per small op where 40-80 us is usual (2 ranks,
        ``bench --load 2 --vs gloo``; 45-100 us with the ranks pinned apart)."""
        if not self.spin_s:
            return 0.0
        if not cores_busy():
            return self.spin_s
        if self.shares_core(peer):
            return 0.0
        return min(self.spin_s, BUSY_SPIN_S)

    def shares_core(self, peer: int) -> bool:
        """Whether ``peer`` (-1: none) last sent from the core this thread runs on, on this
        kernel (this host, or a network namespace of it), within ``CORES_FRESH_S``."""
        if peer < 0 or self._kernels is None or time.monotonic() - self._heard > CORES_FRESH_S:
            return False
        return on_this_core(int(self._kernels[peer]), int(self._cores[peer]))

    def ring_round(self) -> LaneRound:
        """Round 0's connections: to ``rank - 1`` and from ``rank + 1`` (``transport.tcp.ring``)."""
        return self._rounds[0]

    def _spin(self, rd: LaneRound) -> memoryview | None:
        """Read without blocking for up to ``spin_s``: the frame, or None.  A pass asks the
        round's ``poll`` first (0.7 us) and reads only when it says so: a ``recv`` that
        finds nothing costs 3 us, its ``BlockingIOError`` included."""
        inbox = rd.inbox
        readable = rd.poller.poll
        give_up = time.perf_counter() + self.spin_budget(rd.recv_from)
        while time.perf_counter() < give_up:
            if not readable(0):
                continue
            inbox.fill()
            body = inbox.frame(rd.recv_from)
            if body is not None:
                return body
        return None

    def news(self) -> LanePeerGone | None:
        """A goodbye (or a lost connection) waiting at the head of a connection, read
        without blocking; data frames stay where they are, but for frames the peer owed
        (``post``), which are checked here.  For waits outside the lane."""
        if self.owed is not None and self.owed.checks:
            try:
                self.owed.settle(lambda: None, wait=False)
            except LanePeerGone as gone:
                return gone
        for rd in self._rounds:
            inbox = rd.inbox
            inbox.fill()
            try:
                inbox.frame(rd.recv_from)
            except LanePeerGone as gone:
                return gone
        return None

    def goodbye(self, text: str) -> None:
        """Tell every rank that receives from this one why it will not hear from it again."""
        if self._said_goodbye:
            return
        self._said_goodbye = True
        data = text.encode()
        frame = _U32.pack(_CONTROL) + _U32.pack(len(data)) + data
        for rd in self._rounds:
            with contextlib.suppress(OSError):
                rd.out.send(frame)  # best effort: a full buffer means the reader is gone

    def close(self) -> None:
        """Say ``BYE`` (unless a failure was said) and close every connection."""
        self.goodbye("BYE")
        for rd in self._rounds:
            for sock in (rd.out, rd.inbox.sock):
                with contextlib.suppress(OSError):
                    sock.close()


def _sent_now(send: Callable[[Any], int], data: Any) -> int | None:
    """What ``send`` (a non-blocking socket's ``send`` or ``sendmsg``) took of ``data`` now:
    0 when the socket is full, None when the connection is broken."""
    try:
        return send(data)
    except (BlockingIOError, InterruptedError):
        return 0
    except OSError:
        return None


def _send(sock: socket.socket, parts: list[bytes | memoryview], total: int) -> bytes | None:
    """Send without blocking; what did not fit, or None.  Every small op's path: the
    non-blocking step is written out here (``_sent_now`` costs a call and a bound method).
    A broken connection raises its ``OSError``: the op fails naming the peer at once."""
    try:
        sent = sock.sendmsg(parts)
    except (BlockingIOError, InterruptedError):
        sent = 0
    if sent == total:
        return None
    return b"".join(bytes(p) for p in parts)[sent:]


def send_some(
    sock: socket.socket, parts: list[memoryview | bytes]
) -> list[memoryview | bytes] | None:
    """Send what a non-blocking socket takes now: the parts left (``parts`` itself if
    nothing went), or None when the connection is broken.  For ``transport.tcp.ring`` and
    ``transport.tcp.p2p``, whose sends are large and progress between reads."""
    sent = _sent_now(sock.sendmsg, parts)
    if sent is None:
        return None
    if sent == 0:
        return parts
    left: list[memoryview | bytes] = []
    for i, p in enumerate(parts):
        if sent >= len(p):
            sent -= len(p)
            continue
        left.append(memoryview(p)[sent:] if sent else p)
        left.extend(parts[i + 1 :])
        break
    return left


def _send_rest(sock: socket.socket, rest: bytes) -> bytes | None:
    """What is left of ``rest`` after a non-blocking send; a broken connection raises."""
    try:
        sent = sock.send(rest)
    except (BlockingIOError, InterruptedError):
        sent = 0
    return rest[sent:] or None


# -- connecting ------------------------------------------------------------------------------
def listen(host: str) -> socket.socket:
    """This rank's lane listener on ``host`` (an ephemeral port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(64)
    return sock
