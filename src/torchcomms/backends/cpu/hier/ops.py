"""``HierOps``: the CPU backend's hierarchical placement, shm inside each host, gloo between.

When a communicator's members span several hosts and at least one host holds more than
one of them, ``TorchCommGloo`` picks ``HierOps``: ``all_reduce``, ``broadcast`` and
``barrier`` are specialised here; every other op is delegated, one line each, to a
``TcpOps`` over a global ``ProcessGroupGloo``.

* **Hosts** are the distinct host identities of the members (exchanged at connect,
  overridable with ``TORCHCOMM_HOST_ID``), numbered in order of first appearance; a
  member's *local index* is its position among the members of its host (comm rank order).
* **Inside a host** (more than one member): one shm segment (``shm_ops.open_collectives`` under
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
bitwise ops use shm's own reductions inside a host and ``transport.gloo``'s mapping
between hosts, so results equal the flat tcp path bit for bit on integer-valued data.
Every wait is bounded by the op's deadline; shm wait errors are re-raised naming comm
ranks (not host-local ones), gloo errors propagate unchanged (the backend types both).
Runs on the op's thread (see ``cpu.ops``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch
import torch._C._distributed_c10d as c10d

from torchcomms import config
from torchcomms.backends.cpu import connect as cpu_connect
from torchcomms.backends.cpu.ops import Completion, CpuOps
from torchcomms.backends.cpu.shm import ops as shm_ops
from torchcomms.backends.cpu.shm.collectives import ShmCollectives
from torchcomms.backends.cpu.staging import finish_average, on_host
from torchcomms.backends.cpu.tcp.ops import TcpOps
from torchcomms.backends.cpu.tcp.waits import GLOO_MARGIN
from torchcomms.ranks import RankMessage, Ranks
from torchcomms.runtime import fingerprint as F
from torchcomms.runtime.deadline import Deadline
from torchcomms.transport.errors import WaitError
from torchcomms.transport.gloo import process_group as gloo
from torchcomms.transport.shm.channel import STATE_FAILED, STATE_FINALIZED
from torchcomms.types import P2POp, RedOpType, ReduceOp


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


def connect(
    store: c10d.Store,
    flat: TcpOps,
    peers: Sequence[tuple[str, int]],
    hints: dict[str, str],
    timeout: timedelta,
    gloo_device: Any,
    lazy: bool,
    describe: str,
) -> HierOps:
    """Build my host's shm segment and my cross group (collective over all members).

    ``flat`` is the global tcp path, which serves every op not specialised here.
    """
    rank = flat.rank
    topo = topology(peers, rank)
    deadline = Deadline(timeout)
    local_pids = cpu_connect.local_pids(peers, rank)
    prefix = f"[TorchCommGloo {describe} rank={rank}] new_comm: "
    local: ShmCollectives | None = None
    members = topo.hosts[topo.host]
    if len(members) > 1:
        local = shm_ops.open_collectives(
            c10d.PrefixStore(f"hier/host{topo.host}", store),
            topo.local_rank,
            len(members),
            {i: peers[r][1] for i, r in enumerate(members)},
            hints,
            timeout,
            f"{describe} host{topo.host}",
        )
    cross: Any = None
    cross_store: Any = None  # what ``cross`` calls back into: kept with it
    cross_index = 0
    try:
        i = topo.local_rank
        group = topo.cross_members(i)
        if len(group) > 1 and (i == 0 or topo.even):
            cross_index = group.index(rank)
            cross, cross_store = cpu_connect.guarded(
                lambda: gloo.connect_process_group(
                    c10d.PrefixStore(f"hier/cross{i}", store),
                    cross_index,
                    len(group),
                    timeout + GLOO_MARGIN,
                    gloo_device,
                    lazy,
                ),
                deadline,
                local_pids,
                list(local_pids),
                prefix,
                "the cross-host connect",
            )
        # Every rank must pick the same algorithm: comm rank 0's switch size counts.
        small_max = config.hier_small_max(hints.get("hier_small_max"))
        if rank == 0:
            store.set("hier/small_max", str(small_max))
        cpu_connect.wait_keys(
            store, {"hier/small_max": 0}, deadline, local_pids, prefix, "the hierarchical set-up"
        )
        small_max = int(store.get("hier/small_max").decode())
    except BaseException:
        if local is not None:
            local.chan.close(STATE_FAILED)
        raise
    return HierOps(topo, flat, local, (cross, cross_store), cross_index, small_max)


P = ParamSpec("P")
R = TypeVar("R")


def _flat(op: Callable[Concatenate[TcpOps, P], R]) -> Callable[Concatenate[HierOps, P], R]:
    """``HierOps``'s method of ``op``'s name: the same op on the flat tcp path (for the
    collectives not specialised here: it costs ``*args`` forwarding on each call)."""

    def delegated(self: HierOps, *args: P.args, **kwargs: P.kwargs) -> R:
        return op(self.flat, *args, **kwargs)

    delegated.__name__ = op.__name__
    delegated.__qualname__ = f"HierOps.{op.__name__}"
    return delegated


class HierOps(CpuOps):
    """``all_reduce`` / ``broadcast`` / ``barrier`` over shm inside hosts and gloo between;
    the other ops go to the flat tcp path (see the module docstring)."""

    def __init__(
        self,
        topo: Topology,
        flat: TcpOps,
        local: ShmCollectives | None,
        cross: tuple[Any, Any],
        cross_index: int,
        small_max: int,
    ) -> None:
        self.topo = topo
        self.rank = flat.rank
        self.size = flat.size
        self.flat = flat
        self.local = local  # my host's segment (None when I am alone on my host)
        # my cross group (None when it would have one member) and the store it calls back into
        self.cross, self._cross_store = cross
        self.cross_index = cross_index
        self.small_max = small_max

    def describe(self) -> str:
        t = self.topo
        return (
            f"hierarchical: shm inside {len(t.hosts)} hosts ({t.sizes_text()} ranks), "
            f"tcp between ({self.flat.device_desc}); all_reduce leader-based up to "
            f"{self.small_max} B{', sharded above' if t.even else ' (uneven hosts)'}"
        )

    def fail(
        self, dead: Sequence[int] = (), missing: Sequence[int] = (), blamed: Sequence[int] = ()
    ) -> None:
        """Tell my host's peers (shm) and the lane's (tcp) this rank failed, and why."""
        self.flat.fail(dead, missing, blamed)
        if self.local is not None:
            self.local.chan.set_state(STATE_FAILED)

    def abort(self) -> None:
        self.flat.abort()
        if self.local is not None:
            self.local.chan.abort()

    def close(self, failed: bool) -> None:
        local, self.local = self.local, None
        cross = (self.cross, self._cross_store)
        self.cross = self._cross_store = None
        self.flat.release_group(cross)  # its calls are waited for by the flat path's waiter
        self.flat.close(failed)
        if local is not None:
            local.chan.close(STATE_FAILED if failed else STATE_FINALIZED)

    def dead_peers(self) -> list[int]:
        return self.flat.dead_peers()

    # -- helpers -------------------------------------------------------------------------
    def _shm(self, call: Callable[[], None]) -> None:
        """Run one shm step; wait errors name comm ranks instead of host-local ones."""
        try:
            call()
        except WaitError as exc:
            members = self.topo.hosts[self.topo.host]
            text = exc.message.text(members.__getitem__)  # the same message, in comm ranks
            lv = self.flat.liveness
            if exc.kind == "peer_failed" and lv is not None and lv.check_pids():
                # A host peer failed because a rank elsewhere died: blame the dead.
                dead = list(lv.dead)
                message = RankMessage("{} died (process gone); {}", Ranks(dead), text)
                raise WaitError("dead", dead, message) from exc
            where = RankMessage("inside host {} of {}", self.topo.host, Ranks(members, "comm rank"))
            ranks = [members[r] for r in exc.ranks]
            raise WaitError(exc.kind, ranks, RankMessage("{} [{}]", text, where)) from exc

    def _gloo_all_reduce(self, flat: torch.Tensor, op: ReduceOp, deadline: Deadline) -> None:
        o = c10d.AllreduceOptions()
        o.reduceOp = gloo.c10d_op(op, flat.dtype)
        self.flat.arm(o, deadline)
        self.flat.wait(self.cross.allreduce([flat], o), deadline, "all_reduce")

    # -- ops -----------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, deadline: Deadline) -> None:
        """Small: the flat path's one header call carries the data.  Else every rank's
        header first (mismatches across hosts), then shm and gloo."""
        if tensor.numel() == 0 or self.flat.inline_reduce(tensor, op):
            self.flat.all_reduce(tensor, op, deadline)
            return
        self.flat.enter(F.make(F.ALL_REDUCE, tensor.dtype, tensor.numel(), redop=op), deadline)
        with on_host(tensor) as host:
            flat = host.view(-1)
            nbytes = flat.numel() * flat.element_size()
            if self.topo.even and self.local is not None and nbytes > self.small_max:
                self._all_reduce_sharded(flat, op, deadline)
            else:
                self._all_reduce_leader(flat, op, deadline)

    def _all_reduce_leader(self, flat: torch.Tensor, op: ReduceOp, deadline: Deadline) -> None:
        local = self.local
        if local is not None:
            self._shm(lambda: local.reduce(flat, 0, op, deadline))  # pre-multiplies
        elif op.type is RedOpType.PREMUL_SUM:
            flat.mul_(op.factor_value())
        if self.topo.local_rank == 0:
            if self.cross is not None:
                self._gloo_all_reduce(flat, op, deadline)
            finish_average(flat, op, self.size)
        if local is not None:
            self._shm(lambda: local.broadcast(flat, 0, deadline))

    def _all_reduce_sharded(self, flat: torch.Tensor, op: ReduceOp, deadline: Deadline) -> None:
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
        self._shm(lambda: local.reduce_scatter(part, rows, op, deadline))  # pre-multiplies
        if self.cross is not None:
            self._gloo_all_reduce(part, op, deadline)
        finish_average(part, op, self.size)
        self._shm(lambda: local.all_gather(rows, part, deadline))
        if buf is not flat:
            flat.copy_(buf[:n])

    def broadcast(self, tensor: torch.Tensor, root: int, deadline: Deadline) -> None:
        """Inside the root's host first, then between leaders, then inside the other hosts
        (small: the flat path's header call; else after every rank's header)."""
        if tensor.numel() * tensor.element_size() <= self.flat.inline_max:
            self.flat.broadcast(tensor, root, deadline)
            return
        self.flat.enter(F.make(F.BROADCAST, tensor.dtype, tensor.numel(), root), deadline)
        topo = self.topo
        root_host = next(h for h, members in enumerate(topo.hosts) if root in members)
        root_local = topo.hosts[root_host].index(root)
        local = self.local
        with on_host(tensor) as host:
            flat = host.view(-1)
            if topo.host == root_host and local is not None:
                self._shm(lambda: local.broadcast(flat, root_local, deadline))
            if topo.local_rank == 0 and self.cross is not None:
                o = c10d.BroadcastOptions()
                o.rootRank = root_host  # the leaders group lists every host, in order
                self.flat.arm(o, deadline)
                self.flat.wait(self.cross.broadcast([flat], o), deadline, "broadcast")
            if topo.host != root_host and local is not None:
                self._shm(lambda: local.broadcast(flat, 0, deadline))

    def barrier(self, deadline: Deadline) -> None:
        """The flat path's header exchange: a barrier that also checks every rank's call."""
        self.flat.barrier(deadline)

    # -- delegated to the flat tcp path -----------------------------------------------------
    reduce = _flat(TcpOps.reduce)
    reduce_scatter = _flat(TcpOps.reduce_scatter)
    reduce_scatter_single = _flat(TcpOps.reduce_scatter_single)
    reduce_scatter_v = _flat(TcpOps.reduce_scatter_v)
    scatter = _flat(TcpOps.scatter)
    gather = _flat(TcpOps.gather)
    all_gather = _flat(TcpOps.all_gather)
    all_gather_single = _flat(TcpOps.all_gather_single)
    all_gather_v = _flat(TcpOps.all_gather_v)
    all_to_all_flat = _flat(TcpOps.all_to_all_flat)

    # Point-to-point written out: ``send``/``recv`` come here, and a plain method call is
    # a few hundred nanoseconds cheaper than ``_flat``'s.
    def post(self, ops: Sequence[P2POp], tag: int | None, deadline: Deadline) -> Completion:
        return self.flat.post(ops, tag, deadline)

    def unattended(self) -> None:
        self.flat.unattended()
