"""Copies through the slots, a slot per round: broadcast, all_gather and uniform all_to_all.

The path large copies take where the single copy (``cpu.shm.single_copy``) does not run: it is
off or not permitted, or the op is below its sizes.  all_gather and all_to_all pass only the
peers' parts through the slots; a rank's own part is copied once, straight, while the peers
fill their slots.  The round protocol is the channel's (``transport.shm.channel``); every
function runs on the op's thread and is handed the op's fingerprint for its first round (the
caller made it and advanced ``op_seq``).
"""

from __future__ import annotations

import torch

from torchcomms.backends.cpu.staging import overlaps
from torchcomms.runtime.deadline import Deadline
from torchcomms.runtime.fingerprint import Fingerprint
from torchcomms.transport.shm.channel import ShmChannel


def broadcast(
    chan: ShmChannel, flat: torch.Tensor, root: int, fp: Fingerprint | None, deadline: Deadline
) -> None:
    """broadcast through the root's slot, a slot per round (the root runs up to two
    rounds ahead of its peers)."""
    n = flat.numel()
    dtype = flat.dtype
    cap = chan.slot_capacity(dtype)
    for start in range(0, n, cap):
        c = min(cap, n - start)
        if start == 0:  # every rank publishes and checks every fingerprint
            k = chan.begin(deadline)
            if chan.rank == root:
                chan.slot(root, k, dtype, c).copy_(flat[:c])
            chan.exchange(k, deadline, fp, "broadcast")
            if chan.rank != root:
                flat[:c].copy_(chan.slot(root, k, dtype, c))
        elif chan.rank == root:
            k = chan.begin(deadline)
            chan.slot(root, k, dtype, c).copy_(flat[start : start + c])
            chan.publish(k)
        else:
            k = chan.next_round()
            chan.wait_rank(k, root, deadline)
            flat[start : start + c].copy_(chan.slot(root, k, dtype, c))
        chan.finish(k)


def all_gather(
    chan: ShmChannel,
    out: torch.Tensor,
    inp: torch.Tensor,
    fp: Fingerprint | None,
    deadline: Deadline,
) -> None:
    """all_gather through the slots, a slot of each rank's input per round."""
    n = inp.numel()
    dtype = inp.dtype
    me = chan.rank
    row = out[me]
    own = None if row.data_ptr() == inp.data_ptr() else row  # in place: the row is there
    if own is not None and overlaps(inp, out):
        inp = inp.clone()  # another row of ``out``: a peer's row will land on it
    cap = chan.slot_capacity(dtype)
    for start in range(0, n, cap):
        c = min(cap, n - start)
        k = chan.begin(deadline)
        chan.slot(me, k, dtype, c).copy_(inp[start : start + c])
        chan.publish(k, fp if start == 0 else None)
        if own is not None and start == 0:  # while the peers fill their slots
            own.copy_(inp)
        chan.wait_all(k, deadline, fp if start == 0 else None, "all_gather")
        # Only the peers' rows (before and after this rank's): one strided copy each.
        rows = chan.rows(k, dtype, c)
        if me > 0:
            out[:me, start : start + c].copy_(rows[:me])
        if me + 1 < chan.size:
            out[me + 1 :, start : start + c].copy_(rows[me + 1 :])
        chan.finish(k)


def all_to_all(
    chan: ShmChannel,
    out: torch.Tensor,
    inp: torch.Tensor,
    n: int,
    fp: Fingerprint | None,
    deadline: Deadline,
) -> None:
    """``n`` elements from every rank to every rank, through the slots.

    A rank's slot holds one region per peer (its own chunk never passes through a slot:
    it is copied once, while the peers fill their slots): region ``d`` for a peer
    ``d`` below this rank, ``d - 1`` above it.  So the chunks for the peers below and
    above this rank are one strided copy each, in and out."""
    size, me = chan.size, chan.rank
    dtype = inp.dtype
    item = dtype.itemsize
    per = max(chan.slot_capacity(dtype) // (size - 1), 1)
    stride = chan.layout.slot_bytes // item
    in_place = inp.data_ptr() == out.data_ptr()  # safe: a round reads its columns first
    if not in_place and overlaps(inp, out):
        inp = inp.clone()  # the chunks this rank sends must survive its writes
    src2d, dst2d = inp.view(size, n), out.view(size, n)
    for start in range(0, n, per):
        c = min(per, n - start)
        k = chan.begin(deadline)
        mine = chan.layout.slot_offset(k & 1, me)
        if me > 0:  # regions 0 .. me-1: peers 0 .. me-1
            chan.view(mine, dtype, (me, c), (per, 1)).copy_(src2d[:me, start : start + c])
        if me + 1 < size:  # regions me .. size-2: peers me+1 .. size-1
            chan.view(mine + me * per * item, dtype, (size - 1 - me, c), (per, 1)).copy_(
                src2d[me + 1 :, start : start + c]
            )
        chan.publish(k, fp if start == 0 else None)
        if start == 0 and not in_place:
            dst2d[me].copy_(src2d[me])
        chan.wait_all(k, deadline, fp if start == 0 else None, "all_to_all")
        first = chan.layout.slot_offset(k & 1, 0)
        if me > 0:  # peers below hold this rank's chunk in region me - 1
            at = first + (me - 1) * per * item
            dst2d[:me, start : start + c].copy_(chan.view(at, dtype, (me, c), (stride, 1)))
        if me + 1 < size:  # peers above hold it in region me
            at = first + ((me + 1) * stride + me * per) * item
            dst2d[me + 1 :, start : start + c].copy_(
                chan.view(at, dtype, (size - 1 - me, c), (stride, 1))
            )
        chan.finish(k)
