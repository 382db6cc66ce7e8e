"""``Exchange``: the first step of every collective on the tcp path, and small ops' only one.

Each rank writes a header (magic, the comm's collective sequence number, the op's
fingerprint: ``torchcomms.runtime.fingerprint``) and, for small messages, the payload itself
into its own row, and the communicator's ``transport.tcp.lane`` all_gathers the rows.  Then every
rank compares every header with its own: ranks that called different collectives (or
skipped one) all raise a mismatch naming who passed what, before any data is combined
and before gloo sees sizes that differ between ranks (it aborts the process on those).

A row holds at most ``inline_limit(size)`` payload bytes: 64 KiB, less in large
communicators so that one exchange moves at most about 256 KiB into each rank.  Rows are
preallocated, reused by every op, and read in place (``payload``).  Runs on the op's
thread.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from torchcomms.backends.cpu.tcp.waits import TcpWaiter
from torchcomms.runtime import fingerprint as F
from torchcomms.runtime.deadline import Deadline
from torchcomms.runtime.fingerprint import Fingerprint
from torchcomms.transport.contention import KERNEL_ID, current_cpu
from torchcomms.transport.tcp.lane import Lane, LaneOversize, LanePeerGone, LaneProtocolError

_MAGIC = 0x70C0_C0DE
# magic, seq, digest, descriptor, count, the sender's core and kernel (``Lane.spin_budget``),
# 1 spare (int64 each)
_HEADER_WORDS = 8
_CPU, _KERNEL = 5, 6
#: Where a row's payload starts.
HEADER_BYTES = _HEADER_WORDS * 8
_MIN_INLINE = 1024
_MAX_INLINE = 64 * 1024
_INLINE_TOTAL = 256 * 1024


def inline_limit(size: int) -> int:
    """Payload bytes one rank's row carries in a communicator of ``size`` (a multiple of 8)."""
    return max(_MIN_INLINE, min(_MAX_INLINE, _INLINE_TOTAL // max(size, 1)) // 8 * 8)


class Exchange:
    """The rows of one communicator's header exchange (see the module docstring)."""

    def __init__(self, lane: Lane, rank: int, size: int, waiter: TcpWaiter) -> None:
        self.lane = lane
        self.rank = rank
        self.size = size
        self.waiter = waiter
        self.inline_max = inline_limit(size)
        words = _HEADER_WORDS + self.inline_max // 8
        self._row_bytes = words * 8
        rows = torch.zeros(size * words, dtype=torch.int64)
        self._words = rows.numpy().data.cast("B").cast("q")
        self._bytes_view = rows.numpy().data.cast("B")
        self._mine = self._words[rank * words : (rank + 1) * words]
        self._mine[0] = _MAGIC
        self._mine[_KERNEL] = KERNEL_ID
        self._payload_ptr = rows.data_ptr() + rank * self._row_bytes + HEADER_BYTES
        self._row_starts = [r * words for r in range(size)]
        self._table = rows.numpy().reshape(size, words)
        self._table[:, _CPU] = -1
        lane.peer_cores(self._table[:, _CPU], self._table[:, _KERNEL])
        self._lengths = [0] * size
        #: Every rank's row as bytes: ``[size, row bytes]``.
        self.rows = rows.view(torch.uint8).view(size, self._row_bytes)
        self._views: dict[tuple[torch.dtype, int, int], torch.Tensor] = {}
        self._keep = rows

    def _write(self, seq: int, fp: Fingerprint, payload: torch.Tensor | None) -> str:
        """This rank's row: header and ``payload``; the op's name."""
        mine = self._mine
        mine[1] = seq
        mine[2], mine[3], mine[4] = fp
        mine[_CPU] = current_cpu()
        nbytes = 0
        if payload is not None and payload.numel():
            nbytes = payload.numel() * payload.element_size()
            if payload.is_cpu and payload.is_contiguous():
                ctypes.memmove(self._payload_ptr, payload.data_ptr(), nbytes)
            else:
                self.rows[self.rank, HEADER_BYTES : HEADER_BYTES + nbytes].copy_(
                    payload.reshape(-1).view(torch.uint8)
                )
        self._lengths[self.rank] = HEADER_BYTES + nbytes
        return F.OP_NAMES[fp[1] & 0xFF]

    def post(self, seq: int, fp: Fingerprint, deadline: Deadline, payload: torch.Tensor) -> None:
        """Two ranks: send this rank's header and ``payload`` without waiting for the
        peer's, which is checked before this rank next reads the lane
        (``transport.tcp.posted``): a broadcast's root, a reduce's other rank."""
        what = self._write(seq, fp, payload)
        waiter = self.waiter
        try:
            self.lane.post(
                self._bytes_view,
                self._row_bytes,
                self._lengths,
                self.owed_check(seq, fp, what),
                lambda: waiter.check(deadline, what),
            )
        except LanePeerGone as gone:
            raise waiter.gone(gone, what) from None

    def owed_check(self, seq: int, fp: Fingerprint, what: str) -> Callable[[memoryview], None]:
        """The check of the peer's header for an op this rank posted (two ranks): raises
        the mismatch, naming both ranks' arguments, when the peer's differs."""
        mine = (fp, seq)
        peer = 1 - self.rank

        def check(block: memoryview) -> None:
            theirs = decode(block)
            if theirs is None:
                raise LaneProtocolError(f"rank {peer} sent a frame without an op header")
            if theirs != mine:
                by_rank = [mine, theirs] if self.rank == 0 else [theirs, mine]
                raise self._mismatch(what, mine, by_rank)

        return check

    def run(
        self, seq: int, fp: Fingerprint, deadline: Deadline, payload: torch.Tensor | None
    ) -> None:
        """Exchange this rank's header (and ``payload``: at most ``inline_max`` bytes) with
        every rank's; raise a mismatch."""
        what = self._write(seq, fp, payload)
        mine = self._mine
        waiter = self.waiter
        try:
            self.lane.all_gather(
                self._bytes_view,
                self._row_bytes,
                self._lengths,
                lambda: waiter.check(deadline, what),
            )
        except LanePeerGone as gone:
            raise waiter.gone(gone, what) from None
        except LaneOversize as big:  # the peer runs a ring op (``transport.tcp.ring``): another one
            theirs = decode(memoryview(big.head))
            if theirs is None:
                raise
            raise waiter.report.pairwise(what, (fp, seq), big.peer, theirs) from None
        self.lane.heard_cores()
        got = self._words
        header = mine[1:5]
        for base in self._row_starts:  # the common case: equal headers, a few int compares
            if got[base + 1 : base + 5] != header:
                by_rank = [((int(r[2]), int(r[3]), int(r[4])), int(r[1])) for r in self._table]
                raise self._mismatch(what, (fp, seq), by_rank)

    def _mismatch(
        self, what: str, mine: tuple[Fingerprint, int], by_rank: list[tuple[Fingerprint, int]]
    ) -> Exception:
        """The error for headers that differ, every rank's in ``by_rank`` (rank order)."""
        found = F.mismatch(by_rank)
        bad, text = found if found is not None else ([], "different headers")
        return self.waiter.report.full(what, mine, bad, text)

    def header(self, seq: int, fp: Fingerprint) -> memoryview:
        """This rank's header for an op that carries it itself (``transport.tcp.ring``)."""
        mine = self._mine
        mine[1] = seq
        mine[2], mine[3], mine[4] = fp
        mine[_CPU] = current_cpu()
        start = self.rank * self._row_bytes
        return self._bytes_view[start : start + HEADER_BYTES]

    def differs(self, theirs: memoryview, peer: int) -> bool:
        """Whether ``peer``'s header (``HEADER_BYTES``) is not this rank's (magic to count);
        notes the core and kernel it carries for the lane's waits."""
        words = theirs.cast("q")
        if len(words) > _KERNEL:
            self._table[peer, _CPU : _KERNEL + 1] = words[_CPU : _KERNEL + 1]
            self.lane.heard_cores()
        return words[:5] != self._mine[:5]

    def payload(self, dtype: torch.dtype, first: int, count: int) -> torch.Tensor:
        """Elements ``first .. first+count`` of every rank's payload: ``[size, count]`` of
        ``dtype``, a view of the rows (valid until the next exchange)."""
        key = (dtype, first, count)
        view = self._views.get(key)
        if view is None:
            item = torch.empty((), dtype=dtype).element_size()
            start = HEADER_BYTES + first * item
            view = self.rows[:, start : start + count * item].view(dtype)
            if len(self._views) > 256:
                self._views.clear()
            self._views[key] = view
        return view


def decode(head: memoryview) -> tuple[Fingerprint, int] | None:
    """``(fingerprint, seq)`` of a header's bytes, or None if they are not a header."""
    if len(head) < 40:
        return None
    words = head[:40].cast("q")
    if words[0] != _MAGIC:
        return None
    return (words[2], words[3], words[4]), words[1]
