"""Hierarchical placement for the CPU backend: shm inside each host, gloo between hosts.

When a communicator's members span several hosts and at least one host holds more than
one of them, ``TorchCommGloo`` keeps its global ``ProcessGroupGloo`` for every op and
additionally builds a ``HierOps`` here for ``all_reduce``, ``broadcast`` and ``barrier``:

* **Hosts** are the distinct host identities of the members (``TorchCommGloo._peers``,
  overridable with ``TORCHCOMM_HOST_ID``), numbered in order of first appearance; a
  member's *local index* is its position among the members of its host (comm rank order).
* **Inside a host** (more than one member): one shm channel (``cpu_shm.connect`` under
  the store prefix ``hier/host{h}``) among the host's members, local index = shm rank.
* **Between hosts**: *cross group* ``i`` is a ``ProcessGroupGloo`` (store prefix
  ``hier/cross{i}``) among the members with local index ``i``, host order; group 0 (the
  *leaders*) always exists when there are several hosts, groups ``i > 0`` only when every
  host has the same number of members ``L`` (they serve the sharded algorithm).

``all_reduce`` picks one of two algorithms (the same on every rank):

* **leader** (up to ``hier_small_max`` bytes, hint or ``TORCHCOMM_HIER_SMALL_MAX_BYTES``,
  default 1 MiB, comm rank 0's value counts; always when hosts differ in size): shm reduce
  to local index 0, the leaders' gloo all_reduce, shm broadcast from local index 0;
* **sharded** (larger, equal hosts of ``L`` members): shm reduce-scatter inside the host
  (the flat tensor padded to a multiple of ``L``), gloo all_reduce of my shard within my
  cross group, shm all-gather of the shards: each member sends only ``1/L`` of the
  tensor between hosts, and the ``L`` cross groups reduce in parallel.

PREMUL_SUM is pre-multiplied exactly once (by the shm stage, or here on a single-member
host); gloo always sums.  AVG sums, then divides by the *global* size once.  Bool and
bitwise ops use shm's own reductions inside a host and the backend's gloo mapping
(passed in as ``c10d_op``) between hosts, so results equal the flat gloo path bit for
bit on integer-valued data.  Every wait is bounded by the op's absolute deadline
(``end``, ``time.monotonic()``); shm wait errors are re-raised naming comm ranks (not
host-local ones), gloo errors propagate unchanged (the backend's ``_translate`` types both).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch._C._distributed_c10d as c10d

from torchcomms import config
from torchcomms.backends import cpu_shm
from torchcomms.backends._host import finish_average, on_host
from torchcomms.transport.shm_channel import STATE_FAILED, STATE_FINALIZED, ShmWaitError
from torchcomms.types import RedOpType, ReduceOp

#: "peer rank 1", "ranks 0, 2" in shm wait errors (host-local ranks, renamed to comm ranks).
_RANKS_TEXT = re.compile(r"\b(peer )?ranks? (\d+(?:, \d+)*)")

#: ``(ReduceOp, dtype) -> c10d.ReduceOp`` for gloo (the CPU backend's ``_c10d_op``).
C10dOpFn = Callable[[ReduceOp, torch.dtype], Any]


@dataclass(frozen=True)
class Topology:
    """Where every member sits: ``hosts[h]`` lists the comm ranks on host ``h``."""

    hosts: tuple[tuple[int, ...], ...]
    host: int  # my host index
    local_rank: int  # my index among my host's members

    @property
    def local_size(self) -> int:
        return len(self.hosts[self.host])

    @property
    def even(self) -> bool:
        """Every host has the same number of members."""
        return len({len(h) for h in self.hosts}) == 1

    def cross_members(self, i: int) -> list[int]:
        """Comm ranks with local index ``i``, host order (one per host with > i members)."""
        return [h[i] for h in self.hosts if len(h) > i]

    def sizes_text(self) -> str:
        return "+".join(str(len(h)) for h in self.hosts)


def topology(peers: Sequence[tuple[str, int]], rank: int) -> Topology:
    """Group comm ranks by host identity, hosts in order of first appearance."""
    index: dict[str, int] = {}
    groups: list[list[int]] = []
    for r, (host, _pid) in enumerate(peers):
        h = index.setdefault(host, len(groups))
        if h == len(groups):
            groups.append([])
        groups[h].append(r)
    me = index[peers[rank][0]]
    return Topology(tuple(tuple(g) for g in groups), me, groups[me].index(rank))


def wanted(peers: Sequence[tuple[str, int]]) -> bool:
    """Several hosts, and at least one of them holds more than one member."""
    hosts = [host for host, _ in peers]
    distinct = set(hosts)
    return len(distinct) > 1 and len(distinct) < len(hosts)


def _left(end: float) -> timedelta:
    # gloo treats 0 as "no timeout"; never hand it a non-positive value.
    return timedelta(seconds=max(end - time.monotonic(), 0.001))


def connect(
    store: c10d.Store,
    rank: int,
    peers: Sequence[tuple[str, int]],
    hints: dict[str, str],
    timeout: timedelta,
    gloo_device: Any,
    gloo_desc: str,
    c10d_op: C10dOpFn,
    describe: str,
) -> HierOps:
    """Build my host's shm channel and my cross group (collective over all members)."""
    topo = topology(peers, rank)
    local: cpu_shm.ShmOps | None = None
    members = topo.hosts[topo.host]
    if len(members) > 1:
        local = cpu_shm.connect(
            c10d.PrefixStore(f"hier/host{topo.host}", store),
            topo.local_rank,
            len(members),
            [peers[r][1] for r in members],
            hints,
            timeout,
            f"{describe} host{topo.host}",
        )
    cross: Any = None
    cross_index = 0
    try:
        i = topo.local_rank
        group = topo.cross_members(i)
        if len(group) > 1 and (i == 0 or topo.even):
            opts = c10d.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            opts._timeout = timeout
            opts._devices = [gloo_device]
            cross_index = group.index(rank)
            cross = c10d.ProcessGroupGloo(
                c10d.PrefixStore(f"hier/cross{i}", store), cross_index, len(group), opts
            )
        # Every rank must pick the same algorithm: comm rank 0's switch size counts.
        small_max = config.hier_small_max(hints.get("hier_small_max"))
        if rank == 0:
            store.set("hier/small_max", str(small_max))
        store.wait(["hier/small_max"], timeout)
        small_max = int(store.get("hier/small_max").decode())
    except BaseException:
        if local is not None:
            local.close(STATE_FAILED)
        raise
    return HierOps(topo, len(peers), local, cross, cross_index, c10d_op, small_max, gloo_desc)


class HierOps:
    """``all_reduce`` / ``broadcast`` / ``barrier`` over shm inside hosts and gloo between."""

    def __init__(
        self,
        topo: Topology,
        size: int,
        local: cpu_shm.ShmOps | None,
        cross: Any,
        cross_index: int,
        c10d_op: C10dOpFn,
        small_max: int,
        gloo_desc: str,
    ) -> None:
        self.topo = topo
        self.size = size
        self.local = local
        self.cross = cross
        self.cross_index = cross_index
        self.small_max = small_max
        self._c10d_op = c10d_op
        self._gloo_desc = gloo_desc

    def describe(self) -> str:
        t = self.topo
        return (
            f"hierarchical: shm inside {len(t.hosts)} hosts ({t.sizes_text()} ranks), "
            f"tcp between ({self._gloo_desc}); all_reduce leader-based up to "
            f"{self.small_max} B{', sharded above' if t.even else ' (uneven hosts)'}"
        )

    def fail(self) -> None:
        """Tell my host's peers this rank failed, so they stop waiting for it."""
        if self.local is not None:
            self.local.chan.set_state(STATE_FAILED)

    def close(self, state: int = STATE_FINALIZED) -> None:
        local, self.local = self.local, None
        self.cross = None
        if local is not None:
            local.close(state)

    # -- helpers -------------------------------------------------------------------------
    def _shm(self, call: Callable[[], None]) -> None:
        """Run one shm step; wait errors name comm ranks instead of host-local ones."""
        try:
            call()
        except ShmWaitError as exc:
            members = self.topo.hosts[self.topo.host]

            def to_comm(m: re.Match[str]) -> str:
                ranks = [members[int(r)] for r in m.group(2).split(", ")]
                plural = "s" if len(ranks) > 1 else ""
                return f"{m.group(1) or ''}rank{plural} {', '.join(map(str, ranks))}"

            where = f"inside host {self.topo.host} of comm ranks {', '.join(map(str, members))}"
            raise ShmWaitError(
                exc.kind,
                [members[r] for r in exc.ranks],
                f"{_RANKS_TEXT.sub(to_comm, str(exc))} [{where}]",
            ) from exc

    def _gloo_all_reduce(self, flat: torch.Tensor, op: ReduceOp, end: float) -> None:
        o = c10d.AllreduceOptions()
        o.reduceOp = self._c10d_op(op, flat.dtype)
        o.timeout = left = _left(end)
        self.cross.allreduce([flat], o).wait(left)

    # -- ops -----------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, end: float) -> None:
        if tensor.numel() == 0:
            return
        with on_host(tensor) as host:
            flat = host.view(-1)
            nbytes = flat.numel() * flat.element_size()
            if self.topo.even and self.local is not None and nbytes > self.small_max:
                self._all_reduce_sharded(flat, op, end)
            else:
                self._all_reduce_leader(flat, op, end)

    def _all_reduce_leader(self, flat: torch.Tensor, op: ReduceOp, end: float) -> None:
        local = self.local
        if local is not None:
            self._shm(lambda: local.coll.reduce(flat, 0, op, end))  # pre-multiplies
        elif op.type is RedOpType.PREMUL_SUM:
            flat.mul_(op.factor_value())
        if self.topo.local_rank == 0:
            if self.cross is not None:
                self._gloo_all_reduce(flat, op, end)
            finish_average(flat, op, self.size)
        if local is not None:
            self._shm(lambda: local.coll.broadcast(flat, 0, end))

    def _all_reduce_sharded(self, flat: torch.Tensor, op: ReduceOp, end: float) -> None:
        local = self.local
        assert local is not None
        size = local.size
        n = flat.numel()
        shard = -(-n // size)
        if shard * size == n:
            buf = flat
        else:
            buf = torch.zeros(shard * size, dtype=flat.dtype)
            buf[:n].copy_(flat)
        rows = buf.view(size, shard)
        part = torch.empty(shard, dtype=flat.dtype)
        self._shm(lambda: local.coll.reduce_scatter(part, rows, op, end))  # pre-multiplies
        if self.cross is not None:
            self._gloo_all_reduce(part, op, end)
        finish_average(part, op, self.size)
        self._shm(lambda: local.coll.all_gather(rows, part, end))
        if buf is not flat:
            flat.copy_(buf[:n])

    def broadcast(self, tensor: torch.Tensor, root: int, end: float) -> None:
        """Inside the root's host first, then between leaders, then inside the other hosts."""
        if tensor.numel() == 0:
            return
        topo = self.topo
        root_host = next(h for h, members in enumerate(topo.hosts) if root in members)
        root_local = topo.hosts[root_host].index(root)
        local = self.local
        with on_host(tensor) as host:
            flat = host.view(-1)
            if topo.host == root_host and local is not None:
                self._shm(lambda: local.coll.broadcast(flat, root_local, end))
            if topo.local_rank == 0 and self.cross is not None:
                o = c10d.BroadcastOptions()
                o.rootRank = root_host  # the leaders group lists every host, in order
                o.timeout = left = _left(end)
                self.cross.broadcast([flat], o).wait(left)
            if topo.host != root_host and local is not None:
                self._shm(lambda: local.coll.broadcast(flat, 0, end))

    def barrier(self, end: float) -> None:
        """Everyone on my host arrives, the leaders meet, then my leader releases my host."""
        local = self.local
        if local is not None:
            self._shm(lambda: local.coll.barrier(end))
        if self.topo.local_rank == 0 and self.cross is not None:
            o = c10d.BarrierOptions()
            o.timeout = left = _left(end)
            self.cross.barrier(o).wait(left)
        if local is not None:
            self._shm(lambda: local.coll.barrier(end))
