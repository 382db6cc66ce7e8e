"""``cpu.tcp.census``: who never entered a timed-out collective, asked over the members'
liveness listeners.

Real ``Liveness`` objects (their watcher threads and listeners, in this process) over a
counting in-process store: running ops cost the store nothing; a census from any rank
names the members behind, a member whose listener holds connections in silence (what a
stopped process's kernel does) and, when rank 0 itself is silent, still the rest; ranks
whose port refuses (they left) are not named, their subtrees still asked; and the tree's
shape. The multi-process paths (a SIGSTOPped rank, a rank that never calls the op)
are in ``tests/chaos/test_faults.py`` and ``tests/test_shm_hier.py``.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from torchcomms.backends.cpu.tcp import census
from torchcomms.backends.cpu.tcp.liveness import Liveness
from torchcomms.backends.cpu.tcp.waits import TcpWaiter
from torchcomms.ranks import decode_ranks, encode_ranks
from torchcomms.runtime import store_counts

PERIOD_S = 0.02


@contextmanager
def _members(
    size: int, silent: set[int], gone: frozenset[int] = frozenset()
) -> Iterator[dict[int, Liveness]]:
    """A ``Liveness`` per rank not ``silent`` or ``gone``; a silent rank's address is a
    listener that accepts and never reads (as a stopped process's would), a gone rank's a
    port nobody listens on (as an exited process's)."""
    store = store_counts.CountingStore(dist.HashStore())
    peers = [("host-a", os.getpid())] * size
    made: dict[int, Liveness] = {}
    mute: list[socket.socket] = []
    try:
        for r in range(size):
            if r in silent:
                sock = socket.create_server(("127.0.0.1", 0))
                store.set(f"addr/{r}", f"127.0.0.1:{sock.getsockname()[1]}")
                mute.append(sock)
            elif r in gone:
                # Bound, never listening: connecting is refused, and no listener made later
                # in this process can take the port over (a closed port could be reused).
                sock = socket.socket()
                sock.bind(("127.0.0.1", 0))
                store.set(f"addr/{r}", f"127.0.0.1:{sock.getsockname()[1]}")
                mute.append(sock)
            else:
                made[r] = Liveness(store, r, peers, f"census{r}", PERIOD_S)
        yield made
    finally:
        for lv in made.values():
            lv.close()
        for sock in mute:
            sock.close()


def test_running_ops_cost_the_store_nothing() -> None:
    with _members(4, set()) as made:
        before = store_counts.snapshot()
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            for lv in made.values():
                lv.seq += 1
            time.sleep(0.001)
        spent = store_counts.diff(store_counts.snapshot(), before)
    assert spent == {}, spent


def test_a_census_names_the_behind_and_the_silent_from_every_asker() -> None:
    size = 8
    with _members(size, {6}) as made:
        for r, lv in made.items():
            lv.seq = 4 if r == 3 else 5  # rank 3 never entered collective 5
        for asker in (5, 0, 7):
            start = time.monotonic()
            missing = made[asker].missing(5)
            took = time.monotonic() - start
            assert missing == [3, 6], (asker, made[asker].verdict)
            verdict = made[asker].verdict
            assert verdict.behind == {3} and verdict.silent == {6}, (asker, verdict)
            assert verdict.unknown == set(), (asker, verdict)
            assert took < census.BUDGET_S + 0.5, (asker, took)
            assert made[asker].missing(5, [1, 3]) == [3]  # restricted to some ranks


def test_a_silent_rank_0_is_named_and_the_rest_still_asked() -> None:
    with _members(6, {0}) as made:
        for r, lv in made.items():
            lv.seq = 2 if r == 4 else 3
        for asker in (1, 5):
            assert made[asker].missing(3) == [0, 4], made[asker].verdict
            assert made[asker].verdict.silent == {0}


def test_a_gone_rank_is_not_named_and_its_subtree_still_asked() -> None:
    """Ranks that left after their own timeout (the default ends the process) refuse: the
    census asks past them and names only who never entered."""
    with _members(8, {7}, frozenset({0, 4})) as made:
        for lv in made.values():
            lv.seq = 3
        for asker in (5, 6, 1):
            assert made[asker].missing(3) == [7], made[asker].verdict
            assert made[asker].verdict.gone == {0, 4}, made[asker].verdict


def test_a_timed_out_wait_names_the_behind_and_the_silent_and_says_who_left() -> None:
    """What a tcp op's timeout says (``TcpWaiter``): the census's missing ranks, which of
    them did not answer, and the gone apart, not named."""
    with _members(8, {6}, frozenset({4})) as made:
        for r, lv in made.items():
            lv.seq = 2 if r == 3 else 3
        waiter = TcpWaiter(5, lambda: [], made[5], lambda: 3)
        error = waiter._timed_out("all_reduce", None)
        assert (error.kind, sorted(error.ranks)) == ("timeout", [3, 6]), error
        assert str(error) == (
            "waiting for peer ranks 3, 6, which never entered all_reduce (collective #3 of "
            "this comm; peer rank 6 did not answer: stopped or cut off; peer rank 4 left or "
            "died meanwhile)"
        ), str(error)


def test_everyone_entered_names_nobody() -> None:
    with _members(5, set()) as made:
        for lv in made.values():
            lv.seq = 9
        assert made[2].missing(9) == []
        assert made[0].missing(8) == []  # past it: entered it too


def test_the_tree_and_the_rank_ranges() -> None:
    assert census.children(0, 8) == [1, 2, 4]
    assert census.children(4, 8) == [5, 6]
    assert census.children(4, 6) == [5]
    assert census.children(5, 8) == []
    assert [census.parent(r) for r in (1, 2, 3, 6, 7, 12)] == [0, 0, 2, 4, 6, 8]
    assert census.subtree_span(0, 5) == 5 and census.subtree_span(4, 5) == 1
    # Every rank is in exactly one child's subtree below its parent.
    for size in (1, 2, 3, 7, 8, 13, 64):
        seen = [0]
        pending = [0]
        while pending:
            r = pending.pop()
            for c in census.children(r, size):
                assert census.parent(c) == r
                seen.append(c)
                pending.append(c)
        assert sorted(seen) == list(range(size)), size
    assert encode_ranks([9, 1, 2, 3, 4, 7]) == "1-4,7,9"
    assert decode_ranks("1-4,7,9") == {1, 2, 3, 4, 7, 9}
    verdict = census.Verdict({1}, {2, 3}, set(), {5})
    assert census.Verdict.decode(verdict.encode()) == verdict
    assert census.hop_s(100_000) * 4 * 17 <= 0.8 * census.BUDGET_S
