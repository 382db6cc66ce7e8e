"""One-round collectives over a ``ShmChannel``: the small-message latency path.

* all_reduce: every rank copies its contribution into its own slot, publishes, waits for
  every rank and reduces all slots (rank order, so every rank computes the same bits)
  into its tensor;
* reduce: the same round, and only the root reduces;
* broadcast: the root copies into its slot, every rank publishes (carrying its
  fingerprint), and the others copy out once everyone arrived;
* all_gather and uniform all_to_all up to ``host_arrays.MAX_BYTES`` per rank: every rank
  copies its input into its slot, publishes, and copies its part of every rank's slot into
  its output, as bytes (numpy: a copy needs no dtype, so every dtype takes it);
* reduce_scatter whose whole input is up to ``host_arrays.MAX_BYTES``: every rank copies its
  input into its slot, publishes, and reduces its column of every rank's slot into its
  output (numpy where it is exact, else the slot path's torch kernels, so the bits match).

Every rank of a round checks every rank's fingerprint, as ``ShmChannel.exchange`` does.
A plan per shape holds the slot views and the fingerprint, built once.  Payloads up to
``host_arrays.MAX_BYTES`` of the dtypes (and reductions) numpy does exactly move and
reduce with numpy on views of the segment and of the caller's tensor: a torch call costs
1-2.5 us of dispatch on a small tensor, a ufunc or slice assignment 0.1-0.5 us.

``begin`` and ``finish`` are the channel's, as for every round; publishing, the arrival
wait and the fingerprint check are ``_meet``: fast checks that call into the channel only
when something is missing or wrong.  Everything runs on the thread that runs the op, one
op at a time (``ShmCollectives`` calls in).
"""

from __future__ import annotations

from typing import Any

import torch

from torchcomms.backends.cpu import host_arrays
from torchcomms.backends.cpu.reductions import reduce_rows
from torchcomms.runtime import fingerprint as F
from torchcomms.runtime.deadline import Deadline
from torchcomms.runtime.fingerprint import Fingerprint
from torchcomms.transport.shm.channel import ShmChannel
from torchcomms.types import RedOpType, ReduceOp

_Pair = tuple[torch.Tensor, torch.Tensor]
# numpy: own slot per parity, the ranks' rows per parity (a list of two 1-D arrays for two
# ranks, one 2-D array otherwise), the ufunc (None: numpy copies, torch reduces), the
# caller-tensor views.
_Tiny = tuple[tuple[Any, Any], tuple[Any, Any], Any, host_arrays.UserArrays]
# The fingerprint, own slot per parity, all-rank rows per parity, whether it pre-multiplies
# / reduces with a plain torch.sum, the numpy form (None: torch kernels), and for a plain
# sum of two ranks both slots per parity (one torch.add: 1.5 us against torch.sum's 2.2).
Plan = tuple[Fingerprint, _Pair, _Pair, bool, bool, "_Tiny | None", "tuple[_Pair, _Pair] | None"]
# A broadcast's fingerprint, the root's slot per parity, and the numpy form (the root's
# slot per parity as arrays, the caller-tensor views) or None.
BcastPlan = tuple[Fingerprint, _Pair, "tuple[tuple[Any, Any], host_arrays.UserArrays] | None"]

# An all_gather's or all_to_all's fingerprint, per parity this rank's slot and this rank's
# part of every rank's slot (numpy, bytes), and the byte views of the caller's input and
# output.
CopyPlan = tuple[
    Fingerprint, tuple[Any, Any], tuple[Any, Any], host_arrays.UserArrays, host_arrays.UserArrays
]

# A reduce_scatter's fingerprint; per parity this rank's slot as [size, n] and this rank's
# column of every rank's slot as [size, n]; the numpy form (the ufunc, the slot as a flat
# array and the column per parity, the caller views of the input and the output) or None;
# for a plain sum of two ranks the column's two rows per parity, else None.
_RsTiny = tuple[
    Any, tuple[Any, Any], tuple[Any, Any], host_arrays.UserArrays, host_arrays.UserArrays
]
RsPlan = tuple[Fingerprint, _Pair, _Pair, "_RsTiny | None", "tuple[_Pair, _Pair] | None"]


#: Shapes a plan cache holds before it starts over (a program uses a handful of shapes).
_PLANS_KEPT = 256
#: What a plan cache's ``get`` returns for a shape it has no entry for (None is an entry:
#: "not one round").
_NOT_KEPT: Any = object()


def _kept(cache: dict[Any, Any], key: Any, value: Any) -> Any:
    """``cache[key] = value``, starting the cache over when it is full; returns ``value``."""
    if len(cache) > _PLANS_KEPT:
        cache.clear()
    cache[key] = value
    return value


#: Inline flag checks before a wait enters the channel's loop (whose every pass costs about
#: a microsecond): a peer a few microseconds behind is seen within ~0.05 us of arriving.
TIGHT_CHECKS = 64


class OneShot:
    """Plans and rounds of the one-round collectives on one channel."""

    def __init__(self, chan: ShmChannel, oneshot_max: int, check: bool) -> None:
        self.chan = chan
        self.oneshot_max = oneshot_max
        self.check = check
        self.rank = chan.rank
        self.size = chan.size
        #: By (dtype, count, reduce-op value); False: too large for one round.
        self.plans: dict[tuple[object, ...], Plan | bool] = {}
        #: By (dtype, count, root); only shapes that fit one slot.
        self.bcast_plans: dict[tuple[torch.dtype, int, int], BcastPlan] = {}
        self._reduce_fps: dict[tuple[object, ...], Fingerprint] = {}
        #: By (fingerprint kind, dtype, count per peer); None: too large for one round.
        self.copy_plans: dict[tuple[int, torch.dtype, int], CopyPlan | None] = {}
        #: By (dtype, count per rank, reduce-op value); None: not one round.
        self.rs_plans: dict[tuple[torch.dtype, int, int], RsPlan | None] = {}
        self._barrier_fp = F.make(F.BARRIER, None, 0)
        # Flag checks a wait makes inline before the channel's wait loop (about 0.05 us
        # each, so a few microseconds): none when ranks share cores, as in the policy.
        policy = chan.policy
        self.tight_checks = 0 if policy.oversubscribed or policy.spins <= 0 else TIGHT_CHECKS

    # -- plans ---------------------------------------------------------------------------------
    def plan(self, dtype: torch.dtype, n: int, op: ReduceOp) -> Plan | bool:
        """Views and fingerprint of a one-shot all_reduce of this shape (False: too large)."""
        chan = self.chan
        plan: Plan | bool = False
        if n * dtype.itemsize <= self.oneshot_max and n <= chan.slot_capacity(dtype):
            t = op.type
            slots = (chan.slot(self.rank, 0, dtype, n), chan.slot(self.rank, 1, dtype, n))
            rows = (chan.rows(0, dtype, n), chan.rows(1, dtype, n))
            plain_sum = t is RedOpType.SUM and dtype is not torch.bool
            pairs = None
            if plain_sum and self.size == 2:
                pairs = (
                    (chan.slot(0, 0, dtype, n), chan.slot(1, 0, dtype, n)),
                    (chan.slot(0, 1, dtype, n), chan.slot(1, 1, dtype, n)),
                )
            plan = (
                F.make(F.ALL_REDUCE, dtype, n, redop=op),
                slots,
                rows,
                t is RedOpType.PREMUL_SUM,
                plain_sum,
                self._tiny_plan(slots, rows, dtype, n, t),
                pairs,
            )
        return _kept(self.plans, (dtype, n, op._type._value_), plan)

    def _tiny_plan(
        self, slots: _Pair, rows: _Pair, dtype: torch.dtype, n: int, op: RedOpType
    ) -> _Tiny | None:
        """The numpy form of a small one-shot round (``host_arrays``), or None."""
        nbytes = n * dtype.itemsize
        if nbytes > host_arrays.MAX_BYTES or host_arrays.numpy_dtype(dtype) is None:
            return None
        if op is RedOpType.PREMUL_SUM:
            return None
        ufunc = host_arrays.ufunc_for(dtype, op, nbytes)
        seg = host_arrays.segment_array
        np_slots = (seg(slots[0]), seg(slots[1]))
        if self.size == 2:
            np_rows: tuple[Any, Any] = tuple(  # type: ignore[assignment]
                [seg(r[0]), seg(r[1])] for r in rows
            )
        else:
            np_rows = (seg(rows[0]), seg(rows[1]))
        return np_slots, np_rows, ufunc, host_arrays.UserArrays(dtype, n)

    def bcast_plan(self, dtype: torch.dtype, n: int, root: int) -> BcastPlan:
        """Views and fingerprint of a broadcast of this shape (it must fit one slot)."""
        chan = self.chan
        slots = (chan.slot(root, 0, dtype, n), chan.slot(root, 1, dtype, n))
        tiny = None
        if n * dtype.itemsize <= host_arrays.MAX_BYTES and host_arrays.numpy_dtype(dtype):
            seg = host_arrays.segment_array
            tiny = (seg(slots[0]), seg(slots[1])), host_arrays.UserArrays(dtype, n)
        plan = (F.make(F.BROADCAST, dtype, n, root), slots, tiny)
        return _kept(self.bcast_plans, (dtype, n, root), plan)

    def copy_plan(self, kind: int, dtype: torch.dtype, n: int) -> CopyPlan | None:
        """Views and fingerprint of an all_gather (``kind`` ``F.ALL_GATHER``) or uniform
        all_to_all (``F.ALL_TO_ALL``) moving ``n`` elements to each peer (None: more than
        one round of numpy copies), made once per shape."""
        key = (kind, dtype, n)
        kept = self.copy_plans.get(key, _NOT_KEPT)  # one lookup: this runs on every op
        if kept is not _NOT_KEPT:
            return kept
        chan = self.chan
        nbytes = n * dtype.itemsize
        sent = nbytes if kind == F.ALL_GATHER else nbytes * self.size
        plan: CopyPlan | None = None
        if sent <= host_arrays.MAX_BYTES and sent <= chan.slot_capacity(torch.uint8):
            seg = host_arrays.segment_array
            me, u8 = self.rank, torch.uint8
            at = 0 if kind == F.ALL_GATHER else me * nbytes
            plan = (
                F.make(kind, dtype, n),
                (seg(chan.slot(me, 0, u8, sent)), seg(chan.slot(me, 1, u8, sent))),
                (seg(chan.rows(0, u8, nbytes, at)), seg(chan.rows(1, u8, nbytes, at))),
                host_arrays.UserArrays(u8, sent),
                host_arrays.UserArrays(u8, nbytes * self.size),
            )
        return _kept(self.copy_plans, key, plan)

    def rs_plan(self, dtype: torch.dtype, n: int, op: ReduceOp) -> RsPlan | None:
        """Views and fingerprint of a one-round reduce_scatter of ``n`` elements per rank
        (None: too large, or PREMUL_SUM, whose pre-multiplication the slot path does), made
        once per shape."""
        key = (dtype, n, op._type._value_)
        kept = self.rs_plans.get(key, _NOT_KEPT)
        if kept is not _NOT_KEPT:
            return kept
        chan = self.chan
        size, me, es = self.size, self.rank, dtype.itemsize
        sent = size * n * es
        t = op.type
        plan: RsPlan | None = None
        one_round = sent <= host_arrays.MAX_BYTES and sent <= chan.layout.slot_bytes
        if one_round and t is not RedOpType.PREMUL_SUM:
            stride = chan.layout.slot_bytes // es
            offset = chan.layout.slot_offset
            own = (
                chan.view(offset(0, me), dtype, (size, n), (n, 1)),
                chan.view(offset(1, me), dtype, (size, n), (n, 1)),
            )
            cols = (
                chan.view(offset(0, 0) + me * n * es, dtype, (size, n), (stride, 1)),
                chan.view(offset(1, 0) + me * n * es, dtype, (size, n), (stride, 1)),
            )
            tiny: _RsTiny | None = None
            ufunc = host_arrays.ufunc_for(dtype, t, sent)
            if ufunc is not None:
                seg = host_arrays.segment_array
                tiny = (
                    ufunc,
                    (
                        seg(chan.slot(me, 0, dtype, size * n)),
                        seg(chan.slot(me, 1, dtype, size * n)),
                    ),
                    (seg(cols[0]), seg(cols[1])),
                    host_arrays.UserArrays(dtype, size * n),
                    host_arrays.UserArrays(dtype, n),
                )
            pairs = None
            if size == 2 and t is RedOpType.SUM and dtype is not torch.bool:
                pairs = ((cols[0][0], cols[0][1]), (cols[1][0], cols[1][1]))
            plan = (F.make(F.REDUCE_SCATTER, dtype, n, -1, op), own, cols, tiny, pairs)
        return _kept(self.rs_plans, key, plan)

    def reduce_fp(self, dtype: torch.dtype, n: int, root: int, op: ReduceOp) -> Fingerprint:
        key = (dtype, n, root, op._type._value_)
        fp = self._reduce_fps.get(key)
        if fp is None or op._type is RedOpType.PREMUL_SUM:  # its factor is part of it
            fp = F.make(F.REDUCE, dtype, n, root, op)
            _kept(self._reduce_fps, key, fp)
        return fp

    # -- rounds --------------------------------------------------------------------------------
    def run(
        self,
        flat: torch.Tensor,
        op: ReduceOp,
        plan: Plan | bool,
        deadline: Deadline,
        whole_fp: Fingerprint | None = None,
        root: int = -1,
    ) -> None:
        """One all_reduce round, or with ``root`` a reduce round (only the root reduces).

        The caller advanced ``op_seq``.  ``whole_fp``: the fingerprint of the whole op when
        ``flat`` is one chunk of it, or the reduce's.
        """
        assert plan is not False and plan is not True
        fp, slots, rows, premul, plain_sum, tiny, pairs = plan
        if whole_fp is not None:
            fp = whole_fp
        chan = self.chan
        k = chan.begin(deadline)
        p = k & 1
        if tiny is not None:
            mine = tiny[3].of(flat)
            tiny[0][p][...] = mine
        elif premul:
            torch.mul(flat, op.factor_value(), out=slots[p])
        else:
            slots[p].copy_(flat)
        self._meet(k, p, fp, deadline, "all_reduce" if root < 0 else "reduce")
        if root < 0 or root == self.rank:
            if tiny is not None and tiny[2] is not None:
                parts = tiny[1][p]
                if type(parts) is list:
                    tiny[2](parts[0], parts[1], out=mine)
                else:
                    tiny[2].reduce(parts, 0, out=mine)
                host_arrays.mark_written((flat,))
            elif pairs is not None:
                torch.add(pairs[p][0], pairs[p][1], out=flat)
            elif plain_sum:
                torch.sum(rows[p], 0, dtype=flat.dtype, out=flat)
            else:
                reduce_rows(rows[p], flat, op)
        chan.finish(k)

    def broadcast(self, flat: torch.Tensor, root: int, plan: BcastPlan, deadline: Deadline) -> None:
        """A broadcast that fits one slot: the root writes, every rank checks, others read."""
        fp, slots, tiny = plan
        chan = self.chan
        chan.op_seq += 1
        k = chan.begin(deadline)
        p = k & 1
        is_root = self.rank == root
        if is_root:
            if tiny is not None:
                tiny[0][p][...] = tiny[1].of(flat)
            else:
                slots[p].copy_(flat)
        self._meet(k, p, fp, deadline, "broadcast")
        if not is_root:
            if tiny is not None:
                tiny[1].of(flat)[...] = tiny[0][p]
                host_arrays.mark_written((flat,))
            else:
                flat.copy_(slots[p])
        chan.finish(k)

    def copy_round(
        self, out: torch.Tensor, inp: torch.Tensor, plan: CopyPlan, deadline: Deadline, what: str
    ) -> None:
        """One round: row r of ``out`` (contiguous, ``size`` rows) gets rank r's ``inp``
        (all_gather) or its part of it for this rank (all_to_all).  ``inp`` may be ``out``
        or a row of it: every rank's input is in the slots before anyone writes."""
        fp, slots, rows, ins, outs = plan
        chan = self.chan
        chan.op_seq += 1
        k = chan.begin(deadline)
        p = k & 1
        slots[p][...] = ins.of(inp)
        self._meet(k, p, fp, deadline, what)
        outs.of(out).reshape(self.size, -1)[...] = rows[p]
        host_arrays.mark_written((out,))
        chan.finish(k)

    def reduce_scatter(
        self,
        out: torch.Tensor,
        inputs: torch.Tensor,
        op: ReduceOp,
        plan: RsPlan,
        deadline: Deadline,
    ) -> None:
        """One round: ``out`` (``n``) gets the reduction of every rank's row ``rank`` of
        ``inputs`` (``[size, n]``, contiguous)."""
        fp, own, cols, tiny, pairs = plan
        chan = self.chan
        chan.op_seq += 1
        k = chan.begin(deadline)
        p = k & 1
        if tiny is not None:
            tiny[1][p][...] = tiny[3].of(inputs)
        else:
            own[p].copy_(inputs)
        self._meet(k, p, fp, deadline, "reduce_scatter")
        if tiny is not None:
            tiny[0].reduce(tiny[2][p], 0, out=tiny[4].of(out))
            host_arrays.mark_written((out,))
        elif pairs is not None:
            torch.add(pairs[p][0], pairs[p][1], out=out)
        else:
            reduce_rows(cols[p], out, op)
        chan.finish(k)

    def barrier(self, deadline: Deadline) -> None:
        """A round that moves nothing; it carries the barrier's fingerprint."""
        chan = self.chan
        chan.op_seq += 1
        k = chan.begin(deadline)
        self._meet(k, k & 1, self._barrier_fp, deadline, "barrier")
        chan.finish(k)

    def _meet(self, k: int, p: int, fp: Fingerprint, deadline: Deadline, what: str) -> None:
        """Publish round ``k`` (with the fingerprint's checked word), wait for every rank,
        check theirs: ``ShmChannel.exchange`` with fast checks inlined."""
        chan = self.chan
        flags = chan.flags
        check = self.check
        if check:
            want = fp[0] + chan.op_seq  # fingerprint.checked_word, inlined
            if chan.meta_fp[p] is fp:
                flags[chan.my_word[p]] = want
            else:
                chan.write_fingerprint(p, fp)
        flags[chan.pub_index] = k
        chan.ring()
        for i in chan.all_pub:
            if flags[i] < k:
                checks = self.tight_checks
                while checks and flags[i] < k:
                    checks -= 1
                if flags[i] < k:
                    chan.wait_all(k, deadline)
                    break
        if check:
            for i in chan.peer_word[p]:
                if flags[i] != want:
                    chan.check_fingerprints(k, fp, what)
                    break
