"""Collective algorithms over a ``ShmChannel`` (every member on this host).

Each collective is a sequence of rounds; every member runs the same rounds in the same
order (round counts derive from sizes all members know, or, for all-to-all with
per-rank splits, from a count every member publishes in the first round).  Per round a
member copies its contribution into its own slot, publishes, waits for the slots it
reads, and copies or reduces straight from the peers' slots with torch kernels:

* all_reduce: one-shot up to ``oneshot_max`` bytes (every rank reduces every slot;
  ``cpu.shm.oneshot``, with reduce, broadcast, and small all_gather, all_to_all and
  reduce_scatter that fit one round: the latency path);
  above it, per slot-sized chunk, reduce-scatter (rank ``r`` reduces shard ``r`` from
  all slots into its next slot) then all-gather of the reduced shards (between two ranks,
  each trades the half its peer reduces); between two ranks, from 512 KiB, straight from the
  peer's tensor (``cpu.shm.single_copy``);
* reduce: the same, with only the root reducing or gathering (two ranks: the root reads
  its peer's tensor);
* broadcast / scatter: the root writes, the others read; gather the reverse;
* all_gather, reduce_scatter and all_to_all move a column block of every rank's
  contribution per round, as one strided copy or reduction when sizes are even (all_gather,
  uniform all_to_all and broadcast of more than one round: ``cpu.shm.slot_copies``); large
  all_gather, uniform all_to_all and broadcast copy once, straight between the ranks' address
  spaces (``cpu.shm.single_copy``).

All tensors handed in are contiguous CPU tensors (the backend stages others).  The
first round of every op carries a fingerprint of (op, dtype, sizes, root): a member that
called something else raises instead of reading stale bytes.

Every round goes through the channel's round API (``transport.shm.channel``): a rank that writes
takes ``k = chan.begin(deadline)``, fills its slot, then ``chan.exchange`` (publish, wait
for every rank, check the fingerprint) or ``publish`` alone, reads, and ``chan.finish(k)``;
a rank that only reads takes ``chan.next_round()`` and ``wait_rank``/``wait_all``.  The
one-round collectives (``cpu.shm.oneshot``) use ``begin``/``finish`` too but inline
publishing and the fast checks of the arrival wait and fingerprints.  Every wait
is bounded by the op's ``Deadline``.  The methods run on the thread that runs the op (the
communicator's executor, or the caller's for a sync op), one op at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from torchcomms.backends.cpu.reductions import BINARY, BINARY_BOOL, reduce_rows
from torchcomms.backends.cpu.shm import slot_copies
from torchcomms.backends.cpu.shm.oneshot import OneShot
from torchcomms.backends.cpu.shm.single_copy import (
    BROADCAST_MIN_BYTES,
    PAIR_BROADCAST_MIN_BYTES,
    PAIR_REDUCTION_MIN_BYTES,
    SingleCopy,
)
from torchcomms.runtime import fingerprint as F
from torchcomms.runtime.deadline import Deadline
from torchcomms.runtime.fingerprint import Fingerprint
from torchcomms.transport.shm.channel import ShmChannel
from torchcomms.types import RedOpType, ReduceOp


def _store(dst: torch.Tensor, src: torch.Tensor, op: ReduceOp | None) -> None:
    """Copy a contribution into a slot, pre-multiplied for PREMUL_SUM."""
    if op is not None and op.type is RedOpType.PREMUL_SUM:
        torch.mul(src, op.factor_value(), out=dst)
    else:
        dst.copy_(src)


def _bounds(rank: int, shard: int, n: int) -> tuple[int, int]:
    return min(rank * shard, n), min((rank + 1) * shard, n)


class ShmCollectives:
    """Every collective of the API over one channel (see the module docstring)."""

    def __init__(self, chan: ShmChannel, oneshot_max: int, check: bool = True) -> None:
        self.chan = chan
        #: Exchange and compare fingerprints (``TORCHCOMM_MISMATCH_CHECK``; off only to
        #: measure what the check costs).
        self.check = check
        self.oneshot_max = oneshot_max
        self.rank = chan.rank
        self.size = chan.size
        self.oneshot = OneShot(chan, oneshot_max, check)
        self.single = SingleCopy(chan)
        self._broadcast_single_min = (
            PAIR_BROADCAST_MIN_BYTES if self.size == 2 else BROADCAST_MIN_BYTES
        )

    # -- reductions --------------------------------------------------------------------------
    def all_reduce(self, flat: torch.Tensor, op: ReduceOp, deadline: Deadline) -> None:
        """In place on ``flat`` (AVG is finished by the caller)."""
        chan = self.chan
        chan.op_seq += 1
        n = flat.numel()
        dtype = flat.dtype
        oneshot = self.oneshot
        nbytes = n * dtype.itemsize
        if (
            nbytes >= PAIR_REDUCTION_MIN_BYTES
            and self.size == 2
            and self.single.usable is not False
        ):
            fn = self._pair_kernel(dtype, op)
            fp = F.make(F.ALL_REDUCE, dtype, n, redop=op) if self.check else None
            if fn is not None and self.single.wanted(nbytes // 2, fp, deadline, 0):
                self.single.all_reduce_pair(flat, fn, fp, deadline)
                return
        plan = oneshot.plans.get((dtype, n, op._type._value_))  # an int: Enums hash in Python
        if plan is None:
            plan = oneshot.plan(dtype, n, op)
        if plan is not False:
            oneshot.run(flat, op, plan, deadline)
            return
        fp = F.make(F.ALL_REDUCE, dtype, n, redop=op) if self.check else None
        self._all_reduce_slots(flat, op, fp, deadline)

    def _all_reduce_slots(
        self, flat: torch.Tensor, op: ReduceOp, fp: Fingerprint | None, deadline: Deadline
    ) -> None:
        """all_reduce through the slots, a chunk per round or two: one-shot rounds for chunks
        up to the limit, two ranks trading halves, or reduce-scatter + all-gather."""
        oneshot = self.oneshot
        n = flat.numel()
        dtype = flat.dtype
        cap = self.chan.slot_capacity(dtype)
        pair = self.size == 2 and self._pair_kernel(dtype, op) is not None
        step = 2 * cap if pair else cap  # a pair's slot holds half its chunk
        for start in range(0, n, step):
            chunk = flat[start : start + step]
            cn = chunk.numel()
            if cn <= cap and cn * dtype.itemsize <= self.oneshot_max:  # one-shot rounds
                chunk_plan = oneshot.plans.get((dtype, cn, op._type._value_))
                if chunk_plan is None:
                    chunk_plan = oneshot.plan(dtype, cn, op)
                oneshot.run(chunk, op, chunk_plan, deadline, fp)
                continue
            first = fp if start == 0 else None
            if pair and self._pair_reduce_exchange(chunk, op, first, deadline):
                continue
            self._reduce_scatter_gather(chunk, op, first, deadline, None)

    def reduce(self, flat: torch.Tensor, root: int, op: ReduceOp, deadline: Deadline) -> None:
        """In place on the root's ``flat``; other ranks' tensors are left as they were."""
        chan = self.chan
        n = flat.numel()
        dtype = flat.dtype
        nbytes = n * dtype.itemsize
        fp: Fingerprint | None = None
        pair = nbytes >= PAIR_REDUCTION_MIN_BYTES and self.size == 2
        fn = self._pair_kernel(dtype, op) if pair and self.single.usable is not False else None
        if fn is not None:  # before the one-shot round, which it beats from this size
            fp = F.make(F.REDUCE, dtype, n, root, op) if self._enter() else None
            if self.single.wanted(nbytes, fp, deadline, 0):
                self.single.reduce_pair(flat, root, fn, fp, deadline)
                return
        else:
            chan.op_seq += 1
            plan = self.oneshot.plans.get((dtype, n, op._type._value_))
            if plan is not None and plan is not False:  # the latency path: one dict lookup
                rfp = self.oneshot.reduce_fp(dtype, n, root, op)
                self.oneshot.run(flat, op, plan, deadline, rfp, root)
                return
        self._reduce_slots(flat, root, op, fp, deadline)

    def _reduce_slots(
        self,
        flat: torch.Tensor,
        root: int,
        op: ReduceOp,
        fp: Fingerprint | None,
        deadline: Deadline,
    ) -> None:
        """reduce through the slots (the caller advanced ``op_seq``): one one-shot round where
        it fits, else reduce-scatter + gather per slot-sized chunk."""
        oneshot = self.oneshot
        n = flat.numel()
        dtype = flat.dtype
        plan = oneshot.plans.get((dtype, n, op._type._value_))
        if plan is None:
            plan = oneshot.plan(dtype, n, op)
        if plan is not False:  # the one-shot round; every rank checks every fingerprint
            oneshot.run(flat, op, plan, deadline, oneshot.reduce_fp(dtype, n, root, op), root)
            return
        if fp is None and self.check:
            fp = F.make(F.REDUCE, dtype, n, root, op)
        cap = self.chan.slot_capacity(dtype)
        for start in range(0, n, cap):
            chunk = flat[start : start + cap]
            self._reduce_scatter_gather(chunk, op, fp if start == 0 else None, deadline, root)

    @staticmethod
    def _pair_kernel(dtype: torch.dtype, op: ReduceOp) -> Callable[..., torch.Tensor] | None:
        """The binary kernel a large reduction between two ranks combines with on the
        single-copy path; None (PREMUL_SUM's pre-multiplication) keeps the slot path."""
        return (BINARY_BOOL if dtype is torch.bool else BINARY).get(op.type)

    def _pair_reduce_exchange(
        self, chunk: torch.Tensor, op: ReduceOp, fp: Fingerprint | None, deadline: Deadline
    ) -> bool:
        """all_reduce of one chunk between exactly two ranks, with the least copying.

        Each rank publishes only the half its peer reduces, combines its own half in place
        with the peer's copy (one binary kernel), and publishes the result for the peer:
        every half starts at its slot's first byte, so a chunk may be two slots long.
        False when ``op`` needs the general path (PREMUL_SUM's own pre-multiplication).
        """
        fn = (BINARY_BOOL if chunk.dtype is torch.bool else BINARY).get(op.type)
        if fn is None:
            return False
        chan = self.chan
        me = self.rank
        other = 1 - me
        dtype = chunk.dtype
        c = chunk.numel()
        shard = -(-c // 2)
        lo, hi = _bounds(me, shard, c)
        a, b = _bounds(other, shard, c)
        k = chan.begin(deadline)
        if b > a:
            chan.slot(me, k, dtype, b - a).copy_(chunk[a:b])
        chan.exchange(k, deadline, fp, "all_reduce")
        mine = chunk[lo:hi]
        if hi > lo:
            fn(mine, chan.slot(other, k, dtype, hi - lo), out=mine)
            chan.slot(me, k + 1, dtype, hi - lo).copy_(mine)
        chan.finish(k)
        k = chan.next_round()  # its slot is free: the peer finished k - 1 before publishing k
        chan.exchange(k, deadline)
        if b > a:
            chunk[a:b].copy_(chan.slot(other, k, dtype, b - a))
        chan.finish(k)
        return True

    def _reduce_scatter_gather(
        self,
        chunk: torch.Tensor,
        op: ReduceOp,
        fp: Fingerprint | None,
        deadline: Deadline,
        root: int | None,
    ) -> None:
        """Two rounds on one slot-sized chunk: shard reduction, then (all-)gather of shards."""
        chan = self.chan
        me, size = self.rank, self.size
        dtype = chunk.dtype
        c = chunk.numel()
        shard = -(-c // size)
        lo, hi = _bounds(me, shard, c)
        k = chan.begin(deadline)
        _store(chan.slot(me, k, dtype, c), chunk, op)
        chan.exchange(k, deadline, fp, "all_reduce" if root is None else "reduce")
        # Readers of round k + 1's slot finished round k - 1 before publishing round k.
        if hi > lo:
            reduce_rows(
                chan.rows(k, dtype, hi - lo, at=lo), chan.slot(me, k + 1, dtype, hi - lo), op
            )
        chan.finish(k)
        k = chan.next_round()  # its slot was written above (see the comment there)
        chan.publish(k)
        if root is None or me == root:
            chan.wait_all(k, deadline)
            if c == shard * size:
                chunk.view(size, shard).copy_(chan.rows(k, dtype, shard))
            else:
                for r in range(size):
                    a, b = _bounds(r, shard, c)
                    if b > a:
                        chunk[a:b].copy_(chan.slot(r, k, dtype, b - a))
        chan.finish(k)

    def reduce_scatter(
        self, out: torch.Tensor, inputs: torch.Tensor, op: ReduceOp, deadline: Deadline
    ) -> None:
        """``inputs`` is [size, n] (row r goes to rank r); ``out`` is [n]."""
        chan = self.chan
        size, me = self.size, self.rank
        n = out.numel()
        dtype = out.dtype
        plan = self.oneshot.rs_plan(dtype, n, op)
        if plan is not None:
            self.oneshot.reduce_scatter(out, inputs, op, plan, deadline)
            return
        fp = F.make(F.REDUCE_SCATTER, dtype, n, -1, op) if self._enter() else None
        per = max(chan.slot_capacity(dtype) // size, 1)
        stride = chan.layout.slot_bytes // dtype.itemsize
        for start in range(0, n, per):
            c = min(per, n - start)
            k = chan.begin(deadline)
            base = chan.layout.slot_offset(k & 1, 0)
            mine = chan.view(base + me * chan.layout.slot_bytes, dtype, (size, c), (c, 1))
            _store(mine, inputs[:, start : start + c], op)
            chan.exchange(k, deadline, fp if start == 0 else None, "reduce_scatter")
            rows = chan.view(base + me * c * dtype.itemsize, dtype, (size, c), (stride, 1))
            reduce_rows(rows, out[start : start + c], op)
            chan.finish(k)

    def reduce_scatter_v(
        self,
        out: torch.Tensor,
        inputs: Sequence[torch.Tensor],
        op: ReduceOp,
        deadline: Deadline,
    ) -> None:
        """Flat ``inputs[r]`` goes to rank r; sizes may differ per rank (all ranks know them)."""
        chan = self.chan
        size, me = self.size, self.rank
        sizes = [t.numel() for t in inputs]
        dtype = out.dtype
        per = max(chan.slot_capacity(dtype) // size, 1)
        fp, starts = self._open_v(F.REDUCE_SCATTER_V, dtype, op, sizes, per, deadline)
        stride = chan.layout.slot_bytes // dtype.itemsize
        for start in starts:
            k = chan.begin(deadline)
            base = chan.layout.slot_offset(k & 1, 0)
            for r, t in enumerate(inputs):
                c = min(per, sizes[r] - start)
                if c > 0:
                    at = base + (me * stride + r * per) * dtype.itemsize
                    _store(chan.view(at, dtype, (c,), (1,)), t[start : start + c], op)
            chan.exchange(k, deadline, fp if start == 0 else None, "reduce_scatter_v")
            c = min(per, sizes[me] - start)
            if c > 0:
                rows = chan.view(base + me * per * dtype.itemsize, dtype, (size, c), (stride, 1))
                reduce_rows(rows, out[start : start + c], op)
            chan.finish(k)

    # -- one to all, all to one ------------------------------------------------------------
    def broadcast(self, flat: torch.Tensor, root: int, deadline: Deadline) -> None:
        chan = self.chan
        n = flat.numel()
        dtype = flat.dtype
        oneshot = self.oneshot
        plan = oneshot.bcast_plans.get((dtype, n, root))
        cap = chan.slot_capacity(dtype)
        nbytes = n * dtype.itemsize
        # The one-shot round, below the single copy's size (or where it cannot run).
        fits = n <= cap and (nbytes < self._broadcast_single_min or self.single.usable is False)
        if plan is None and fits:
            plan = oneshot.bcast_plan(dtype, n, root)
        if plan is not None:  # one round, views and fingerprint made once per shape
            oneshot.broadcast(flat, root, plan, deadline)
            return
        fp = F.make(F.BROADCAST, dtype, n, root) if self._enter() else None
        if self.single.wanted(nbytes, fp, deadline, self._broadcast_single_min):
            self.single.broadcast(flat, root, fp, deadline)
            return
        slot_copies.broadcast(self.chan, flat, root, fp, deadline)

    def scatter(
        self, out: torch.Tensor, inputs: Sequence[torch.Tensor], root: int, deadline: Deadline
    ) -> None:
        """``inputs`` (flat, root only) row r goes to rank r's ``out``."""
        chan = self.chan
        size, me = self.size, self.rank
        n = out.numel()
        dtype = out.dtype
        fp = F.make(F.SCATTER, dtype, n, root) if self._enter() else None
        per = max(chan.slot_capacity(dtype) // size, 1)
        for start in range(0, n, per):
            c = min(per, n - start)
            first = start == 0  # every rank publishes and checks every fingerprint
            if me == root:
                k = chan.begin(deadline)
                for r, t in enumerate(inputs):
                    if r != me:
                        chan.slot(root, k, dtype, c, at=r * per).copy_(t[start : start + c])
                if first:
                    chan.exchange(k, deadline, fp, "scatter")
                else:
                    chan.publish(k)
                out[start : start + c].copy_(inputs[me][start : start + c])
            else:
                if first:
                    k = chan.begin(deadline)
                    chan.exchange(k, deadline, fp, "scatter")
                else:
                    k = chan.next_round()
                    chan.wait_rank(k, root, deadline)
                out[start : start + c].copy_(chan.slot(root, k, dtype, c, at=me * per))
            chan.finish(k)

    def gather(
        self, outs: Sequence[torch.Tensor], inp: torch.Tensor, root: int, deadline: Deadline
    ) -> None:
        """Rank r's flat ``inp`` lands in the root's flat ``outs[r]``."""
        chan = self.chan
        me = self.rank
        n = inp.numel()
        dtype = inp.dtype
        fp = F.make(F.GATHER, dtype, n, root) if self._enter() else None
        cap = chan.slot_capacity(dtype)
        for start in range(0, n, cap):
            c = min(cap, n - start)
            k = chan.begin(deadline)
            if me != root:
                chan.slot(me, k, dtype, c).copy_(inp[start : start + c])
                if start == 0:  # every rank checks every fingerprint
                    chan.exchange(k, deadline, fp, "gather")
                else:
                    chan.publish(k)
            else:
                chan.exchange(k, deadline, fp if start == 0 else None, "gather")
                for r, o in enumerate(outs):
                    src = inp[start : start + c] if r == me else chan.slot(r, k, dtype, c)
                    o[start : start + c].copy_(src)
            chan.finish(k)

    # -- all to all --------------------------------------------------------------------------
    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, deadline: Deadline) -> None:
        """``out`` is [size, n]; row r receives rank r's flat ``inp``."""
        n = inp.numel()
        dtype = inp.dtype
        plan = self.oneshot.copy_plan(F.ALL_GATHER, dtype, n)
        if plan is not None:
            self.oneshot.copy_round(out, inp, plan, deadline, "all_gather")
            return
        fp = F.make(F.ALL_GATHER, dtype, n) if self._enter() else None
        if self.single.wanted(n * dtype.itemsize, fp, deadline):
            self.single.all_gather(out, inp, fp, deadline)
            return
        slot_copies.all_gather(self.chan, out, inp, fp, deadline)

    def all_gather_v(
        self, outs: Sequence[torch.Tensor], inp: torch.Tensor, deadline: Deadline
    ) -> None:
        """Flat ``outs[r]`` receives rank r's flat ``inp`` (sizes may differ per rank)."""
        chan = self.chan
        me = self.rank
        sizes = [o.numel() for o in outs]
        dtype = inp.dtype
        cap = chan.slot_capacity(dtype)
        fp, starts = self._open_v(F.ALL_GATHER_V, dtype, None, sizes, cap, deadline)
        for start in starts:
            k = chan.begin(deadline)
            c = min(cap, sizes[me] - start)
            if c > 0:
                chan.slot(me, k, dtype, c).copy_(inp[start : start + c])
            chan.exchange(k, deadline, fp if start == 0 else None, "all_gather_v")
            for r, o in enumerate(outs):
                c = min(cap, sizes[r] - start)
                if c > 0:
                    o[start : start + c].copy_(chan.slot(r, k, dtype, c))
            chan.finish(k)

    def all_to_all(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_splits: Sequence[int],
        in_splits: Sequence[int],
        uniform: bool,
        deadline: Deadline,
    ) -> None:
        """Flat tensors; element counts per peer (``in_splits[r]`` of ``inp`` go to rank r).

        ``uniform``: every rank's splits are equal (``all_to_all_single``), known on every
        rank alike; otherwise the variable path, whatever this rank's splits look like."""
        chan = self.chan
        size, me = self.size, self.rank
        dtype = inp.dtype
        per = max(chan.slot_capacity(dtype) // size, 1)
        stride = chan.layout.slot_bytes // dtype.itemsize
        item = dtype.itemsize
        if uniform:
            n = in_splits[0]
            plan = self.oneshot.copy_plan(F.ALL_TO_ALL, dtype, n) if n else None
            if plan is not None:
                self.oneshot.copy_round(out, inp, plan, deadline, "all_to_all")
                return
            fp = F.make(F.ALL_TO_ALL, dtype, n) if self._enter() else None
            if n == 0:
                self._check_round(fp, deadline, "all_to_all")
                return
            if self.single.wanted(n * item, fp, deadline):
                self.single.all_to_all(out, inp, n, fp, deadline)
                return
            slot_copies.all_to_all(self.chan, out, inp, n, fp, deadline)
            return
        fp = F.make(F.ALL_TO_ALL_V, dtype, 0) if self._enter() else None
        in_offs = _offsets(in_splits)
        out_offs = _offsets(out_splits)
        needed = max(1, -(-max(*in_splits, *out_splits, 0) // per))
        rounds = 1
        start = 0
        while True:
            k = chan.begin(deadline)
            base = chan.layout.slot_offset(k & 1, 0)
            for r in range(size):
                c = min(per, in_splits[r] - start)
                if c > 0:
                    at = base + (me * stride + r * per) * item
                    chan.view(at, dtype, (c,), (1,)).copy_(
                        inp[in_offs[r] + start : in_offs[r] + start + c]
                    )
            first = start == 0
            # The first round also carries how many rounds this rank needs; all run the most.
            chan.publish(k, fp if first else None, needed if first else None)
            chan.wait_all(k, deadline, fp if first else None, "all_to_all")
            if first:
                rounds = max(chan.count_of(k, r) for r in range(size))
            for r in range(size):
                c = min(per, out_splits[r] - start)
                if c > 0:
                    at = base + (r * stride + me * per) * item
                    out[out_offs[r] + start : out_offs[r] + start + c].copy_(
                        chan.view(at, dtype, (c,), (1,))
                    )
            chan.finish(k)
            start += per
            rounds -= 1
            if rounds <= 0:
                return

    def barrier(self, deadline: Deadline) -> None:
        self.oneshot.barrier(deadline)

    def empty(
        self,
        op: int,
        dtype: torch.dtype,
        deadline: Deadline,
        root: int = -1,
        redop: ReduceOp | None = None,
    ) -> None:
        """An op with nothing to move still meets its peers: a mismatch must not slip by."""
        fp = F.make(op, dtype, 0, root, redop) if self._enter() else None
        self._check_round(fp, deadline, F.OP_NAMES[op])

    def _open_v(
        self,
        op: int,
        dtype: torch.dtype,
        redop: ReduceOp | None,
        sizes: list[int],
        per: int,
        deadline: Deadline,
    ) -> tuple[Fingerprint | None, range]:
        """Start a ``_v`` op over per-rank ``sizes``: its fingerprint, and the first element
        of each of its rounds of ``per``; with nothing to move, none (its one round, the
        check, has run)."""
        fp = F.make(op, dtype, 0, -1, redop, sizes) if self._enter() else None
        if any(sizes):
            return fp, range(0, max(sizes), per)
        self._check_round(fp, deadline, F.OP_NAMES[op])
        return fp, range(0)

    def _check_round(self, fp: Fingerprint | None, deadline: Deadline, what: str) -> None:
        chan = self.chan
        k = chan.begin(deadline)
        chan.exchange(k, deadline, fp, what)
        chan.finish(k)

    def _enter(self) -> bool:
        """Count the next collective in (its sequence number advances either way); whether
        its fingerprint is made and checked (``fp = F.make(...) if self._enter() else None``)."""
        self.chan.op_seq += 1
        return self.check


def _offsets(splits: Sequence[int]) -> list[int]:
    offs, acc = [], 0
    for s in splits:
        offs.append(acc)
        acc += s
    return offs
