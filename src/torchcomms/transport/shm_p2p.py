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

Posting never blocks: a transfer is queued and moved as far as the ring allows; waiting
on a transfer keeps moving every queued transfer with the same peers, so crossed sends
and receives of any size cannot deadlock.  ``wait`` is one ``ShmChannel.poll`` (the
channel's single wait loop, bounded by the op's ``Deadline``) whose predicate progresses.

Threads: ``post`` runs on the thread that runs the op; ``wait`` on whichever thread
waits for the work (the executor's, or a caller's in the work's ``wait()``); and a
collective waiting on the executor thread progresses the rings through the channel's
``idle`` hook.  ``_lock`` guards the queues and counters; the ``idle`` hook only takes it
when it is free.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from collections.abc import Sequence

import torch

from torchcomms.deadline import Deadline
from torchcomms.transport.shm_channel import (
    ACKED,
    PMETA0,
    SENT,
    ShmChannel,
    ShmWaitError,
)

_NO_TAG = -1
_BYTE = torch.uint8


class Transfer:
    """One posted send or receive (a flat byte view of the caller's tensor)."""

    __slots__ = ("buf", "done", "error", "nbytes", "owner", "peer", "sending", "tag")

    def __init__(self, sending: bool, peer: int, buf: torch.Tensor, tag: int | None) -> None:
        self.sending = sending
        self.peer = peer
        self.buf = buf
        self.nbytes = buf.numel()
        self.tag = _NO_TAG if tag is None else tag
        self.done = 0  # bytes moved
        self.error: ShmWaitError | None = None
        self.owner: Transfer | None = None  # for an unexpected message: the receive it fills


class _Incoming:
    """Per source: the message being copied out, and unexpected messages not yet received."""

    __slots__ = ("current", "posted", "unexpected")

    def __init__(self) -> None:
        self.current: Transfer | None = None
        self.posted: deque[Transfer] = deque()
        self.unexpected: deque[Transfer] = deque()


class ShmP2P:
    """The pair rings of one channel (see the module docstring)."""

    def __init__(self, chan: ShmChannel) -> None:
        self._chan = chan
        self._lock = threading.Lock()
        self._sends: dict[int, deque[Transfer]] = defaultdict(deque)
        self._incoming: dict[int, _Incoming] = defaultdict(_Incoming)
        self._sent: dict[int, int] = defaultdict(int)  # chunks written, per destination
        self._got: dict[int, int] = defaultdict(int)  # chunks read, per source
        self._chunk = chan.layout.pair_bytes
        chan.idle = self._progress_in_background

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
        with self._lock:
            if sending:
                self._sends[peer].append(t)
            else:
                self._match_posted(self._incoming[peer], t)
            self._progress_peer(peer)
        return t

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
            chan.ring()
            self._sent[peer] = i
            t.done += n
        return True

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
                meta = layout.pair_flag(peer, me, PMETA0 + parity)
                t = self._route(incoming, peer, flags[meta], flags[meta + 1])
                if t is None:
                    return
                incoming.current = t
            n = min(self._chunk, t.nbytes - t.done)
            (t.buf if n == t.nbytes else t.buf[t.done : t.done + n]).copy_(
                chan.view(layout.pair_offset(peer, me, parity), _BYTE, (n,), (1,))
            )
            flags[layout.pair_flag(peer, me, ACKED)] = i
            chan.ring()
            self._got[peer] = i
            t.done += n
            if t.done == t.nbytes:
                incoming.current = None
                owner = t.owner
                if owner is not None:  # an unexpected message a receive already claimed
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
            t.error = ShmWaitError(
                "mismatch",
                [t.peer],
                f"message from peer rank {t.peer} does not match this receive: "
                f"{nbytes} bytes{_tag_text(tag)} sent, {t.nbytes} bytes expected",
            )


def _tag_text(tag: int) -> str:
    return "" if tag == _NO_TAG else f" with tag {tag}"
