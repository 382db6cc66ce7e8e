"""Meeting through host leaders (``backends/cpu/hier/leaders.py``) over a real TCPStore, each
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

from torchcomms.backends.cpu import connect
from torchcomms.backends.cpu.hier import leaders
from torchcomms.backends.cpu.hier.members import Members, host_pids_key
from torchcomms.errors import CommError, CommTimeoutError
from torchcomms.runtime.deadline import Deadline

#: The pid rank r says it has: PID0 + r (the threads share one process).
PID0 = 4_000_000


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30))


class _Stalling(dist.Store):
    """A member's store that stops it (the thread blocks, as a SIGSTOPped process would)
    right before it writes or adds to a key holding ``trigger``; ``stalled`` says whether
    it did.  The test releases it with ``release``."""

    def __init__(self, inner: dist.Store, trigger: str) -> None:
        super().__init__()
        self.inner, self.trigger = inner, trigger
        self.stalled = False
        self.release = threading.Event()

    def _stop_at(self, keys: list[str]) -> None:
        if any(self.trigger in k for k in keys):
            self.stalled = True
            self.release.wait(60.0)
            raise RuntimeError("stalled member released")

    def set(self, key: str, value: Any) -> None:
        self._stop_at([key])
        self.inner.set(key, value)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._stop_at(keys)
        self.inner.multi_set(keys, values)

    def add(self, key: str, value: int) -> int:
        if value:
            self._stop_at([key])
        return int(self.inner.add(key, value))

    def get(self, key: str) -> Any:
        return self.inner.get(key)

    def multi_get(self, keys: list[str]) -> Any:
        return self.inner.multi_get(keys)

    def check(self, keys: list[str]) -> bool:
        return bool(self.inner.check(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)


def _meet(
    hosts: list[str],
    timeout_s: float = 20.0,
    absent: int | None = None,
    stall: str | None = None,
) -> list[Any]:
    """Every rank but ``absent`` runs the identity exchange on a thread, rank r on host
    ``hosts[r]``; returns each rank's ``Members`` (or the error it raised; a rank that
    ``stall`` stopped: None) and the store.  ``stall``: a key part at which members but
    rank 0 stop (``_Stalling``)."""
    server = _store()
    size = len(hosts)
    out: list[Any] = [None] * size
    stalling: list[_Stalling] = []

    def run(rank: int) -> None:
        client: Any = dist.TCPStore(
            "127.0.0.1", server.port, None, False, timeout=timedelta(seconds=30)
        )
        if stall is not None and rank != 0:
            client = _Stalling(client, stall)
            stalling.append(client)
        try:
            deadline = Deadline(timedelta(seconds=timeout_s))
            out[rank] = leaders.exchange_identities(
                client, rank, size, hosts[rank], deadline, "", pid=PID0 + rank
            )
        except Exception as exc:  # reported to the test
            out[rank] = None if getattr(client, "stalled", False) else exc

    # Start the highest ranks first: rank 0 is not the first to arrive.
    threads = [threading.Thread(target=run, args=(r,)) for r in reversed(range(size))]
    for r, t in zip(reversed(range(size)), threads, strict=True):
        if r != absent:
            t.start()
    for r, t in zip(reversed(range(size)), threads, strict=True):
        if r != absent and r == 0:
            t.join(60.0)  # rank 0 decides; then the stalled members may go
    for stalled in stalling:
        stalled.release.set()
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


def test_a_leader_that_stops_before_summarising_its_host_is_named_by_everyone() -> None:
    """Host b's first member (rank 1 or 2, whichever came first) stops right before it
    writes b's summary: rank 0 names it, and b's other member raises rank 0's verdict."""
    *got, _ = _meet(["a", "b", "b"], timeout_s=1.0, stall="host/s/")
    stopped = [r for r in (1, 2) if got[r] is None]
    assert len(stopped) == 1, got
    other = 3 - stopped[0]
    assert isinstance(got[0], CommTimeoutError) and got[0].ranks == tuple(stopped), got
    assert f"peer rank {stopped[0]} never arrived" in str(got[0]), got[0]
    assert isinstance(got[other], CommTimeoutError) and got[other].ranks == tuple(stopped)
    assert f"peer rank {stopped[0]} never finished the identity exchange" in str(got[other])


def test_a_member_that_stops_before_counting_itself_in_is_reported_as_such() -> None:
    """Every member but rank 0 stops right before it counts itself in: their entries are
    all there, so rank 0 cannot tell which is missing, and says that; the verdict the
    others would read says "a member"."""
    *got, store = _meet(["a", "a", "b"], timeout_s=1.0, stall="host/arrived")
    assert got[1] is None and got[2] is None, got
    assert isinstance(got[0], CommTimeoutError) and got[0].ranks == (), got
    assert "a member wrote its identity but never counted itself in" in str(got[0])
    verdict = store.get("host/all").decode()
    assert verdict == "timeout ", verdict
    error = connect.failure_from(verdict, "", "the identity exchange")
    assert str(error) == "a member never finished the identity exchange (rank 0 says)"


@pytest.mark.parametrize(
    ("texts", "said"),
    [
        (["0-2", "2-3"], "rank 2 was claimed twice in the identity exchange"),
        (["0-1", "3"], "rank 2 is on no host in the identity exchange"),
        (["0", "1-4"], "rank 4 is outside the comm (size 4)"),
    ],
)
def test_rank_0_refuses_hosts_that_do_not_cover_the_ranks_once(texts: list[str], said: str) -> None:
    with pytest.raises(CommError) as info:
        leaders._hosts_of(texts, 4, "")
    assert str(info.value) == said
