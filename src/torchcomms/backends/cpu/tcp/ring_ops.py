"""``RingOps``: the tcp path's large collectives on the lane's ring (``transport/tcp/ring``).

Past the inline limit, all_reduce, reduce, reduce_scatter, all_gather and broadcast move their
bytes over the lane's round-0 connections instead of gloo: no thread hand-offs, no
staging copy, and the op's header (``cpu.tcp.exchange``) rides in the first frame, so the
mismatch check costs no extra round trip.  A rank sees only its neighbour's header; a
difference is announced around the ring and made whole by ``cpu.tcp.mismatch``.

* all_reduce: ring reduce-scatter (partial sums in scratch, so the caller's tensor is
  untouched until every header passed) then all-gather into the tensor.  Two ranks, below
  ``PAIR_RING_BYTES`` and from its end: one exchange of the whole tensor, the peer's data
  combined piece by piece as it arrives; within it, the ring's two steps.
* reduce: two ranks: the peer's tensor one way to the root, combined as it arrives (the
  root's header goes the other way; the peer does not wait for it: it is owed,
  ``transport.tcp.posted``).  More: the reduce-scatter half, then the all-gather
  half, into scratch off the root.
* reduce_scatter: the reduce-scatter half, partial sums in scratch (the input is the
  caller's).
* all_gather: the all-gather half, straight into the output; this rank's own chunk is
  sent from the input and copied into place after the peer's header passed.
* all_to_all of two ranks: one exchange, each rank's part for the other in the frame that
  carries its header (no header round before it, as gloo's call needs); this rank's own
  part is copied into place after the peer's header passed.
* broadcast: a pipelined chain ``root -> root-1 -> … -> root+1`` (in segments when there
  are ranks in the middle), closed by an empty frame from ``root+1`` back to the root,
  so the root too learns of a rank that disagrees; with ranks in the middle, the root
  then sends an empty frame down the chain again, since a middle rank cannot otherwise
  know that the ranks after it agreed.  Two ranks: the receiver sends the close as it
  enters, and the root does not wait for it (it is owed, checked before the root next
  reads the lane: ``transport.tcp.posted``).

Why every rank raises on a mismatch: each rank checks its ``rank + 1``'s header, and
no rank returns before a path of such checks through every rank has passed (in
reduce-scatter or all-gather, rank ``r``'s last receive depends on ranks ``r+1 … r-2``
having passed their first step; broadcast's close and second lap do the same).  The
exception: at two ranks the rank of a broadcast or reduce that only sends returns once
its bytes are out, and learns of a difference at its next collective.

Runs on the op's thread, one op at a time (``cpu.ops``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from torchcomms.backends.cpu.reductions import BINARY, BINARY_BOOL
from torchcomms.backends.cpu.staging import finish_average, premultiplied
from torchcomms.backends.cpu.tcp.exchange import HEADER_BYTES, Exchange, decode
from torchcomms.backends.cpu.tcp.waits import TcpWaiter
from torchcomms.runtime.deadline import Deadline
from torchcomms.runtime.fingerprint import Fingerprint
from torchcomms.transport.tcp.lane import Lane, LanePeerGone, LaneProtocolError
from torchcomms.transport.tcp.ring import Check, Combine, Ring, as_bytes, spans
from torchcomms.types import RedOpType, ReduceOp

#: Frame lengths are u32: a chunk must stay below this (larger ops go to gloo).
_MAX_CHUNK = 1 << 31
#: Broadcast segments through ranks in the middle of the chain (at most ``_MAX_SEGMENTS``).
_SEGMENT = 256 * 1024
_MAX_SEGMENTS = 16
#: The least a two-rank reduction combines at once while the rest arrives.
FOLD_BYTES = 256 * 1024
#: The sizes (bytes, from, below) at which a two-rank all_reduce takes the ring's two steps
#: (half the tensor each way in each) rather than one exchange of all of it.  Measured on
#: the 2-core VM, in place, p50 of alternating blocks in the same processes, exchange /
#: ring, us: 512 KiB 254-291 / 358-368; 1 MiB 767-816 / 680-688; 2 MiB 1715-1817 /
#: 1286-1485; 4 MiB 3717-4214 / 2959-3744; 8 MiB 6960-9294 / 7317-8183 (a tie); 12 MiB
#: 10115-10780 / 10676-11492; 16 MiB 16766-17509 / 16931-17176; 32 MiB 28014-30962 /
#: 34429-34600 (benchmarks/results/issue53/NOTES.md, step 12).
PAIR_RING_BYTES = (1 << 20, 8 << 20)
#: The same for a two-rank reduce: none, its one transfer to the root was ahead at every
#: size (512 KiB-8 MiB, transfer / ring, us: 138-449 / 331-720 ... 3152-3306 / 7002-7170;
#: the same NOTES step).
PAIR_REDUCE_RING_BYTES = (0, 0)
_NOTHING = memoryview(b"")


def combiner(op: ReduceOp, dtype: torch.dtype) -> Combine:
    """``out = mine (op) incoming`` (PREMUL_SUM: its operands were premultiplied)."""
    table = BINARY_BOOL if dtype is torch.bool else BINARY
    fn = table.get(op.type, torch.add)

    def combine(mine: torch.Tensor, incoming: torch.Tensor, out: torch.Tensor) -> None:
        fn(mine, incoming, out=out)

    return combine


class RingOps:
    """Large collectives of one tcp communicator (see the module docstring).

    ``begin(fp)`` starts a collective on the communicator (its sequence number, which it
    returns); ``check``: whether headers are compared (``TORCHCOMM_MISMATCH_CHECK``).
    """

    def __init__(
        self,
        lane: Lane,
        exchange: Exchange,
        waiter: TcpWaiter,
        begin: Callable[[Fingerprint], int],
        check: bool,
    ) -> None:
        self.rank = lane.rank
        self.size = lane.size
        self.ring = Ring(lane, HEADER_BYTES)
        self._owed = lane.owed  # two ranks: what a posted op's peer still owes
        self._exchange = exchange
        self._waiter = waiter
        self._begin = begin
        self._check = check
        self._spare_bytes = torch.empty(0, dtype=torch.uint8)

    def fits(self, tensor: torch.Tensor, chunks: int = 1) -> bool:
        """Whether an op on ``tensor`` (cut into ``chunks``) runs here."""
        nbytes = tensor.numel() * tensor.element_size()
        return tensor.is_contiguous() and self.fits_bytes(nbytes, chunks)

    def fits_bytes(self, nbytes: int, chunks: int = 1) -> bool:
        """Whether ``nbytes`` cut into ``chunks`` fit the ring's frames (the same on every rank)."""
        return self.size > 1 and nbytes // chunks + 64 < _MAX_CHUNK

    # -- the ops -------------------------------------------------------------------------
    def all_reduce(
        self, flat: torch.Tensor, op: ReduceOp, fp: Fingerprint, deadline: Deadline
    ) -> None:
        header, check, between = self._enter(fp, "all_reduce", deadline)
        nbytes = flat.numel() * flat.element_size()
        if self.size == 2 and not PAIR_RING_BYTES[0] <= nbytes < PAIR_RING_BYTES[1]:
            self._pair_all_reduce(flat, op, header, check, between)
            return
        plan = spans(flat.numel(), self.size)
        first, k = plan[self.rank]
        src = premultiplied(flat, op)
        # The reduce-scatter half leaves the caller's tensor alone (partial sums in
        # scratch): only once every rank's header passed does any byte of it change.
        own = self.ring.scratch(flat.dtype, max(n for _, n in plan), 3)[:k]
        with self._lane_errors("all_reduce"):
            self.ring.reduce_scatter(src, own, combiner(op, flat.dtype), header, check, between)
            self.ring.all_gather(flat, plan, None, None, between, own=own)
        flat[first : first + k].copy_(own)
        finish_average(flat, op, self.size)

    def _pair_all_reduce(
        self,
        flat: torch.Tensor,
        op: ReduceOp,
        header: memoryview,
        check: Check | None,
        between: Callable[[], None],
    ) -> None:
        """Two ranks: one exchange of the whole tensor, each rank combining the peer's
        data piece by piece as it arrives (``_Folding``).  The same bytes cross the wire as
        in the ring's two steps, with one meeting fewer; both ranks compute ``mine (op)
        theirs``, and every op here is commutative, so they end with the same bits."""
        src = premultiplied(flat, op)
        theirs = self._spare(flat)
        fold = _Folding(src, theirs, flat, combiner(op, flat.dtype), sending=src is flat)
        with self._lane_errors("all_reduce"):
            self.ring.step(as_bytes(src), as_bytes(theirs), header, check, between,
                           progress=fold)  # fmt: skip
        fold.finish()
        finish_average(flat, op, self.size)

    def reduce(
        self, flat: torch.Tensor, root: int, op: ReduceOp, fp: Fingerprint, deadline: Deadline
    ) -> None:
        """Two ranks: ``_pair_reduce`` (``PAIR_REDUCE_RING_BYTES``).  More (``TcpOps`` sends
        3-4 ranks to a tree): the
        reduce-scatter half, then the all-gather half, into scratch on the ranks that are
        not the root (their tensor is only read)."""
        header, check, between = self._enter(fp, "reduce", deadline)
        nbytes = flat.numel() * flat.element_size()
        lo, hi = PAIR_REDUCE_RING_BYTES
        if self.size == 2 and not lo <= nbytes < hi:
            self._pair_reduce(flat, root, op, header, check, between)
            return
        plan = spans(flat.numel(), self.size)
        first, k = plan[self.rank]
        src = premultiplied(flat, op)
        own = self.ring.scratch(flat.dtype, max(n for _, n in plan), 3)[:k]
        is_root = self.rank == root
        with self._lane_errors("reduce"):
            self.ring.reduce_scatter(src, own, combiner(op, flat.dtype), header, check, between)
            dst = flat if is_root else self._spare(flat)
            self.ring.all_gather(dst, plan, None, None, between, own=own)
        if is_root:
            flat[first : first + k].copy_(own)
            finish_average(flat, op, self.size)

    def _pair_reduce(
        self,
        flat: torch.Tensor,
        root: int,
        op: ReduceOp,
        header: memoryview,
        check: Check | None,
        between: Callable[[], None],
    ) -> None:
        """Two ranks: the peer sends its whole tensor one way and the root combines it
        piece by piece as it arrives; the root's header travels the other way at the same
        time, so both ranks check the pair without a round trip."""
        src = premultiplied(flat, op)
        with self._lane_errors("reduce"):
            if self.rank != root:  # the root's header is owed (``transport.tcp.posted``)
                self.ring.step(as_bytes(src), None, header, None, between)
                self._owe("reduce", check, between)
                return
            theirs = self._spare(flat)
            fold = _Folding(src, theirs, flat, combiner(op, flat.dtype), sending=False)
            self.ring.step(_NOTHING, as_bytes(theirs), header, check, between, progress=fold)
        fold.finish()
        finish_average(flat, op, self.size)

    def _spare(self, like: torch.Tensor) -> torch.Tensor:
        """A reused buffer shaped as ``like`` that a non-root rank's gather lands in (a new
        allocation per op would cost its page faults, as much as the copy itself)."""
        need = like.numel() * like.element_size()
        if self._spare_bytes.numel() < need:
            self._spare_bytes = torch.empty(need, dtype=torch.uint8)
        return self._spare_bytes[:need].view(like.dtype)

    def reduce_scatter(
        self,
        out: torch.Tensor,
        flat_in: torch.Tensor,
        op: ReduceOp,
        fp: Fingerprint,
        deadline: Deadline,
    ) -> None:
        header, check, between = self._enter(fp, "reduce_scatter", deadline)
        if op.type is RedOpType.PREMUL_SUM:
            flat_in = flat_in * op.factor_value()  # never scale the caller's input
        with self._lane_errors("reduce_scatter"):
            self.ring.reduce_scatter(flat_in, out, combiner(op, out.dtype), header, check, between)
        finish_average(out, op, self.size)

    def all_gather(
        self, flat: torch.Tensor, src: torch.Tensor, fp: Fingerprint, deadline: Deadline
    ) -> None:
        header, check, between = self._enter(fp, "all_gather", deadline)
        n = src.numel()
        plan = [(r * n, n) for r in range(self.size)]
        with self._lane_errors("all_gather"):
            self.ring.all_gather(flat, plan, header, check, between, own=src)
        mine = flat[self.rank * n : (self.rank + 1) * n]
        if mine.data_ptr() != src.data_ptr():
            mine.copy_(src)

    def all_to_all_pair(
        self, out: torch.Tensor, src: torch.Tensor, fp: Fingerprint, deadline: Deadline
    ) -> None:
        """Two ranks, equal parts, ``out`` and ``src`` apart: send ``src``'s part for the peer
        while the peer's part for this rank arrives in ``out``."""
        header, check, between = self._enter(fp, "all_to_all", deadline)
        n = src.numel() // 2
        mine, theirs = self.rank * n, (1 - self.rank) * n
        with self._lane_errors("all_to_all"):
            self.ring.step(
                as_bytes(src[theirs : theirs + n]),
                as_bytes(out[theirs : theirs + n]),
                header,
                check,
                between,
            )
        out[mine : mine + n].copy_(src[mine : mine + n])

    def broadcast(self, flat: torch.Tensor, root: int, fp: Fingerprint, deadline: Deadline) -> None:
        header, check, between = self._enter(fp, "broadcast", deadline)
        n = self.size
        pos = (root - self.rank) % n  # 0: the root, n-1: the chain's end (root + 1)
        nbytes = flat.numel() * flat.element_size()
        count = 1 if n == 2 else max(1, min(_MAX_SEGMENTS, nbytes // _SEGMENT))
        segs = [as_bytes(flat[a : a + k]) for a, k in spans(flat.numel(), count)]
        step = self.ring.step
        nothing = memoryview(b"")
        with self._lane_errors("broadcast"):
            if pos == 0:
                for i, seg in enumerate(segs):
                    step(seg, None, header if i == 0 else None, None, between)
                if n == 2:  # the close is owed (``transport.tcp.posted``)
                    self._owe("broadcast", check, between)
                    return
                step(None, nothing, None, check, between, header_in=True)  # the close
                if n > 2:
                    step(nothing, None, None, None, between)  # the second lap: all agreed
                return
            if n == 2:
                # The close first: the root does not wait for it (``transport.tcp.posted``),
                # and reads it sooner, while its next op's bytes may already be on their way.
                step(nothing, None, header, None, between)
                step(None, segs[0], None, check, between, header_in=True)
                return
            step(None, segs[0], None, check, between, header_in=True)
            last = pos == n - 1
            for i in range(1, count):
                forward = None if last else segs[i - 1]
                step(forward, segs[i], header if i == 1 else None, None, between, False)
            if last:
                step(nothing, None, header, None, between)  # close the chain
                return
            step(segs[-1], None, header if count == 1 else None, None, between)
            # Only a rank past this one saw whether the ranks after it agree: wait for the
            # root's word that the chain closed (forwarded down to the last middle rank).
            step(None, nothing, None, None, between, header_in=False)
            if pos < n - 2:
                step(nothing, None, None, None, between)

    # -- plumbing ------------------------------------------------------------------------
    def _enter(
        self, fp: Fingerprint, what: str, deadline: Deadline
    ) -> tuple[memoryview, Check | None, Callable[[], None]]:
        """Start a ring collective: its header, the check of the peer's, the wait hook."""
        seq = self._begin(fp)
        header = self._exchange.header(seq, fp)
        waiter = self._waiter

        def between() -> None:
            waiter.check(deadline, what)

        if self._owed is not None and self._owed.checks:
            with self._lane_errors(what):
                self._owed.settle(between)

        if not self._check:
            return header, None, between
        exchange, report, peer = self._exchange, waiter.report, (self.rank + 1) % self.size

        def check(theirs: memoryview) -> None:
            if exchange.differs(theirs, peer):
                other = decode(theirs)
                if other is None:
                    raise LaneProtocolError(f"rank {peer} sent a frame without an op header")
                raise report.pairwise(what, (fp, seq), peer, other)

        return header, check, between

    def _owe(self, what: str, check: Check | None, between: Callable[[], None]) -> None:
        """Two ranks: this op's frame from the peer is owed (``transport.tcp.posted``),
        checked (``check``: the comparison is on) against this op's header later."""
        current, owed = self._waiter.current, self._owed
        assert current is not None and owed is not None  # ``_enter`` set it; two ranks
        fp, seq = current
        owed.add(self._exchange.owed_check(seq, fp, what) if check else None, between)

    def _lane_errors(self, what: str) -> _LaneErrors:
        return _LaneErrors(self._waiter, what)


class _Folding:
    """``out = mine (op) theirs`` piece by piece while ``theirs`` arrives (a ``Ring.step``
    progress callback), at least ``FOLD_BYTES`` at a time.  ``sending``: ``out`` is also
    what this rank is sending, so a piece is combined only once it has gone out."""

    __slots__ = ("_combine", "_done", "_esize", "_mine", "_out", "_sending", "_theirs", "_total")

    def __init__(
        self,
        mine: torch.Tensor,
        theirs: torch.Tensor,
        out: torch.Tensor,
        combine: Combine,
        sending: bool,
    ) -> None:
        self._mine, self._theirs, self._out = mine, theirs, out
        self._combine = combine
        self._sending = sending
        self._esize = mine.element_size()
        self._total = mine.numel()
        self._done = 0

    def __call__(self, arrived: int, unsent: int) -> None:
        ready = arrived
        if self._sending:
            ready = min(ready, self._total * self._esize - unsent)
        ready //= self._esize
        if ready - self._done >= FOLD_BYTES // self._esize:
            self._fold(ready)

    def _fold(self, upto: int) -> None:
        a = self._done
        self._combine(self._mine[a:upto], self._theirs[a:upto], self._out[a:upto])
        self._done = upto

    def finish(self) -> None:
        """Combine the rest (everything has arrived and gone out)."""
        if self._done < self._total:
            self._fold(self._total)


class _LaneErrors:
    """A peer's goodbye (or lost connection) inside a ring op, as the waiter words it."""

    __slots__ = ("_waiter", "_what")

    def __init__(self, waiter: TcpWaiter, what: str) -> None:
        self._waiter = waiter
        self._what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, LanePeerGone):
            raise self._waiter.gone(exc, self._what) from None
