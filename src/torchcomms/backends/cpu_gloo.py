"""``GlooOps``: every op of the CPU backend over one torch ``ProcessGroupGloo`` (TCP).

Reductions gloo lacks (AVG, PREMUL_SUM) and the variable-size collectives are composed
here from gloo primitives.  Every gloo call gets what is left of the op's deadline, so a
composite op never waits longer than its timeout.  Point-to-point ops are posted to gloo
without blocking and waited on by the returned completion, so mutually dependent
send/recv pairs cannot deadlock.  Runs on the op's thread (see ``cpu_ops``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
import torch._C._distributed_c10d as c10d

from torchcomms.backends._host import finish_average, on_host, overlaps
from torchcomms.backends.cpu_ops import Completion, CpuOps
from torchcomms.deadline import Deadline
from torchcomms.transport import gloo, shm_segment
from torchcomms.types import P2POp, P2POpType, RedOpType, ReduceOp

# gloo tags are 32-bit: sequence numbers and user tags wrap within 2**30 (even / odd halves).
_TAG_SPAN = 2**30


def _premultiply(tensor: torch.Tensor, op: ReduceOp) -> None:
    if op.type is RedOpType.PREMUL_SUM:
        tensor.mul_(op.factor_value())


class GlooOps(CpuOps):
    """The flat gloo path: one process group over every member."""

    def __init__(
        self, pg: Any, rank: int, size: int, peers: Sequence[tuple[str, int]], device_desc: str
    ) -> None:
        self.pg = pg
        self.rank = rank
        self.size = size
        self._peers = list(peers)  # (host identity, pid) per comm rank
        self.device_desc = device_desc  # which network device, e.g. "loopback: all ranks on this host"
        self._send_seq: dict[int, int] = defaultdict(int)
        self._recv_seq: dict[int, int] = defaultdict(int)

    def describe(self) -> str:
        return f"tcp ({self.device_desc})"

    def fail(self) -> None:
        """Nothing to tell: gloo peers see the broken connection or time out themselves."""

    def close(self, failed: bool) -> None:
        self.pg = None

    def dead_peers(self) -> list[int]:
        """Members on this host whose process is gone (a dead remote shows as a closed socket)."""
        me = self._peers[self.rank][0]
        return [
            r
            for r, (host, pid) in enumerate(self._peers)
            if r != self.rank and host == me and not shm_segment.process_alive(pid)
        ]

    # -- reductions ----------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, deadline: Deadline) -> None:
        if tensor.numel() == 0:
            return
        with on_host(tensor) as host:
            o = c10d.AllreduceOptions()
            o.reduceOp = gloo.c10d_op(op, host.dtype)
            left = gloo.arm(o, deadline)
            _premultiply(host, op)
            self.pg.allreduce([host], o).wait(left)
            finish_average(host, op, self.size)

    def reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp, deadline: Deadline) -> None:
        if tensor.numel() == 0:
            return
        with on_host(tensor) as host:
            self._reduce_into(host, root, op, deadline)

    def _reduce_into(
        self, tensor: torch.Tensor, root: int, op: ReduceOp, deadline: Deadline
    ) -> None:
        o = c10d.ReduceOptions()
        o.reduceOp = gloo.c10d_op(op, tensor.dtype)
        o.rootRank = root
        left = gloo.arm(o, deadline)
        _premultiply(tensor, op)
        self.pg.reduce([tensor], o).wait(left)
        if self.rank == root:
            finish_average(tensor, op, self.size)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: Sequence[torch.Tensor],
        op: ReduceOp,
        deadline: Deadline,
    ) -> None:
        if output.numel() == 0:
            return
        flat = torch.cat([t.detach().to("cpu").reshape(-1) for t in input_list])
        with on_host(output) as host_out:
            self._reduce_scatter_flat(host_out.view(-1), flat, op, deadline)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, deadline: Deadline
    ) -> None:
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
        left = gloo.arm(o, deadline)
        self.pg._reduce_scatter_base(out, flat_in, o).wait(left)
        finish_average(out, op, self.size)

    def reduce_scatter_v(
        self,
        output: torch.Tensor,
        input_list: Sequence[torch.Tensor],
        op: ReduceOp,
        deadline: Deadline,
    ) -> None:
        for root, chunk in enumerate(input_list):
            if chunk.numel() == 0:
                continue
            scratch = chunk.detach().to("cpu", copy=True).contiguous()
            self._reduce_into(scratch, root, op, deadline)
            if root == self.rank:
                output.copy_(scratch.view(output.shape))

    # -- rooted --------------------------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, root: int, deadline: Deadline) -> None:
        if tensor.numel() == 0:
            return
        with on_host(tensor) as host:
            self._broadcast(host, root, deadline)

    def _broadcast(self, tensor: torch.Tensor, root: int, deadline: Deadline) -> None:
        o = c10d.BroadcastOptions()
        o.rootRank = root
        left = gloo.arm(o, deadline)
        self.pg.broadcast([tensor], o).wait(left)

    def scatter(
        self,
        output: torch.Tensor,
        input_list: Sequence[torch.Tensor],
        root: int,
        deadline: Deadline,
    ) -> None:
        if output.numel() == 0:
            return
        o = c10d.ScatterOptions()
        o.rootRank = root
        left = gloo.arm(o, deadline)
        with on_host(output) as host_out:
            if self.rank == root:
                srcs = [t.detach().to("cpu").contiguous() for t in input_list]
                self.pg.scatter([host_out], [srcs], o).wait(left)
            else:
                self.pg.scatter([host_out], [], o).wait(left)

    def gather(
        self,
        output_list: Sequence[torch.Tensor],
        input: torch.Tensor,
        root: int,
        deadline: Deadline,
    ) -> None:
        if input.numel() == 0:
            return
        o = c10d.GatherOptions()
        o.rootRank = root
        left = gloo.arm(o, deadline)
        src = input.detach().to("cpu").contiguous()
        if self.rank == root:
            staging = [torch.empty_like(src) for _ in range(self.size)]
            self.pg.gather([staging], [src], o).wait(left)
            for out, got in zip(output_list, staging, strict=True):
                out.copy_(got.view(out.shape))
        else:
            self.pg.gather([], [src], o).wait(left)

    # -- gathers -------------------------------------------------------------------------
    def all_gather(
        self, output_list: Sequence[torch.Tensor], input: torch.Tensor, deadline: Deadline
    ) -> None:
        n = input.numel()
        if n == 0:
            return
        flat = torch.empty(self.size * n, dtype=input.dtype)
        self._all_gather_flat(flat, input, deadline)
        for i, out in enumerate(output_list):
            out.copy_(flat[i * n : (i + 1) * n].view(out.shape))

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, deadline: Deadline
    ) -> None:
        if input.numel() == 0:
            return
        with on_host(output) as host_out:
            self._all_gather_flat(host_out.view(-1), input, deadline)

    def _all_gather_flat(self, flat: torch.Tensor, tensor: torch.Tensor, deadline: Deadline) -> None:
        o = c10d.AllgatherOptions()
        left = gloo.arm(o, deadline)
        src = tensor.detach().to("cpu").reshape(-1)
        self.pg._allgather_base(flat, src, o).wait(left)

    def all_gather_v(
        self, output_list: Sequence[torch.Tensor], input: torch.Tensor, deadline: Deadline
    ) -> None:
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
        if not in_splits and input.numel() == 0:
            return
        with on_host(output) as host_out:
            out = host_out.view(-1)
            src = input.detach().to("cpu").reshape(-1)
            if overlaps(out, src):
                src = src.clone()  # gloo reads the input while writing the output: never alias
            o = c10d.AllToAllOptions()
            left = gloo.arm(o, deadline)
            self.pg.alltoall_base(out, src, list(out_splits), list(in_splits), o).wait(left)

    def barrier(self, deadline: Deadline) -> None:
        o = c10d.BarrierOptions()
        left = gloo.arm(o, deadline)
        self.pg.barrier(o).wait(left)

    # -- point-to-point ------------------------------------------------------------------
    def post(self, ops: Sequence[P2POp], tag: int | None, deadline: Deadline) -> Completion:
        """Untagged messages use even gloo tags from a per-peer sequence number, tagged ones
        an odd tag of their own (see ``CpuOps.post``)."""
        posted = [self._post_one(op, tag) for op in ops]

        def complete() -> None:
            for work, op, staged in posted:
                work.wait(deadline.remaining())
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
