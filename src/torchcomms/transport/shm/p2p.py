"""Point-to-point over shared memory: a two-slot ring per ordered pair, progressed on demand.

Chunk ``i`` (counted over the pair's lifetime) goes to ring slot ``i % 2``.  The sender
writes it once the receiver has acknowledged chunk ``i - 2`` and bumps ``SENT``; the
receiver copies it out once ``SENT >= i`` and bumps ``ACKED``.  Each chunk's meta line
carries the message's byte count and tag.

Matching follows c10d: messages between two ranks with the same tag (or both untagged)
match in issue order; differently tagged ones may be received in any order.  An incoming
message goes to the first posted receive with its tag, else into a private "unexpected"
buffer that a later receive with that tag takes (so the ring never stalls behind it).  A
byte-count mismatch fails loudly on the receiving side.

**The rendezvous** (a sender's choice, ``TORCHCOMM_SHM_P2P_RENDEZVOUS=1``: from
``RENDEZVOUS_MIN_BYTES``, once the communicator's probe found that its ranks may read each
other's memory, ``cpu.shm.single_copy``; every receiver takes it): the sender writes no bytes
into the ring, only one chunk whose meta line carries the message's byte count negated, its
tag and the address of its buffer; the receiver routes it like any message and reads the
whole of it straight out of the sender's memory (cross-memory attach), then acknowledges the
chunk, and only that completes the send (the sender's buffer must stay as it is until the
peer has read it).  Why: the ring's slots are rewritten while the peer still holds them in its
cache, which on cores that share no cache costs ~3x; but the ring keeps both ranks copying at
once (the sender fills one slot while the receiver empties the other) where the rendezvous
has one rank read and the other wait, so on one shared cache the ring is ~2x faster (2 ranks,
round trips, ring / rendezvous, 1 MiB and 4 MiB: split 858 / 292 and 3144 / 1157 us, one
cache 119-159 / 210-320 and 454-980 / 778-1733; ``python
benchmarks/diagnostics/slots_vs_single_copy.py --ops sendrecv``,
benchmarks/results/issue40/NOTES.md).  Off by default until it keeps both cores busy too.

Posting never blocks: a transfer is queued and moved as far as the ring allows; waiting
on a transfer keeps moving every queued transfer with the same peers, so crossed sends
and receives of any size cannot deadlock.  ``wait`` is one ``ShmChannel.poll`` (the
channel's single wait loop, bounded by the op's ``Deadline``) whose predicate progresses.

**The direct path** (``send_now``/``recv_now``): one small untagged message of a sync op,
while nothing else is posted, moves with byte slice assignments on ``memoryview``s of
the segment and of the caller's tensor, and a receive waits on the one flag it needs.
Whatever it cannot do simply (a full ring, a tagged or unexpected message, other posted
transfers that a wait must keep moving) it leaves untouched, and the op takes ``post``.

Threads: ``post`` runs on the thread that runs the op; ``wait`` on whichever thread
waits for the work (the executor's, or a caller's in the work's ``wait()``); and a
collective waiting on the executor thread progresses the rings through the channel's
``idle`` hook.  ``_lock`` guards the queues and counters; the ``idle`` hook only takes it
when it is free.
"""

from __future__ import annotations

import errno
import os
import threading
from collections import defaultdict, deque
from collections.abc import Callable, Sequence

import torch

from torchcomms.ranks import RankMessage, Ranks
from torchcomms.runtime.deadline import Deadline
from torchcomms.transport import cma
from torchcomms.transport.errors import WaitError
from torchcomms.transport.shm.channel import ShmChannel
from torchcomms.transport.shm.layout import ACKED, PMETA0, SENT

_NO_TAG = -1
#: Messages from this size take the rendezvous (the module docstring) where it can run.
RENDEZVOUS_MIN_BYTES = 1 << 20
# A meta line: byte count (negated for a rendezvous), tag, and the sender's address.
_COUNT, _TAG, _ADDRESS = 0, 1, 2
#: As ``cpu.shm.oneshot.TIGHT_CHECKS``: inline flag reads (~0.05 us each) before the wait loop.
_TIGHT_CHECKS = 64
_BYTE = torch.uint8
#: A pair ring's ACKED, SENT, meta lines (parity 0, 1) and slot offsets (parity 0, 1).
_Lines = tuple[int, int, int, int, int, int]


class Transfer:
    """One posted send or receive (a flat byte view of the caller's tensor)."""

    __slots__ = (
        "buf",
        "done",
        "error",
        "nbytes",
        "owner",
        "peer",
        "rendezvous",
        "sending",
        "tag",
    )

    def __init__(self, sending: bool, peer: int, buf: torch.Tensor, tag: int | None) -> None:
        self.sending = sending
        self.peer = peer
        self.buf = buf
        self.nbytes = buf.numel()
        self.tag = _NO_TAG if tag is None else tag
        self.done = 0  # bytes moved
        self.error: WaitError | None = None
        self.owner: Transfer | None = None  # for an unexpected message: the receive it fills
        #: A send by rendezvous: -1 no (through the ring), 0 not announced yet, else the
        #: chunk that announced it (the send is complete once the peer acknowledged it).
        self.rendezvous = -1


class _Incoming:
    """Per source: the message being copied out, and unexpected messages not yet received."""

    __slots__ = ("current", "posted", "unexpected")

    def __init__(self) -> None:
        self.current: Transfer | None = None
        self.posted: deque[Transfer] = deque()
        self.unexpected: deque[Transfer] = deque()


class ShmP2P:
    """The pair rings of one channel (see the module docstring)."""

    def __init__(self, chan: ShmChannel, single_copy: Callable[[], bool] = lambda: False) -> None:
        """``single_copy``: whether the ranks may read each other's memory (the communicator's
        probe said so): then large messages take the rendezvous."""
        self._chan = chan
        self._single_copy = single_copy
        self._lock = threading.Lock()
        self._sends: dict[int, deque[Transfer]] = defaultdict(deque)
        self._incoming: dict[int, _Incoming] = defaultdict(_Incoming)
        self._sent: dict[int, int] = defaultdict(int)  # chunks written, per destination
        self._got: dict[int, int] = defaultdict(int)  # chunks read, per source
        #: Per source, a rendezvous chunk whose read failed: not routed or read again.
        self._unread: dict[int, int] = {}
        self._chunk = chan.layout.pair_bytes
        chan.idle = self._progress_in_background
        self._bytes = chan.flags.cast("B")  # the whole segment, for the direct path
        #: Per peer, for the direct path: flag indices and slot offsets of both pair rings.
        self._direct: dict[int, tuple[_Lines, _Lines]] = {}
        #: Inline flag checks of ``recv_now`` before the channel's wait loop (shm_oneshot).
        policy = chan.policy
        self._tight_checks = 0 if policy.oversubscribed or policy.spins <= 0 else _TIGHT_CHECKS

    def _progress_in_background(self) -> None:
        """Called by collective waits: posted sends and receives keep moving meanwhile."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            for peer in self._active_peers(()):
                self._progress_peer(peer)
        finally:
            self._lock.release()

    def post(self, sending: bool, peer: int, tensor: torch.Tensor, tag: int | None) -> Transfer:
        flat = tensor if tensor.dim() == 1 else tensor.reshape(-1)  # (each call a dispatch)
        t = Transfer(sending, peer, flat if flat.dtype is _BYTE else flat.view(_BYTE), tag)
        if sending and t.nbytes >= RENDEZVOUS_MIN_BYTES and self._single_copy():
            t.rendezvous = 0  # decided once: the probe may finish while a ring send runs
        with self._lock:
            if sending:
                self._sends[peer].append(t)
            else:
                self._match_posted(self._incoming[peer], t)
            self._progress_peer(peer)
        return t

    # -- the direct path (the module docstring) -------------------------------------------------
    def _direct_of(self, peer: int) -> tuple[_Lines, _Lines]:
        """The pair ring to ``peer`` and the one from it (``_lines``), for the direct path."""
        d = self._direct.get(peer)
        if d is None:
            me = self._chan.rank
            d = self._direct[peer] = (self._lines(me, peer), self._lines(peer, me))
        return d

    def _lines(self, src: int, dst: int) -> _Lines:
        """ACKED, SENT, both meta lines and both slot offsets of the ring ``src -> dst``."""
        layout = self._chan.layout
        return (
            layout.pair_flag(src, dst, ACKED),
            layout.pair_flag(src, dst, SENT),
            layout.pair_flag(src, dst, PMETA0),
            layout.pair_flag(src, dst, PMETA0 + 1),
            layout.pair_offset(src, dst, 0),
            layout.pair_offset(src, dst, 1),
        )

    def send_now(self, peer: int, data: memoryview) -> bool:
        """Write one untagged message of at most a chunk into the pair ring now, if no send
        to ``peer`` is queued and the ring has room; whether it did (else nothing changed)."""
        n = len(data)
        if n > self._chunk or (n >= RENDEZVOUS_MIN_BYTES and self._single_copy()):
            return False
        flags = self._chan.flags
        acked, sent, meta0, meta1, off0, off1 = self._direct_of(peer)[0]
        with self._lock:
            if self._sends.get(peer):
                return False
            i = self._sent[peer] + 1
            if flags[acked] < i - 2:
                return False
            odd = i & 1
            off = off1 if odd else off0
            self._bytes[off : off + n] = data
            meta = meta1 if odd else meta0
            flags[meta] = n
            flags[meta + 1] = _NO_TAG
            flags[sent] = i
            self._chan.ring_rank(peer)
            self._sent[peer] = i
        return True

    def recv_now(self, peer: int, data: memoryview, deadline: Deadline) -> bool:
        """Receive one untagged message of ``len(data)`` bytes (at most a chunk) from
        ``peer`` straight from the ring, when nothing else is posted that a wait would
        have to move; whether it did.  False leaves the ring as it was (the message, if it
        came, stays for ``post``), after waiting for the message if nothing was posted."""
        n = len(data)
        if n > self._chunk:
            return False
        with self._lock:
            incoming = self._incoming.get(peer)
            if incoming is not None and incoming.unexpected:
                return False
            if any(self._sends.values()) or any(
                inc.posted or inc.current is not None for inc in self._incoming.values()
            ):
                return False
            i = self._got[peer] + 1
        acked, sent, meta0, meta1, off0, off1 = self._direct_of(peer)[1]
        chan = self._chan
        flags = chan.flags
        if flags[sent] < i:
            checks = self._tight_checks
            while checks and flags[sent] < i:
                checks -= 1
            if flags[sent] < i:
                chan.poll(
                    lambda: flags[sent] >= i, lambda: (peer,), deadline, "to exchange a message"
                )
        with self._lock:
            incoming = self._incoming[peer]
            if (
                self._got[peer] + 1 != i  # another thread took it meanwhile
                or incoming.current is not None
                or incoming.posted
                or incoming.unexpected
            ):
                return False
            odd = i & 1
            meta = meta1 if odd else meta0
            if flags[meta] != n or flags[meta + 1] != _NO_TAG:
                return False  # ``post`` routes it (a tag, a rendezvous) or fails it (a size)
            off = off1 if odd else off0
            data[:] = self._bytes[off : off + n]
            flags[acked] = i
            chan.ring_rank(peer)
            self._got[peer] = i
        return True

    def _match_posted(self, incoming: _Incoming, t: Transfer) -> None:
        """A new receive takes the oldest unexpected message with its tag, else waits in line."""
        for msg in incoming.unexpected:
            if msg.tag == t.tag and msg.owner is None:
                self._check_size(msg.nbytes, msg.tag, t)
                if t.error is not None:
                    return
                incoming.unexpected.remove(msg)
                if msg.done == msg.nbytes:
                    t.buf.copy_(msg.buf)
                    t.done = t.nbytes
                else:
                    msg.owner = t  # still arriving: delivered when complete
                return
        incoming.posted.append(t)

    def wait(self, transfers: Sequence[Transfer], deadline: Deadline) -> None:
        """Move every queued transfer until all of ``transfers`` are complete."""

        def ready() -> bool:
            with self._lock:
                # Every queued transfer moves, not only the awaited ones: a rank waiting for
                # its receive must still feed the sends its peers are waiting for.
                for peer in self._active_peers(transfers):
                    self._progress_peer(peer)
                for t in transfers:
                    if t.error is not None:
                        raise t.error
                return all(t.done == t.nbytes for t in transfers)

        def waiting_for() -> list[int]:
            return [t.peer for t in transfers if t.done < t.nbytes]

        self._chan.poll(ready, waiting_for, deadline, "to exchange a message")

    # -- progress (under _lock) ------------------------------------------------------------
    def _active_peers(self, transfers: Sequence[Transfer]) -> set[int]:
        peers = {t.peer for t in transfers}
        peers.update(p for p, q in self._sends.items() if q)
        peers.update(
            p for p, inc in self._incoming.items() if inc.posted or inc.current is not None
        )
        return peers

    def _progress_peer(self, peer: int) -> None:
        sends = self._sends.get(peer)
        while sends and self._advance_send(sends[0]):
            sends.popleft()
        self._advance_recv(self._incoming[peer], peer)

    def _advance_send(self, t: Transfer) -> bool:
        """Write as many chunks as the ring takes; True once the whole message is written."""
        chan = self._chan
        layout = chan.layout
        flags = chan.flags
        me, peer = chan.rank, t.peer
        acked = layout.pair_flag(me, peer, ACKED)
        if t.rendezvous >= 0:
            return self._rendezvous_send(t, acked)
        while t.done < t.nbytes:
            i = self._sent[peer] + 1
            if flags[acked] < i - 2:
                return False
            n = min(self._chunk, t.nbytes - t.done)
            parity = i & 1
            chan.view(layout.pair_offset(me, peer, parity), _BYTE, (n,), (1,)).copy_(
                t.buf if n == t.nbytes else t.buf[t.done : t.done + n]
            )
            meta = layout.pair_flag(me, peer, PMETA0 + parity)
            flags[meta] = t.nbytes
            flags[meta + 1] = t.tag
            flags[layout.pair_flag(me, peer, SENT)] = i
            chan.ring_rank(peer)
            self._sent[peer] = i
            t.done += n
        return True

    def _rendezvous_send(self, t: Transfer, acked: int) -> bool:
        """Announce ``t`` (one chunk: count negated, tag, address); True once the peer has read
        it and acknowledged that chunk."""
        chan = self._chan
        flags = chan.flags
        if t.rendezvous == 0:
            i = self._sent[t.peer] + 1
            if flags[acked] < i - 2:
                return False
            layout = chan.layout
            meta = layout.pair_flag(chan.rank, t.peer, PMETA0 + (i & 1))
            flags[meta + _ADDRESS] = t.buf.data_ptr()
            flags[meta + _TAG] = t.tag
            flags[meta + _COUNT] = -t.nbytes
            flags[layout.pair_flag(chan.rank, t.peer, SENT)] = i
            chan.ring_rank(t.peer)
            self._sent[t.peer] = i
            t.rendezvous = i
        if flags[acked] < t.rendezvous:
            return False
        t.done = t.nbytes
        return True

    def _rendezvous_read(self, t: Transfer, peer: int, address: int) -> bool:
        """Read a rendezvous message from ``peer``'s memory into ``t``; False (and ``t.error``
        set, naming the peer) if the kernel refused."""
        _, err = cma.copy(False, self._chan.pids[peer], t.buf.data_ptr(), address, t.nbytes)
        if err == 0:
            return True
        if err == errno.ESRCH:
            text = "{} died (process gone) while this rank read its message"
            t.error = WaitError("dead", [peer], RankMessage(text, Ranks([peer])))
        else:
            text = "reading a message from {} failed: {}"
            message = RankMessage(text, Ranks([peer]), os.strerror(err))
            t.error = WaitError("peer_failed", [peer], message)
        return False

    def _advance_recv(self, incoming: _Incoming, peer: int) -> None:
        """Copy out every chunk already sent by ``peer``, routing each message by its tag."""
        chan = self._chan
        layout = chan.layout
        flags = chan.flags
        me = chan.rank
        sent = layout.pair_flag(peer, me, SENT)
        while True:
            i = self._got[peer] + 1
            if flags[sent] < i:
                return
            parity = i & 1
            t = incoming.current
            if t is None:
                if self._unread and self._unread.get(peer) == i:
                    return  # its receive raised; the communicator is failing
                meta = layout.pair_flag(peer, me, PMETA0 + parity)
                count = flags[meta + _COUNT]
                t = self._route(incoming, peer, abs(count), flags[meta + _TAG])
                if t is None:
                    return
                if count < 0:  # a rendezvous: the whole message, out of the sender's memory
                    if not self._rendezvous_read(t, peer, flags[meta + _ADDRESS]):
                        self._unread[peer] = i
                        return
                    flags[layout.pair_flag(peer, me, ACKED)] = i
                    chan.ring_rank(peer)
                    self._got[peer] = i
                    t.done = t.nbytes
                    self._delivered(t)
                    continue
                incoming.current = t
            n = min(self._chunk, t.nbytes - t.done)
            (t.buf if n == t.nbytes else t.buf[t.done : t.done + n]).copy_(
                chan.view(layout.pair_offset(peer, me, parity), _BYTE, (n,), (1,))
            )
            flags[layout.pair_flag(peer, me, ACKED)] = i
            chan.ring_rank(peer)
            self._got[peer] = i
            t.done += n
            if t.done == t.nbytes:
                incoming.current = None
                self._delivered(t)

    @staticmethod
    def _delivered(t: Transfer) -> None:
        """A message is complete: an unexpected one a receive already claimed fills it."""
        owner = t.owner
        if owner is not None:
            owner.buf.copy_(t.buf)
            owner.done = owner.nbytes

    def _route(self, incoming: _Incoming, peer: int, nbytes: int, tag: int) -> Transfer | None:
        """The receive a new message goes to (or a fresh unexpected buffer)."""
        for t in incoming.posted:
            if t.tag == tag:
                self._check_size(nbytes, tag, t)
                if t.error is not None:
                    return None
                incoming.posted.remove(t)
                return t
        msg = Transfer(False, peer, torch.empty(nbytes, dtype=torch.uint8), None)
        msg.tag = tag
        incoming.unexpected.append(msg)
        return msg

    @staticmethod
    def _check_size(nbytes: int, tag: int, t: Transfer) -> None:
        if nbytes != t.nbytes:
            t.error = WaitError(
                "mismatch",
                [t.peer],
                f"message from peer rank {t.peer} does not match this receive: "
                f"{nbytes} bytes{_tag_text(tag)} sent, {t.nbytes} bytes expected",
            )


def _tag_text(tag: int) -> str:
    return "" if tag == _NO_TAG else f" with tag {tag}"
