"""``Ring``: large collectives over the lane's round-0 connections, on the op's thread.

Why not gloo for these too: every gloo call crosses three threads per rank, and the
op's header (the mismatch check) would cost a separate lane round trip before it.  Here
the header rides in the first frame of the op, and the payload moves with
``sendmsg``/``recv_into`` straight between the tensors and the sockets: no staging copy.

**Algorithms.**  Rank ``r`` sends to ``r - 1`` and receives from ``r + 1`` (round 0 of
the lane's Bruck plan: the same two sockets).  The data is cut into ``size`` chunks.

* reduce-scatter, ``size - 1`` steps: in step ``s`` rank ``r`` sends chunk ``r+s+1``
  (its own at first, then what it combined last step) and receives chunk ``r+s+2``,
  which it combines with its own contribution; after the last step it holds chunk ``r``
  reduced over every rank.  Each chunk is combined along one fixed path, so every rank
  ends with the same bits.
* all-gather, ``size - 1`` steps: in step ``s`` rank ``r`` sends chunk ``r+s`` and
  receives chunk ``r+s+1`` into place.
* all-reduce is the two: each rank sends and receives ``2 (size-1)/size`` of the data.

**Frames.**  ``u32 frame length``, ``u32 block length``, then the block: in an op's
first step the 64-byte header (``cpu.tcp.exchange``) and the chunk, later the chunk alone.
The receiver reads the prefix and the header first and calls ``check`` on the header
before a byte of data is read, so ranks that disagree (or whose peer is in another op,
whose frame a header exchange would refuse as oversize) raise before anything is
combined or written.  A control frame (``BYE``, ``FAILED …``) in place of a prefix is a
goodbye, as in ``transport.tcp.lane``.

**Waits** as the lane's: a spin when spinning is allowed (``Lane.spin_budget``; none in
a step of ``STREAM_BYTES`` or more), then ``poll`` in slices of ``SLICE_MS`` with
``between`` (abort, liveness, deadline) after each idle slice.
Sends progress in the same loop, so the two directions of a step never deadlock.  Once
its own bytes are out, a step that only streams into a tensor (a broadcast's receiver)
asks ``poll`` to wake it when the rest of the block, at most 4 MiB, is in
(``sockets.LowWater``), not for every segment; the mark is cleared as the step ends,
whichever way.  A step that works on what arrives (``progress``: a two-rank reduce's
root) keeps the default: with a 1 MiB mark it was 1.04-1.18x faster over loopback but
0.82-0.95x between simulated hosts, where its sender then spent a third more CPU
(``benchmarks/diagnostics/tcp_low_water.py``, step 15 of issue 53's notes).
"""

from __future__ import annotations

import select
import struct
import time
from collections.abc import Callable

import torch

from torchcomms.transport.tcp.lane import (
    SLICE_MS,
    STREAM_BYTES,
    Lane,
    LanePeerGone,
    LaneProtocolError,
    LaneRound,
    out_error,
    send_some,
    socket_error,
)

_PREFIX = struct.Struct("<II")
_CONTROL = 0xFFFF_FFFF
_EMPTY = memoryview(b"")

#: combine(mine, incoming, out): ``out = mine (op) incoming``.
Combine = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
#: check(peer header): raises when the peer's op differs from this rank's.
Check = Callable[[memoryview], None]
#: progress(bytes received, bytes of the send still unsent), see ``Ring.step``.
Progress = Callable[[int, int], None]


def spans(count: int, size: int) -> list[tuple[int, int]]:
    """``(first, count)`` of each of ``size`` near-equal chunks of ``count`` elements."""
    base, extra = divmod(count, size)
    out, at = [], 0
    for i in range(size):
        n = base + (1 if i < extra else 0)
        out.append((at, n))
        at += n
    return out


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor."""
    if tensor.numel() == 0:
        return _EMPTY
    try:  # any shape: numpy's view of a contiguous tensor, one C call
        return tensor.numpy().data.cast("B")
    except (TypeError, RuntimeError):  # bfloat16 (numpy has none), a tensor needing grad
        return tensor.detach().view(-1).view(torch.uint8).numpy().data.cast("B")


class Ring:
    """Ring collectives of one rank over its lane (see the module docstring).

    ``header_bytes``: the size of the header an op's first frame carries.  One op at a
    time, on the op's thread.
    """

    def __init__(self, lane: Lane, header_bytes: int) -> None:
        self.lane = lane
        self.rank = lane.rank
        self.size = lane.size
        self._header_bytes = header_bytes
        self._prefix = bytearray(_PREFIX.size)
        self._theirs = bytearray(header_bytes)
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self._sending: select.poll | None = None

    def scratch(self, dtype: torch.dtype, count: int, which: int = 0) -> torch.Tensor:
        """Reusable space for ``count`` elements (``which``: one of 4 buffers: 0 receives,
        1 and 2 hold partial results, 3 is the caller's)."""
        item = torch.empty((), dtype=dtype).element_size()
        need = 4 * count * item
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.uint8)
        start = which * count * item
        return self._scratch[start : start + count * item].view(dtype)

    # -- algorithms ------------------------------------------------------------------------
    def reduce_scatter(
        self,
        src: torch.Tensor,
        own: torch.Tensor,
        combine: Combine,
        header: memoryview | None,
        check: Check | None,
        between: Callable[[], None],
    ) -> None:
        """Chunk ``rank`` of ``src`` (flat, ``size`` chunks by ``spans``; only read)
        reduced over every rank into ``own``; partial results go to scratch (buffers 0-2).
        ``header``/``check``: the op's first frame's."""
        n, r = self.size, self.rank
        if n == 1:
            own.copy_(src)
            return
        plan = spans(src.numel(), n)
        biggest = max(k for _, k in plan)
        incoming_all = self.scratch(src.dtype, biggest, 0)

        def chunk(c: int) -> torch.Tensor:
            first, k = plan[c % n]
            return src[first : first + k]

        send = chunk(r + 1)
        for s in range(n - 1):
            c = (r + s + 2) % n
            k = plan[c][1]
            incoming = incoming_all[:k]
            first = header if s == 0 else None
            self.step(as_bytes(send), as_bytes(incoming), first, check, between)
            out = own if s == n - 2 else self.scratch(src.dtype, biggest, 1 + s % 2)[:k]
            combine(chunk(c), incoming, out)
            send = out

    def all_gather(
        self,
        flat: torch.Tensor,
        plan: list[tuple[int, int]],
        header: memoryview | None,
        check: Check | None,
        between: Callable[[], None],
        own: torch.Tensor | None = None,
    ) -> None:
        """Every rank's chunk ``plan[rank]`` of ``flat`` into place on every rank.

        ``own``: where this rank's chunk is, if not in ``flat`` yet (the caller copies it
        there after: nothing of ``flat`` is written before the peer's header passed)."""
        n, r = self.size, self.rank
        for s in range(n - 1):
            out_first, out_k = plan[(r + s) % n]
            in_first, in_k = plan[(r + s + 1) % n]
            sending = own if s == 0 and own is not None else flat[out_first : out_first + out_k]
            self.step(
                as_bytes(sending),
                as_bytes(flat[in_first : in_first + in_k]),
                header if s == 0 else None,
                check,
                between,
            )

    # -- one step ------------------------------------------------------------------------
    def step(
        self,
        send: memoryview | None,
        recv: memoryview | None,
        header: memoryview | None,
        check: Check | None,
        between: Callable[[], None],
        header_in: bool | None = None,
        progress: Progress | None = None,
    ) -> None:
        """Send ``[header] + send`` to ``rank - 1`` while receiving ``rank + 1``'s frame,
        its data into ``recv`` (after ``check`` passed its header).  ``send`` None: send
        nothing; ``recv`` None: receive nothing.  ``header_in`` (default: whether this
        frame has a header): whether the received frame starts with one.  ``progress``:
        called as bytes move, with how many of ``recv`` arrived and of ``send`` left (so
        the caller can work on what arrived while the rest is on its way)."""
        rd = self.lane.ring_round()
        try:
            self._step(rd, send, recv, header, check, between, header_in, progress)
        finally:  # the lane's next read of this socket must wake at its first byte
            rd.inbox.low_water.clear()

    def _step(
        self,
        rd: LaneRound,
        send: memoryview | None,
        recv: memoryview | None,
        header: memoryview | None,
        check: Check | None,
        between: Callable[[], None],
        header_in: bool | None,
        progress: Progress | None,
    ) -> None:
        peer = rd.recv_from
        hb = len(header) if header is not None else 0
        hb_in = (
            self._header_bytes if (header is not None if header_in is None else header_in) else 0
        )
        parts: list[memoryview | bytes] = []
        if send is not None:
            block = hb + len(send)
            parts.append(_PREFIX.pack(4 + block, block))
            if header is not None:
                parts.append(header)
            if len(send):
                parts.append(send)
        expected = hb_in + (len(recv) if recv is not None else 0)
        inbox = rd.inbox
        theirs = memoryview(self._theirs)[:hb_in]
        # Read the prefix, then (first step) the header, then the data: ``stage`` 0, 1, 2.
        stage, target, got, their_block = 0, memoryview(self._prefix), 0, -1
        if recv is None:
            stage = 3
        spin_s = -1.0  # asked the first time nothing moved (``Lane.spin_budget``)
        idle_since = 0.0
        while True:
            moved = False
            if parts and rd.out_failed is not None:
                parts = []  # set aside (``lane.out_error``): the receive side explains
            if parts:
                left = send_some(rd.out, parts)
                if left is None:  # broken: now, or by what the receive side learns
                    out_error(rd, socket_error(rd.out))
                    left = []
                moved = left is not parts
                parts = left
                if moved and progress is not None and stage == 2:
                    progress(got, _unsent(parts, send))
            while stage != 3:
                if got < len(target):
                    if idle_since and inbox.start == inbox.end and not rd.poller.poll(0):
                        break  # spinning: ask ``poll`` (0.7 us), not a failing ``recv`` (3 us)
                    n = inbox.read_into(target[got:])
                    if n < 0:
                        raise LanePeerGone(peer, None, inbox.error)
                    if n == 0:
                        break
                    got += n
                    moved = True
                    if progress is not None and stage == 2:
                        progress(got, _unsent(parts, send))
                    if got < len(target):
                        continue
                if stage == 0:
                    total, their_block = _PREFIX.unpack_from(self._prefix)
                    if total == _CONTROL:
                        raise LanePeerGone(peer, _goodbye(rd, their_block))
                    if hb_in and their_block >= hb_in:
                        stage, target, got = 1, theirs, 0
                        continue
                elif stage == 1 and check is not None:
                    check(theirs)  # raises before a byte of data is read
                if stage < 2:
                    if their_block != expected:
                        raise LaneProtocolError(
                            f"rank {peer} sent a {their_block} B block where this rank "
                            f"expected {expected} B"
                        )
                    stage, target, got = 2, recv or _EMPTY, 0
                    continue
                stage = 3
            if not parts and stage == 3:
                return
            if moved:
                idle_since = 0.0
                continue
            if spin_s < 0:
                streams = max(expected, len(send) if send is not None else 0) >= STREAM_BYTES
                spin_s = 0.0 if streams else self.lane.spin_budget(peer)
            if spin_s:
                now = time.perf_counter()
                if not idle_since:
                    idle_since = now
                if now - idle_since < spin_s:
                    continue
            if stage == 3:  # only sending: wait for room (a peer that is gone shows as an error)
                events = self._out_poller(rd).poll(SLICE_MS)
            else:
                if parts:
                    rd.wants_room(True)
                elif stage == 2 and progress is None:
                    # Only streaming in: wake once the block is here (``sockets.LowWater``).
                    rd.inbox.low_water.wait_for(len(target) - got)
                events = rd.poller.poll(SLICE_MS)
                if parts:
                    rd.wants_room(False)
            if not events:
                between()
            out_fd = rd.out.fileno()
            for fd, ev in events:
                if fd == out_fd and ev & (select.POLLERR | select.POLLHUP):
                    out_error(rd, socket_error(rd.out))

    def _out_poller(self, rd: LaneRound) -> select.poll:
        if self._sending is None:
            self._sending = select.poll()
            self._sending.register(rd.out, select.POLLOUT)
        return self._sending


def _unsent(parts: list[memoryview | bytes], send: memoryview | None) -> int:
    """How many bytes of ``send`` are still in ``parts`` (the frame's unsent rest)."""
    if send is None or not parts:
        return 0
    return min(len(send), sum(len(p) for p in parts))


def _goodbye(rd: LaneRound, text_len: int) -> str:
    """The text of a control frame whose prefix was read (waits up to a second for it)."""
    text = bytearray(min(text_len, 4096))
    view, got = memoryview(text), 0
    give_up = time.monotonic() + 1.0
    while got < len(text) and time.monotonic() < give_up:
        n = rd.inbox.read_into(view[got:])
        if n < 0:
            break
        if n == 0:
            rd.poller.poll(SLICE_MS)
        got += max(n, 0)
    return bytes(text[:got]).decode(errors="replace")
