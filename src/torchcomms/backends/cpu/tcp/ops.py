"""``TcpOps``: every op of the CPU backend over TCP: the lane for collectives, gloo for the rest.

**The header** (``cpu.tcp.exchange``).  Every collective's fingerprint and sequence number
reach every rank before any data is combined, through the communicator's ``transport.tcp.lane``
(direct sockets, on the op's thread: no gloo thread hand-offs), so ranks that called
different collectives all raise a mismatch, and gloo never sees sizes that differ
between ranks (it aborts the process on those).

* Small collectives (up to ``Exchange.inline_max`` bytes per rank) finish inside one
  header exchange: the payload rides in the header's row, and reductions run locally in
  rank order where that cannot change a bit of gloo's result (exact dtypes, order-free
  ops, or two float32/64 operands).
* Large all_reduce, reduce (two ranks, or more than ``TREE_MAX``; a binomial tree over the
  point-to-point connections between), reduce_scatter, all_gather and broadcast run on the
  lane's ring (``cpu.tcp.ring_ops``), the header in their first frame.
* all_to_all past the inline limit: two ranks, equal parts: one exchange on the ring;
  otherwise a header exchange, then every part at once over the point-to-point
  connections (``cpu.tcp.direct``).
* The rest call gloo after a header exchange (``TORCHCOMM_MISMATCH_CHECK=0`` drops it).

**Waits** (``cpu.tcp.waits``).  A gloo wait runs in short slices; between them it checks the
abort flag, the peers' liveness (``cpu.tcp.liveness``) and the op's deadline, so a dead peer
or an abort is seen within a slice by every survivor, and a timeout names the ranks that
never entered the op.  gloo's own timeouts are a backstop past the deadline.

Reductions gloo lacks (AVG, PREMUL_SUM) and the variable-size collectives are composed
here from gloo primitives.  Point-to-point ops (``cpu.tcp.direct``) go over
``transport.tcp.p2p``.  Runs on the op's thread (see ``cpu.ops``); ``abort`` on any thread.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch._C._distributed_c10d as c10d

from torchcomms.backends.cpu.host_arrays import UserBytes
from torchcomms.backends.cpu.ops import CpuOps
from torchcomms.backends.cpu.reductions import reduce_rows
from torchcomms.backends.cpu.staging import finish_average, on_host, overlaps, premultiplied
from torchcomms.backends.cpu.tcp.direct import TcpDirect
from torchcomms.backends.cpu.tcp.exchange import Exchange
from torchcomms.backends.cpu.tcp.liveness import Liveness
from torchcomms.backends.cpu.tcp.mismatch import MismatchReport
from torchcomms.backends.cpu.tcp.ring_ops import RingOps, combiner
from torchcomms.backends.cpu.tcp.waits import GLOO_MARGIN_S, TcpWaiter
from torchcomms.runtime import fingerprint as F
from torchcomms.runtime.deadline import Deadline
from torchcomms.runtime.fingerprint import Fingerprint
from torchcomms.transport.gloo import process_group as gloo
from torchcomms.transport.procs import process_alive
from torchcomms.transport.tcp.lane import Lane
from torchcomms.transport.tcp.p2p import P2P
from torchcomms.types import RedOpType, ReduceOp

logger = logging.getLogger("torchcomms.backends.cpu.tcp.ops")

#: Up to this many ranks, a large reduce runs as a binomial tree over the point-to-point
#: connections (``TcpDirect._reduce_tree``); beyond, on the ring, whose root takes in less.
TREE_MAX = 4

_EXACT_ORDER_FREE = (RedOpType.MAX, RedOpType.MIN, RedOpType.BAND, RedOpType.BOR)


#: The payload of an exchange that carries none but must happen (barrier, broadcast's
#: receivers), whatever ``TORCHCOMM_MISMATCH_CHECK`` says.
_NOTHING = torch.empty(0)


def _premultiply(tensor: torch.Tensor, op: ReduceOp) -> None:
    if op.type is RedOpType.PREMUL_SUM:
        tensor.mul_(op.factor_value())


class TcpOps(TcpDirect, CpuOps):
    """The flat tcp path: one process group over every member."""

    def __init__(
        self,
        pg: Any,
        lane: Lane,
        p2p: P2P,
        rank: int,
        size: int,
        peers: Sequence[tuple[str, int]],
        device_desc: str,
        liveness: Liveness | None = None,
        check: bool = True,
        pg_timeout: timedelta = timedelta(seconds=600),
        store: Any = None,
        pg_store: Any = None,
    ) -> None:
        self.pg = pg
        self._pg_store = pg_store  # the store ``pg`` calls back into: lives as long as it
        self.lane = lane
        self.rank = rank
        self.size = size
        self._peers = list(peers)  # (host identity, pid) per comm rank
        self.device_desc = (
            device_desc  # which network device, e.g. "loopback: all ranks on this host"
        )
        self.liveness = liveness
        self.check = check  # exchange headers on every collective (TORCHCOMM_MISMATCH_CHECK)
        self.seq = 0  # collectives entered
        report = MismatchReport(store, rank, size, self._announce)
        self.waiter = TcpWaiter(rank, self.dead_peers, liveness, lambda: self.seq, lane, report)
        self._send_seq: dict[int, int] = defaultdict(int)
        self._recv_seq: dict[int, int] = defaultdict(int)
        self._pg_timeout = pg_timeout
        self.exchange = Exchange(lane, rank, size, self.waiter)
        self.inline_max = self.exchange.inline_max
        self.rings = RingOps(lane, self.exchange, self.waiter, self._begin, check)
        #: Point-to-point over direct connections.
        self.p2p = p2p
        p2p.lane_shares_core = lane.shares_core  # the cores the lane's headers carry
        self._user_bytes = UserBytes()

    def describe(self) -> str:
        return f"tcp ({self.device_desc})"

    def fail(
        self, dead: Sequence[int] = (), missing: Sequence[int] = (), blamed: Sequence[int] = ()
    ) -> None:
        """Tell the ranks that receive from this one, through the lane, whom it blames."""
        kind, ranks = (
            ("dead", dead) if dead else ("timeout", missing) if missing else ("peer", blamed)
        )
        said = f"FAILED {kind if ranks else 'failed'} {','.join(map(str, ranks))}"
        self.lane.goodbye(said)
        self.p2p.goodbye(said)

    def _announce(self, ranks: list[int], text: str) -> None:
        """A mismatch, to the ranks that receive from this one (before ``fail``: they may
        be waiting in a ring op, which only this rank can end)."""
        self.lane.goodbye(f"FAILED mismatch {','.join(map(str, ranks))} {text}")

    def abort(self) -> None:
        self.waiter.aborted = True  # every wait slice checks it

    def close(self, failed: bool) -> None:
        if not failed:
            self._settle_owed()
        if failed:  # unless a failure was said already (``fail``)
            self.lane.goodbye("FAILED aborted" if self.waiter.aborted else "FAILED failed")
        self.lane.close()
        if failed:
            self.p2p.goodbye("FAILED aborted" if self.waiter.aborted else "FAILED failed")
        self.p2p.close()
        if self.liveness is not None:
            self.liveness.close()
        self.waiter.report.close()
        self.release_group((self.pg, self._pg_store))
        self.pg = self._pg_store = None

    def _settle_owed(self) -> None:
        """At finalize: check the peer's frames this rank is still owed (two ranks,
        ``transport.tcp.posted``) that have arrived, and log a difference: the last
        broadcast or reduce this rank only sent may have mismatched, and no later op will
        say so.  Never raises (the communicator is going away) and never waits."""
        owed = self.lane.owed
        if owed is None or not owed.checks:
            return
        try:
            owed.settle(lambda: None, wait=False)
        except Exception as exc:
            logger.warning(
                "torchcomms: rank %d at finalize: an op it only sent failed on its peer: %s",
                self.rank,
                exc,
                extra={"rank": self.rank},
            )

    def release_group(self, held: tuple[Any, ...]) -> None:
        """Drop a process group of this comm (and what must outlive it) now, or, while a
        gloo call of this comm may still run, once it ended (``transport.gloo``)."""
        if held[0] is not None:
            gloo.release(held, self.waiter.busy)

    def dead_peers(self) -> list[int]:
        """Members on this host whose process is gone (a dead remote shows as a closed socket)."""
        if self.liveness is not None:
            return list(self.liveness.check_pids())
        me = self._peers[self.rank][0]
        return [
            r
            for r, (host, pid) in enumerate(self._peers)
            if r != self.rank and host == me and not process_alive(pid)
        ]

    # -- the header and the waits (see the module docstring) -----------------------------
    def enter(
        self, fp: Fingerprint, deadline: Deadline, payload: torch.Tensor | None = None
    ) -> None:
        """Start a collective: exchange headers (and ``payload``, at most ``inline_max``
        bytes, then readable through ``exchange.payload``); raise a mismatch.  Without a
        payload, skipped when the check is off."""
        if payload is None and not self.check:
            self.seq += 1
            if self.liveness is not None:
                self.liveness.seq = self.seq
            return
        self.exchange.run(self._begin(fp), fp, deadline, payload)

    def _begin(self, fp: Fingerprint) -> int:
        """Count a collective in (its sequence number, which the liveness watcher shows)."""
        self.seq = seq = self.seq + 1
        if self.liveness is not None:
            self.liveness.seq = seq
        self.waiter.current = (fp, seq)
        return seq

    def arm(self, gloo_options: Any, deadline: Deadline) -> None:
        """gloo's own timeout for one call, a backstop past the op's deadline (which ``wait``
        enforces): the process group's default (the comm timeout plus ``GLOO_MARGIN``),
        unless this op's timeout is longer than the comm's."""
        if deadline.timeout > self._pg_timeout:
            gloo_options.timeout = timedelta(seconds=deadline.left_s() + GLOO_MARGIN_S)

    def _rooted(self, gloo_options: Any, root: int, deadline: Deadline) -> Any:
        """``gloo_options`` for a call rooted at ``root``, armed (``arm``)."""
        gloo_options.rootRank = root
        self.arm(gloo_options, deadline)
        return gloo_options

    def wait(
        self, work: Any, deadline: Deadline, what: str, peers: Sequence[int] | None = None
    ) -> None:
        """Wait for one gloo call in slices (``cpu.tcp.waits``)."""
        self.waiter.wait(work, deadline, what, peers)

    # -- reductions ----------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, deadline: Deadline) -> None:
        fp = F.make(F.ALL_REDUCE, tensor.dtype, tensor.numel(), redop=op)
        with on_host(tensor) as host:
            if self.inline_reduce(host, op):
                self.enter(fp, deadline, premultiplied(host, op))
                self._reduce_rows(host, op)
                finish_average(host, op, self.size)
                return
            if self.rings.fits(host, self.size):
                self.rings.all_reduce(host.view(-1), op, fp, deadline)
                return
            self.enter(fp, deadline)
            o = c10d.AllreduceOptions()
            o.reduceOp = gloo.c10d_op(op, host.dtype)
            self.arm(o, deadline)
            _premultiply(host, op)
            self.wait(self.pg.allreduce([host], o), deadline, "all_reduce")
            finish_average(host, op, self.size)

    def inline_reduce(self, host: torch.Tensor, op: ReduceOp, nbytes: int = -1) -> bool:
        """Whether a reduction of ``host`` (``nbytes`` per rank, default all of it) rides in
        the header: small, and the result is gloo's, bit for bit (exact dtypes,
        order-free ops, or two float32/64 operands)."""
        if nbytes < 0:
            nbytes = host.numel() * host.element_size()
        if nbytes > self.inline_max:
            return False
        dtype = host.dtype
        if nbytes == 0:
            return True
        if not dtype.is_floating_point or op.type in _EXACT_ORDER_FREE:
            return True
        return self.size == 2 and dtype in (torch.float32, torch.float64)

    def _reduce_rows(self, out: torch.Tensor, op: ReduceOp, first: int = 0) -> None:
        """Reduce every rank's payload elements ``first ..`` (as many as ``out``) into it."""
        n = out.numel()
        if n:
            reduce_rows(self.exchange.payload(out.dtype, first, n), out.view(-1), op)

    def reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp, deadline: Deadline) -> None:
        fp = F.make(F.REDUCE, tensor.dtype, tensor.numel(), root, op)
        with on_host(tensor) as host:
            if self.inline_reduce(host, op):
                if self.size == 2 and self.rank != root:  # the root's header is owed
                    self.exchange.post(self._begin(fp), fp, deadline, premultiplied(host, op))
                    return
                self.enter(fp, deadline, premultiplied(host, op))
                if self.rank == root:
                    self._reduce_rows(host, op)
                    finish_average(host, op, self.size)
                return
            if 2 < self.size <= TREE_MAX and host.is_contiguous():
                self.enter(fp, deadline)
                self._reduce_tree(host.view(-1), root, op, combiner(op, host.dtype), deadline)
                return
            if self.rings.fits(host, self.size):
                self.rings.reduce(host.view(-1), root, op, fp, deadline)
                return
            self.enter(fp, deadline)
            if host.numel():
                self._reduce_into(host, root, op, deadline)

    def _reduce_into(
        self, tensor: torch.Tensor, root: int, op: ReduceOp, deadline: Deadline
    ) -> None:
        o = self._rooted(c10d.ReduceOptions(), root, deadline)
        o.reduceOp = gloo.c10d_op(op, tensor.dtype)
        _premultiply(tensor, op)
        self.wait(self.pg.reduce([tensor], o), deadline, "reduce")
        if self.rank == root:
            finish_average(tensor, op, self.size)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: Sequence[torch.Tensor],
        op: ReduceOp,
        deadline: Deadline,
    ) -> None:
        flat = torch.cat([t.detach().to("cpu").reshape(-1) for t in input_list])
        self._reduce_scatter(output, flat, op, deadline)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, deadline: Deadline
    ) -> None:
        self._reduce_scatter(output, input.detach().to("cpu").reshape(-1), op, deadline)

    def _reduce_scatter(
        self, output: torch.Tensor, flat_in: torch.Tensor, op: ReduceOp, deadline: Deadline
    ) -> None:
        n = output.numel()
        fp = F.make(F.REDUCE_SCATTER, output.dtype, n, -1, op)
        with on_host(output) as host_out:
            out = host_out.view(-1)
            if self.inline_reduce(out, op, flat_in.numel() * flat_in.element_size()):
                self.enter(fp, deadline, premultiplied(flat_in, op))
                self._reduce_rows(out, op, self.rank * n)
                finish_average(out, op, self.size)
                return
            if n and self.rings.fits(flat_in, self.size) and out.is_contiguous():
                self.rings.reduce_scatter(out, flat_in, op, fp, deadline)
                return
            self.enter(fp, deadline)
            if n:
                self._reduce_scatter_flat(out, flat_in, op, deadline)

    def _reduce_scatter_flat(
        self, out: torch.Tensor, flat_in: torch.Tensor, op: ReduceOp, deadline: Deadline
    ) -> None:
        flat_in = premultiplied(flat_in, op)  # never scale the caller's input in place
        o = c10d.ReduceScatterOptions()
        o.reduceOp = gloo.c10d_op(op, out.dtype)
        self.arm(o, deadline)
        self.wait(self.pg._reduce_scatter_base(out, flat_in, o), deadline, "reduce_scatter")
        finish_average(out, op, self.size)

    def reduce_scatter_v(
        self,
        output: torch.Tensor,
        input_list: Sequence[torch.Tensor],
        op: ReduceOp,
        deadline: Deadline,
    ) -> None:
        sizes = [t.numel() for t in input_list]
        self.enter(F.make(F.REDUCE_SCATTER_V, output.dtype, 0, -1, op, sizes), deadline)
        for root, chunk in enumerate(input_list):
            if chunk.numel() == 0:
                continue
            scratch = chunk.detach().to("cpu", copy=True).contiguous()
            self._reduce_into(scratch, root, op, deadline)
            if root == self.rank:
                output.copy_(scratch.view(output.shape))

    # -- rooted --------------------------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, root: int, deadline: Deadline) -> None:
        fp = F.make(F.BROADCAST, tensor.dtype, tensor.numel(), root)
        with on_host(tensor) as host:
            nbytes = host.numel() * host.element_size()
            if nbytes <= self.inline_max:
                if self.size == 2 and self.rank == root:  # the peer's header is owed
                    self.exchange.post(self._begin(fp), fp, deadline, host)
                    return
                self.enter(fp, deadline, host if self.rank == root else _NOTHING)
                if self.rank != root and nbytes:
                    data = self.exchange.payload(host.dtype, 0, host.numel())[root]
                    host.view(-1).copy_(data)
                return
            if self.rings.fits(host):
                self.rings.broadcast(host.view(-1), root, fp, deadline)
                return
            self.enter(fp, deadline)
            self._broadcast(host, root, deadline)

    def _broadcast(self, tensor: torch.Tensor, root: int, deadline: Deadline) -> None:
        o = self._rooted(c10d.BroadcastOptions(), root, deadline)
        self.wait(self.pg.broadcast([tensor], o), deadline, "broadcast")

    def scatter(
        self,
        output: torch.Tensor,
        input_list: Sequence[torch.Tensor],
        root: int,
        deadline: Deadline,
    ) -> None:
        fp = F.make(F.SCATTER, output.dtype, output.numel(), root)
        n = output.numel()
        if n * output.element_size() * self.size <= self.inline_max:
            mine = torch.cat([t.reshape(-1) for t in input_list]) if self.rank == root else None
            self.enter(fp, deadline, _NOTHING if mine is None else mine.to("cpu"))
            if n:
                got = self.exchange.payload(output.dtype, self.rank * n, n)[root]
                output.copy_(got.view(output.shape))
            return
        self.enter(fp, deadline)
        if n == 0:
            return
        o = self._rooted(c10d.ScatterOptions(), root, deadline)
        with on_host(output) as host_out:
            if self.rank == root:
                srcs = [t.detach().to("cpu").contiguous() for t in input_list]
                self.wait(self.pg.scatter([host_out], [srcs], o), deadline, "scatter")
            else:
                self.wait(self.pg.scatter([host_out], [], o), deadline, "scatter")

    def gather(
        self,
        output_list: Sequence[torch.Tensor],
        input: torch.Tensor,
        root: int,
        deadline: Deadline,
    ) -> None:
        fp = F.make(F.GATHER, input.dtype, input.numel(), root)
        n = input.numel()
        if n * input.element_size() <= self.inline_max:
            self.enter(fp, deadline, input.detach().to("cpu"))
            if n and self.rank == root:
                got = self.exchange.payload(input.dtype, 0, n)
                for out, row in zip(output_list, got, strict=True):
                    out.copy_(row.view(out.shape))
            return
        self.enter(fp, deadline)
        if n == 0:
            return
        o = self._rooted(c10d.GatherOptions(), root, deadline)
        src = input.detach().to("cpu").contiguous()
        if self.rank == root:
            staging = [torch.empty_like(src) for _ in range(self.size)]
            self.wait(self.pg.gather([staging], [src], o), deadline, "gather")
            for out, got in zip(output_list, staging, strict=True):
                out.copy_(got.view(out.shape))
        else:
            self.wait(self.pg.gather([], [src], o), deadline, "gather")

    # -- gathers -------------------------------------------------------------------------
    def all_gather(
        self, output_list: Sequence[torch.Tensor], input: torch.Tensor, deadline: Deadline
    ) -> None:
        n = input.numel()
        flat = torch.empty(self.size * n, dtype=input.dtype)
        self._all_gather_flat(flat, input, deadline)
        for i, out in enumerate(output_list):
            out.copy_(flat[i * n : (i + 1) * n].view(out.shape))

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, deadline: Deadline
    ) -> None:
        with on_host(output) as host_out:
            self._all_gather_flat(host_out.view(-1), input, deadline)

    def _all_gather_flat(
        self, flat: torch.Tensor, tensor: torch.Tensor, deadline: Deadline
    ) -> None:
        src = tensor.detach().to("cpu").reshape(-1)
        n = src.numel()
        fp = F.make(F.ALL_GATHER, src.dtype, n)
        nbytes = n * src.element_size()
        if nbytes <= self.inline_max:
            self.enter(fp, deadline, src)
            if n:
                flat.view(self.size, n).copy_(self.exchange.payload(src.dtype, 0, n))
            return
        if self.rings.fits(src) and flat.is_contiguous():
            self.rings.all_gather(flat, src, fp, deadline)
            return
        self.enter(fp, deadline)
        o = c10d.AllgatherOptions()
        self.arm(o, deadline)
        self.wait(self.pg._allgather_base(flat, src, o), deadline, "all_gather")

    def all_gather_v(
        self, output_list: Sequence[torch.Tensor], input: torch.Tensor, deadline: Deadline
    ) -> None:
        sizes = [t.numel() for t in output_list]
        self.enter(F.make(F.ALL_GATHER_V, input.dtype, 0, sizes=sizes), deadline)
        for root in range(self.size):
            target = output_list[root]
            if root == self.rank:
                target.copy_(input.view(target.shape))
            if target.numel() == 0:
                continue
            with on_host(target) as host:
                self._broadcast(host, root, deadline)

    # -- all-to-all ----------------------------------------------------------------------
    def all_to_all_flat(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        out_splits: Sequence[int],
        in_splits: Sequence[int],
        deadline: Deadline,
    ) -> None:
        # Equal parts only for the call without splits: equal splits on this rank may be
        # unequal on another, and every rank must take one path (one header).
        even = not in_splits
        count = input.numel() if even else 0
        fp = F.make(F.ALL_TO_ALL if even else F.ALL_TO_ALL_V, input.dtype, count)
        if even and count * input.element_size() <= self.inline_max:
            self.enter(fp, deadline, input.detach().to("cpu").reshape(-1))
            if count:
                chunk = count // self.size
                got = self.exchange.payload(input.dtype, self.rank * chunk, chunk)
                with on_host(output) as host_out:
                    host_out.view(self.size, chunk).copy_(got)
            return
        # Two ranks: one exchange on the lane.  Chosen from what every rank shares (size,
        # count, dtype): a rank whose input is its output copies the input instead.
        nbytes = count * input.element_size()
        if even and self.size == 2 and count and self.rings.fits_bytes(nbytes, 2):
            with on_host(output) as host_out:
                out = host_out.view(-1)
                src = input.detach().to("cpu").reshape(-1)
                self.rings.all_to_all_pair(out, src.clone() if overlaps(out, src) else src, fp,
                                           deadline)  # fmt: skip
            return
        self.enter(fp, deadline)
        if not in_splits and input.numel() == 0:
            return
        with on_host(output) as host_out:
            out = host_out.view(-1)
            src = input.detach().to("cpu").reshape(-1)
            if overlaps(out, src):
                src = src.clone()  # the input is read while the output is written: never alias
            if even:
                part = count // self.size
                out_splits = in_splits = [part] * self.size
            self._all_to_all_direct(out, src, out_splits, in_splits, deadline)

    def barrier(self, deadline: Deadline) -> None:
        """The header exchange is a barrier: every rank's header arrives before any returns."""
        self.enter(F.make(F.BARRIER, None, 0), deadline, _NOTHING)
