"""Meeting through host leaders (``backends/cpu/leaders.py``) over a real TCPStore, each
member on a thread of this process with a host identity of its own choosing: every
member learns the same placement whatever the order of arrival, a host's pid list holds
its members' pids in rank order, and a member that never comes is named by every rank
that waited for it (rank 0 itself, and the others through rank 0's verdict).  The
threads share one process, so each says it has a pid of its own (``PID0 + rank``)."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from torchcomms.backends.cpu import connect, leaders
from torchcomms.backends.cpu.members import Members, host_pids_key
from torchcomms.deadline import Deadline
from torchcomms.errors import CommTimeoutError

#: The pid rank r says it has: PID0 + r (the threads share one process).
PID0 = 4_000_000


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30))


def _meet(hosts: list[str], timeout_s: float = 20.0, absent: int | None = None) -> list[Any]:
    """Every rank but ``absent`` runs the identity exchange on a thread, rank r on host
    ``hosts[r]``; returns each rank's ``Members`` (or the error it raised) and the store."""
    server = _store()
    size = len(hosts)
    out: list[Any] = [None] * size

    def run(rank: int) -> None:
        client = dist.TCPStore("127.0.0.1", server.port, None, False, timeout=timedelta(seconds=30))
        try:
            deadline = Deadline(timedelta(seconds=timeout_s))
            out[rank] = leaders.exchange_identities(
                client, rank, size, hosts[rank], deadline, "", pid=PID0 + rank
            )
        except Exception as exc:  # reported to the test
            out[rank] = exc

    # Start the highest ranks first: rank 0 is not the first to arrive.
    threads = [threading.Thread(target=run, args=(r,)) for r in reversed(range(size))]
    for r, t in zip(reversed(range(size)), threads, strict=True):
        if r != absent:
            t.start()
    for r, t in zip(reversed(range(size)), threads, strict=True):
        if r != absent:
            t.join(60.0)
    return [*out, server]


@pytest.mark.parametrize(
    "hosts",
    [
        ["a", "a", "b", "b", "c", "c", "d", "d"],  # blocked, as torchrun places ranks
        ["a", "b", "c", "a", "b", "c", "a"],  # round-robin
        ["a", "a", "b", "a", "c", "c", "b"],  # irregular
        ["a"] * 6,  # one host
        ["a", "b", "c", "d", "e"],  # a rank per host
    ],
)
def test_every_member_learns_the_same_placement(hosts: list[str]) -> None:
    *got, store = _meet(hosts)
    index: dict[str, int] = {}
    expected = [index.setdefault(h, len(index)) for h in hosts]
    for rank, members in enumerate(got):
        assert isinstance(members, Members), (rank, members)
        assert [members.host(r) for r in range(len(hosts))] == expected, (rank, members)
        assert members.rank == rank and members.host_tag == leaders.host_tag(hosts[rank])
    # A host of several members has its pids in rank order, written by its leader.
    for host in set(hosts):
        ranks = [r for r, h in enumerate(hosts) if h == host]
        key = host_pids_key(leaders.host_tag(host))
        if len(ranks) > 1:
            assert json.loads(store.get(key)) == [PID0 + r for r in ranks], host
        else:
            assert not store.check([key]), host
    # Each member knows its own pid, and rank 0's where they share a host; rank 0 knows
    # its host's (it wrote their list).
    for rank, members in enumerate(got):
        shared = hosts[rank] == hosts[0]
        assert members.pids.get(0) == (PID0 if shared else None), (rank, members.pids)
        assert members.pids[rank] == PID0 + rank
    here = [r for r, h in enumerate(hosts) if h == hosts[0]]
    assert got[0].pids == {r: PID0 + r for r in here}, got[0].pids


def test_a_member_that_never_comes_is_named_by_everyone() -> None:
    *got, _ = _meet(["a", "a", "b", "b"], timeout_s=1.0, absent=3)
    for rank in (0, 1, 2):
        assert isinstance(got[rank], CommTimeoutError), (rank, got[rank])
        assert got[rank].ranks == (3,), (rank, got[rank])
    assert "peer rank 3 never arrived" in str(got[0])
    assert "peer rank 3 never finished the identity exchange (rank 0 says)" in str(got[1])


@pytest.mark.parametrize("size", [2, 64, 2_500, 10_000, 100_000])
def test_members_waiting_for_rank_0_poll_the_store_within_its_means(size: int) -> None:
    """Every member waits for rank 0's verdict: however many, their polls together stay
    under 50,000 a second (one store serves about 70,000 round trips a second here), and
    a small comm still polls every 50 ms at the most."""
    longest = connect.poll_pause_max_s(1, size)
    assert size / longest <= 50_000
    assert longest == (0.05 if size <= 2_500 else size * 2e-5)
