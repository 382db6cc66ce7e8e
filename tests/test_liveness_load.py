"""The liveness watcher's store load is bounded by comm size, and its failure-path read.

A real ``Liveness`` (its watcher thread) over a counting in-process store, its op
sequence number bumped every millisecond as a busy op loop would: a member publishes at
most once per publish period, which is the watch period for small comms and stretches
with the member count past ``PUBLISH_BUDGET_PER_S`` (the whole comm's publishes per
second).  Then ``missing``: the ranks whose published number is behind, read in one
``multi_get`` when every member published (each key apart otherwise).
"""

from __future__ import annotations

import os
import time

import torch.distributed as dist

from torchcomms import store_counts
from torchcomms.backends.cpu.tcp import liveness
from torchcomms.backends.cpu.tcp.liveness import Liveness, publish_period_s

PERIOD_S = 0.02
BUSY_S = 1.2


def _sets_while_busy(size: int) -> tuple[int, float]:
    peers = [("host-a", os.getpid())] * size  # all local and alive: nobody is dead
    lv = Liveness(store_counts.CountingStore(dist.HashStore()), 0, peers, "load", PERIOD_S)
    before = store_counts.snapshot()
    try:
        end = time.monotonic() + BUSY_S
        while time.monotonic() < end:
            lv.seq += 1
            time.sleep(0.001)
    finally:
        lv.close()
    sets = store_counts.diff(store_counts.snapshot(), before).get("liveness", 0)
    return sets, publish_period_s(size, PERIOD_S)


def test_publishes_per_member_are_bounded_by_the_period_stretched_at_scale() -> None:
    small_sets, small_period = _sets_while_busy(8)
    assert small_period == PERIOD_S
    # About one per period (the watcher's own wakeups may stretch it, never shrink it).
    assert 0.5 * BUSY_S / small_period <= small_sets <= BUSY_S / small_period + 1, small_sets
    size = int(liveness.PUBLISH_BUDGET_PER_S * 0.1)  # a period of 0.1 s
    big_sets, big_period = _sets_while_busy(size)
    assert big_period == size / liveness.PUBLISH_BUDGET_PER_S > PERIOD_S
    assert 1 <= big_sets <= BUSY_S / big_period + 1, big_sets
    # The comm as a whole stays within the budget (per second, while ops run).
    assert big_sets * size / BUSY_S <= liveness.PUBLISH_BUDGET_PER_S * 1.1


def test_missing_names_the_members_behind_with_one_read_when_all_published() -> None:
    peers = [("host-a", os.getpid())] * 4
    inner = dist.HashStore()
    lv = Liveness(store_counts.CountingStore(inner), 0, peers, "missing", PERIOD_S)
    try:
        for r, seq in ((1, 7), (2, 6), (3, 7)):
            inner.set(f"seq/{r}", str(seq))
        before = store_counts.snapshot()
        assert lv.missing(7) == [2]
        read = store_counts.diff(store_counts.snapshot(), before)
        assert read.get("multi_get") == 1 and "get" not in read, read
        inner.delete_key("seq/3")  # rank 3 never published: it entered nothing
        assert lv.missing(7) == [2, 3]
        assert lv.missing(7, [1, 3]) == [3]
    finally:
        lv.close()
