"""Who a CPU communicator's members are, as far as this rank needs to know: O(1) bytes each.

The identity exchange (``cpu.hier.leaders``) meets through host leaders; rank 0 reads one
summary per host and gives the members one *bundle* instead of the whole list: where
ranks sit on hosts in closed form (``Placement``: ``blocked L`` or ``cyclic H``, as
launchers place them; an irregular placement as runs of host indices, O(hosts)), and
rank 0's pid.  So a member reads O(1) bytes whatever the world size.  The pids of a
member's own host (what local death detection watches) come separately, where they are
needed:

* every member on one host (shm): from the shared segment, where rank 0 writes them
  (``transport.shm.layout.pid_words``): no store bytes but rank 0's;
* otherwise (tcp, hierarchical): ``host/pids/<host>``, this host's pids only (O(ranks per
  host)), which its leader writes.

Host identities never travel back: hosts are numbered in order of their lowest rank, and
``peers()`` renders them as ``host{h}``.  Runs on the thread that creates the communicator.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Placement:
    """Which host each comm rank is on: ``blocked`` (host = rank // L), ``cyclic``
    (host = rank % H) or ``runs`` (``[[host, count], ...]`` in rank order)."""

    kind: str
    arg: int | tuple[tuple[int, int], ...]

    @staticmethod
    def of(hosts: Sequence[int]) -> Placement:
        """The most compact description of ``hosts[r]`` (host indices by first appearance)."""
        size = len(hosts)
        count = max(hosts) + 1
        block = next((r for r, h in enumerate(hosts) if h != 0), size)
        if all(h == r // block for r, h in enumerate(hosts)):
            return Placement("blocked", block)
        if all(h == r % count for r, h in enumerate(hosts)):
            return Placement("cyclic", count)
        runs: list[list[int]] = []
        for h in hosts:
            if runs and runs[-1][0] == h:
                runs[-1][1] += 1
            else:
                runs.append([h, 1])
        return Placement("runs", tuple((h, n) for h, n in runs))

    def hosts(self, size: int) -> list[int]:
        """Host index of every rank (in memory only: O(N) here, never through the store)."""
        if self.kind == "blocked":
            assert isinstance(self.arg, int)
            return [r // self.arg for r in range(size)]
        if self.kind == "cyclic":
            assert isinstance(self.arg, int)
            return [r % self.arg for r in range(size)]
        assert isinstance(self.arg, tuple)
        out: list[int] = []
        for h, n in self.arg:
            out.extend([h] * n)
        if len(out) != size:
            raise ValueError(f"placement runs cover {len(out)} ranks, expected {size}")
        return out

    def encode(self) -> list[object]:
        return [self.kind, self.arg if isinstance(self.arg, int) else [list(x) for x in self.arg]]

    @staticmethod
    def decode(value: Sequence[object]) -> Placement:
        kind, arg = value
        if kind in ("blocked", "cyclic"):
            assert isinstance(arg, int)
            return Placement(str(kind), arg)
        assert isinstance(arg, list)
        return Placement("runs", tuple((int(h), int(n)) for h, n in arg))


@dataclass
class Members:
    """This rank's view of the members: every rank's host, and the pids it may watch.

    ``pids`` holds what this rank knows: its own, rank 0's, and (once learnt) those of its
    host's members; rank 0 knows every member's.  A pid of 0 in ``peers()`` means unknown
    (a member on another host: its death comes from the transport, never from a pid).
    """

    rank: int
    size: int
    placement: Placement
    pids: dict[int, int] = field(default_factory=dict)
    #: This rank's host, as a store key's part (``cpu.hier.leaders.host_tag``).
    host_tag: str = ""

    def __post_init__(self) -> None:
        self._hosts = self.placement.hosts(self.size)

    @property
    def host_count(self) -> int:
        return max(self._hosts) + 1

    def host(self, rank: int) -> int:
        return self._hosts[rank]

    @property
    def all_local(self) -> bool:
        """Every member on this rank's host."""
        return self.host_count == 1

    def local_ranks(self) -> list[int]:
        """The comm ranks on this rank's host, in rank order (this rank included)."""
        me = self._hosts[self.rank]
        return [r for r, h in enumerate(self._hosts) if h == me]

    def leaders(self) -> list[tuple[int, int]]:
        """``(lowest rank, members)`` of each host, in host order: its leader at a
        rendezvous (``cpu.hier.leaders``)."""
        first: dict[int, int] = {}
        count: dict[int, int] = {}
        for r, h in enumerate(self._hosts):
            first.setdefault(h, r)
            count[h] = count.get(h, 0) + 1
        return sorted((first[h], count[h]) for h in first)

    def local_pids_known(self) -> bool:
        return all(r in self.pids for r in self.local_ranks())

    def learn(self, ranks: Sequence[int], pids: Sequence[int]) -> None:
        """Record the pids of ``ranks`` (this host's members, from the segment or the store)."""
        self.pids.update(zip(ranks, pids, strict=True))

    def peers(self) -> list[tuple[str, int]]:
        """``(host, pid)`` per comm rank, hosts as ``host{h}``, unknown pids as 0."""
        return [(f"host{h}", self.pids.get(r, 0)) for r, h in enumerate(self._hosts)]


def host_pids_key(host_tag: str) -> str:
    """Where a host's leader writes the pids of its members (hosts of several members)."""
    return f"host/pids/{host_tag}"


def from_bundle(rank: int, size: int, bundle: str, pid: int, host_tag: str = "") -> Members:
    """A member's ``Members`` from rank 0's bundle (``cpu.hier.leaders``)."""
    value = json.loads(bundle)
    members = Members(rank, size, Placement.decode(value["at"]), {rank: pid}, host_tag)
    if members.host(0) == members.host(rank):
        members.pids[0] = int(value["p0"])
    return members
