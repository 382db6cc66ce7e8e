"""``GlooOps``: every op of the CPU backend over one torch ``ProcessGroupGloo`` (TCP).

**The header.**  Every collective starts with one all_gather of a header (the op's
fingerprint and the collective sequence number, ``torchcomms.fingerprint``) plus, for
small messages, the payload itself (``INLINE_BYTES``), through the communicator's
``tcp_lane`` (direct sockets, on the op's thread: no gloo thread hand-offs).  Ranks that
called different collectives all raise a mismatch naming who passed what, before any
data is combined and before gloo sees sizes that differ between ranks (it aborts the
process on those).  Small all_reduce / reduce / broadcast / all_gather and barrier finish
inside that one exchange (the reduction runs locally, in rank order, where that cannot
change a bit of gloo's result), so the check costs them nothing.
``TORCHCOMM_MISMATCH_CHECK=0`` drops the header from the other ops.

**Waits** (``gloo_waits``).  A gloo wait runs in short slices; between them it checks the
abort flag, the peers' liveness (``cpu_liveness``) and the op's deadline, so a dead peer
or an abort is seen within a slice by every survivor, and a timeout names the ranks that
never entered the op.  gloo's own timeouts are a backstop past the deadline.

Reductions gloo lacks (AVG, PREMUL_SUM) and the variable-size collectives are composed
here from gloo primitives.  Point-to-point ops are posted to gloo without blocking and
waited on by the returned completion, so mutually dependent send/recv pairs cannot
deadlock.  Runs on the op's thread (see ``cpu_ops``); ``abort`` on any thread.
"""

from __future__ import annotations

import ctypes
from collections import defaultdict
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch._C._distributed_c10d as c10d

from torchcomms import fingerprint as F
from torchcomms.backends._host import finish_average, on_host, overlaps
from torchcomms.backends.cpu_liveness import Liveness
from torchcomms.backends.cpu_ops import Completion, CpuOps
from torchcomms.backends.gloo_waits import GLOO_MARGIN_S, GlooWaiter
from torchcomms.backends.reductions import reduce_rows
from torchcomms.deadline import Deadline
from torchcomms.fingerprint import Fingerprint
from torchcomms.transport import gloo, shm_segment
from torchcomms.transport.fault import WaitError
from torchcomms.transport.tcp_lane import Lane, LanePeerGone
from torchcomms.types import P2POp, P2POpType, RedOpType, ReduceOp

# gloo tags are 32-bit: sequence numbers and user tags wrap within 2**30 (even / odd halves).
_TAG_SPAN = 2**30

_MAGIC = 0x70C0_C0DE
_HEADER_WORDS = 8  # magic, seq, digest, descriptor, count, 3 spare (int64 each)
#: Payload bytes that ride in the header exchange.
INLINE_BYTES = 1024
_WORDS = _HEADER_WORDS + INLINE_BYTES // 8
_HEADER_BYTES = _HEADER_WORDS * 8
_ROW_BYTES = _WORDS * 8
_EXACT_ORDER_FREE = (RedOpType.MAX, RedOpType.MIN, RedOpType.BAND, RedOpType.BOR)


#: The payload of an exchange that carries none but must happen (barrier, broadcast's
#: receivers), whatever ``TORCHCOMM_MISMATCH_CHECK`` says.
_NOTHING = torch.empty(0)


def _premultiply(tensor: torch.Tensor, op: ReduceOp) -> None:
    if op.type is RedOpType.PREMUL_SUM:
        tensor.mul_(op.factor_value())


def _premultiplied(tensor: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    return tensor * op.factor_value() if op.type is RedOpType.PREMUL_SUM else tensor


#: Process groups of failed communicators: a gloo call may still run in one, and
#: destroying it would join that call's thread (up to gloo's timeout).  Kept to exit.
_abandoned: list[Any] = []


class GlooOps(CpuOps):
    """The flat gloo path: one process group over every member."""

    def __init__(
        self,
        pg: Any,
        lane: Lane,
        rank: int,
        size: int,
        peers: Sequence[tuple[str, int]],
        device_desc: str,
        liveness: Liveness | None = None,
        check: bool = True,
        pg_timeout: timedelta = timedelta(seconds=600),
    ) -> None:
        self.pg = pg
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
        self.waiter = GlooWaiter(rank, self.dead_peers, liveness, lambda: self.seq)
        self._send_seq: dict[int, int] = defaultdict(int)
        self._recv_seq: dict[int, int] = defaultdict(int)
        # Every rank's header row; this rank's row is where it writes its own.
        self._out = torch.zeros(size * _WORDS, dtype=torch.int64)
        self._out_words = self._out.numpy().data.cast("B").cast("q")
        self._out_mv = self._out.numpy().data.cast("B")
        self._src_words = self._out_words[rank * _WORDS : (rank + 1) * _WORDS]
        self._src_words[0] = _MAGIC
        self._src_payload = self._out.data_ptr() + rank * _ROW_BYTES + _HEADER_BYTES
        self._lengths = [0] * size
        self._row_starts = [r * _WORDS for r in range(size)]
        self._rows = self._out.numpy().reshape(size, _WORDS)
        self._pg_timeout = pg_timeout
        self._views: dict[tuple[torch.dtype, int], torch.Tensor] = {}  # payload rows by shape
        self._out_bytes = self._out.view(torch.uint8).view(size, _ROW_BYTES)

    def describe(self) -> str:
        return f"tcp ({self.device_desc})"

    def fail(self, dead: Sequence[int] = (), missing: Sequence[int] = ()) -> None:
        """Tell the ranks that receive from this one, through the lane, whom it blames."""
        kind, ranks = ("dead", dead) if dead else ("timeout", missing)
        self.lane.goodbye(f"FAILED {kind if ranks else 'failed'} {','.join(map(str, ranks))}")

    def abort(self) -> None:
        self.waiter.aborted = True  # every wait slice checks it

    def close(self, failed: bool) -> None:
        if failed:  # unless a failure was said already (``fail``)
            self.lane.goodbye("FAILED aborted" if self.waiter.aborted else "FAILED failed")
        self.lane.close()
        if self.liveness is not None:
            self.liveness.close()
        self.waiter.close()
        if (failed or self.waiter.troubled) and self.pg is not None:
            _abandoned.append(self.pg)  # a gloo op may still run: never destroy it mid-op
        self.pg = None

    def dead_peers(self) -> list[int]:
        """Members on this host whose process is gone (a dead remote shows as a closed socket)."""
        if self.liveness is not None:
            return list(self.liveness.check_pids())
        me = self._peers[self.rank][0]
        return [
            r
            for r, (host, pid) in enumerate(self._peers)
            if r != self.rank and host == me and not shm_segment.process_alive(pid)
        ]

    # -- the header and the waits (see the module docstring) -----------------------------
    def enter(
        self,
        fp: Fingerprint,
        deadline: Deadline,
        payload: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Start a collective: exchange headers (and ``payload``, contiguous, at most
        ``INLINE_BYTES``); raise a mismatch.  Returns ``[size, bytes]`` rows whose
        payload starts at ``_HEADER_BYTES``, or None when the check is off."""
        self.seq += 1
        if self.liveness is not None:
            self.liveness.seq = self.seq
        if payload is None and not self.check:
            return None
        words = self._src_words
        words[1] = self.seq
        words[2], words[3], words[4] = fp
        nbytes = 0
        if payload is not None and payload.numel():
            nbytes = payload.numel() * payload.element_size()
            if payload.is_cpu and payload.is_contiguous():
                ctypes.memmove(self._src_payload, payload.data_ptr(), nbytes)
            else:
                self._out_bytes[self.rank, _HEADER_BYTES : _HEADER_BYTES + nbytes].copy_(
                    payload.reshape(-1).view(torch.uint8)
                )
        what = F.OP_NAMES[fp[1] & 0xFF]
        self._lengths[self.rank] = _HEADER_BYTES + nbytes
        waiter = self.waiter
        try:
            self.lane.all_gather(
                self._out_mv, _ROW_BYTES, self._lengths, lambda: waiter.check(deadline, what)
            )
        except LanePeerGone as gone:
            raise waiter.gone(gone, what) from None
        got = self._out_words
        mine = words[1:5]
        for base in self._row_starts:  # the common case: equal headers, a few int compares
            if got[base + 1 : base + 5] != mine:
                rows = self._rows
                by_rank = [((int(r[2]), int(r[3]), int(r[4])), int(r[1])) for r in rows]
                found = F.mismatch(by_rank)
                bad, text = found if found is not None else ([], "different headers")
                raise WaitError("mismatch", bad, f"{what}: collective mismatch: {text}")
        return self._out_bytes

    def arm(self, gloo_options: Any, deadline: Deadline) -> None:
        """gloo's own timeout for one call, a backstop past the op's deadline (which ``wait``
        enforces): the process group's default (the comm timeout plus ``GLOO_MARGIN``),
        unless this op's timeout is longer than the comm's."""
        if deadline.timeout > self._pg_timeout:
            gloo_options.timeout = timedelta(seconds=deadline.left_s() + GLOO_MARGIN_S)

    def wait(
        self, work: Any, deadline: Deadline, what: str, peers: Sequence[int] | None = None
    ) -> None:
        """Wait for one gloo call in slices (``gloo_waits``)."""
        self.waiter.wait(work, deadline, what, peers)

    # -- reductions ----------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, deadline: Deadline) -> None:
        fp = F.make(F.ALL_REDUCE, tensor.dtype, tensor.numel(), redop=op)
        with on_host(tensor) as host:
            if self.inline_reduce(host, op):
                rows = self.enter(fp, deadline, _premultiplied(host, op))
                assert rows is not None
                self._reduce_rows(rows, host, op)
                finish_average(host, op, self.size)
                return
            self.enter(fp, deadline)
            if host.numel() == 0:
                return
            o = c10d.AllreduceOptions()
            o.reduceOp = gloo.c10d_op(op, host.dtype)
            self.arm(o, deadline)
            _premultiply(host, op)
            self.wait(self.pg.allreduce([host], o), deadline, "all_reduce")
            finish_average(host, op, self.size)

    def inline_reduce(self, host: torch.Tensor, op: ReduceOp) -> bool:
        """Whether a reduction rides in the header: small, and the result is gloo's, bit
        for bit (exact dtypes, order-free ops, or two float32/64 operands)."""
        if host.numel() * host.element_size() > INLINE_BYTES:
            return False
        dtype = host.dtype
        if not dtype.is_floating_point or op.type in _EXACT_ORDER_FREE:
            return True
        return self.size == 2 and dtype in (torch.float32, torch.float64)

    def _reduce_rows(self, rows: torch.Tensor, out: torch.Tensor, op: ReduceOp) -> None:
        n = out.numel()
        if n == 0:
            return
        key = (out.dtype, n)
        data = self._views.get(key)
        if data is None:
            nbytes = n * out.element_size()
            data = rows[:, _HEADER_BYTES : _HEADER_BYTES + nbytes].view(out.dtype)
            if len(self._views) > 256:
                self._views.clear()
            self._views[key] = data
        reduce_rows(data, out.view(-1), op)

    def reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp, deadline: Deadline) -> None:
        fp = F.make(F.REDUCE, tensor.dtype, tensor.numel(), root, op)
        with on_host(tensor) as host:
            if self.inline_reduce(host, op):
                rows = self.enter(fp, deadline, _premultiplied(host, op))
                if self.rank == root:
                    assert rows is not None
                    self._reduce_rows(rows, host, op)
                    finish_average(host, op, self.size)
                return
            self.enter(fp, deadline)
            if host.numel():
                self._reduce_into(host, root, op, deadline)

    def _reduce_into(
        self, tensor: torch.Tensor, root: int, op: ReduceOp, deadline: Deadline
    ) -> None:
        o = c10d.ReduceOptions()
        o.reduceOp = gloo.c10d_op(op, tensor.dtype)
        o.rootRank = root
        self.arm(o, deadline)
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
        self.enter(F.make(F.REDUCE_SCATTER, output.dtype, output.numel(), -1, op), deadline)
        if output.numel() == 0:
            return
        flat = torch.cat([t.detach().to("cpu").reshape(-1) for t in input_list])
        with on_host(output) as host_out:
            self._reduce_scatter_flat(host_out.view(-1), flat, op, deadline)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, deadline: Deadline
    ) -> None:
        self.enter(F.make(F.REDUCE_SCATTER, output.dtype, output.numel(), -1, op), deadline)
        if output.numel() == 0:
            return
        src = input.detach().to("cpu").reshape(-1)
        with on_host(output) as host_out:
            self._reduce_scatter_flat(host_out.view(-1), src, op, deadline)

    def _reduce_scatter_flat(
        self, out: torch.Tensor, flat_in: torch.Tensor, op: ReduceOp, deadline: Deadline
    ) -> None:
        if op.type is RedOpType.PREMUL_SUM:
            flat_in = flat_in * op.factor_value()  # never scale the caller's input in place
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
            if nbytes <= INLINE_BYTES:
                rows = self.enter(fp, deadline, host if self.rank == root else _NOTHING)
                assert rows is not None
                if self.rank != root and nbytes:
                    data = rows[root, _HEADER_BYTES : _HEADER_BYTES + nbytes]
                    host.view(-1).copy_(data.view(host.dtype))
                return
            self.enter(fp, deadline)
            self._broadcast(host, root, deadline)

    def _broadcast(self, tensor: torch.Tensor, root: int, deadline: Deadline) -> None:
        o = c10d.BroadcastOptions()
        o.rootRank = root
        self.arm(o, deadline)
        self.wait(self.pg.broadcast([tensor], o), deadline, "broadcast")

    def scatter(
        self,
        output: torch.Tensor,
        input_list: Sequence[torch.Tensor],
        root: int,
        deadline: Deadline,
    ) -> None:
        self.enter(F.make(F.SCATTER, output.dtype, output.numel(), root), deadline)
        if output.numel() == 0:
            return
        o = c10d.ScatterOptions()
        o.rootRank = root
        self.arm(o, deadline)
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
        self.enter(F.make(F.GATHER, input.dtype, input.numel(), root), deadline)
        if input.numel() == 0:
            return
        o = c10d.GatherOptions()
        o.rootRank = root
        self.arm(o, deadline)
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
        if nbytes <= INLINE_BYTES:
            rows = self.enter(fp, deadline, src.contiguous())
            assert rows is not None
            if n:
                data = rows[:, _HEADER_BYTES : _HEADER_BYTES + nbytes]
                flat.view(self.size, n).copy_(data.view(src.dtype))
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
        even = not in_splits or (len(set(in_splits)) == 1 and list(in_splits) == list(out_splits))
        count = input.numel() if even else 0
        self.enter(F.make(F.ALL_TO_ALL if even else F.ALL_TO_ALL_V, input.dtype, count), deadline)
        if not in_splits and input.numel() == 0:
            return
        with on_host(output) as host_out:
            out = host_out.view(-1)
            src = input.detach().to("cpu").reshape(-1)
            if overlaps(out, src):
                src = src.clone()  # gloo reads the input while writing the output: never alias
            o = c10d.AllToAllOptions()
            self.arm(o, deadline)
            work = self.pg.alltoall_base(out, src, list(out_splits), list(in_splits), o)
            self.wait(work, deadline, "all_to_all")

    def barrier(self, deadline: Deadline) -> None:
        """The header exchange is a barrier: every rank's header arrives before any returns."""
        self.enter(F.make(F.BARRIER, None, 0), deadline, _NOTHING)

    # -- point-to-point ------------------------------------------------------------------
    def post(self, ops: Sequence[P2POp], tag: int | None, deadline: Deadline) -> Completion:
        """Untagged messages use even gloo tags from a per-peer sequence number, tagged ones
        an odd tag of their own (see ``CpuOps.post``)."""
        posted = [self._post_one(op, tag) for op in ops]

        def complete() -> None:
            for work, op, staged in posted:
                what = "send" if op.type is P2POpType.SEND else "recv"
                self.waiter.wait_p2p(work, deadline, what, op.peer)
                if staged is not op.tensor and op.type is P2POpType.RECV:
                    op.tensor.copy_(staged)

        return complete

    def _post_one(self, op: P2POp, user_tag: int | None) -> tuple[Any, P2POp, torch.Tensor]:
        tensor = op.tensor
        staged = tensor if tensor.device.type == "cpu" else tensor.detach().to("cpu")
        sending = op.type is P2POpType.SEND
        if user_tag is not None:
            tag = 2 * (user_tag % _TAG_SPAN) + 1
        else:
            seqs = self._send_seq if sending else self._recv_seq
            tag = 2 * (seqs[op.peer] % _TAG_SPAN)
            seqs[op.peer] += 1
        pg = self.pg
        work = pg.send([staged], op.peer, tag) if sending else pg.recv([staged], op.peer, tag)
        return work, op, staged
