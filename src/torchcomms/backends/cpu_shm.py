"""The CPU backend's shared-memory path: segment set-up and the API-level op adapters.

``connect`` creates one segment per communicator (rank 0 creates it under a fresh random
name and publishes the name and sizes through the comm's store; every member maps it
and acknowledges; rank 0 then unlinks the file at once, so ``/dev/shm`` never keeps an
entry past initialisation, even if a process is killed later).  ``ShmOps`` turns the
API's arguments (tensor lists, split sizes, device tensors, AVG) into the flat-tensor
algorithms of ``shm_collectives`` and the rings of ``shm_p2p``.
"""

from __future__ import annotations

import platform
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch._C._distributed_c10d as c10d

from torchcomms import config
from torchcomms.backends._host import finish_average, host_flat, on_host, overlaps
from torchcomms.backends.shm_collectives import ShmCollectives
from torchcomms.transport import shm_segment
from torchcomms.transport.shm_channel import Layout, ShmChannel, WaitPolicy
from torchcomms.transport.shm_p2p import ShmP2P, Transfer
from torchcomms.types import P2POp, P2POpType, RedOpType, ReduceOp

_SUPPORTED_MACHINES = ("x86_64", "amd64", "i686", "i386")


def unsupported_reason() -> str | None:
    """Why this host cannot use the shm transport, or None when it can."""
    if platform.machine().lower() not in _SUPPORTED_MACHINES:
        return (
            f"the shm transport relies on x86 store ordering; this machine is {platform.machine()}"
        )
    if not shm_segment.available():
        return "/dev/shm is missing or not writable"
    return None


def _pair_bytes(size: int, configured: int | None) -> int:
    if configured is not None:
        return configured
    # 1 MiB per ring slot for small worlds, shrinking so n*n rings stay near 64 MiB.
    per = (64 << 20) // max(size * size * 2, 1)
    return max(64 << 10, min(1 << 20, per)) // 4096 * 4096


def _oneshot_max(size: int, slot: int) -> int:
    """Where all_reduce switches from one-shot to reduce-scatter + all-gather (per chunk).

    Measured with the bench on 2 cores (see README): with two ranks one-shot wins at every
    size (its one round beats two), so every slot-sized chunk goes one-shot; with more
    ranks the switch lies between 64 KiB and 256 KiB.
    """
    return slot if size <= 2 else ONESHOT_MAX_MANY


#: The one-shot limit for three or more ranks (bytes).
ONESHOT_MAX_MANY = 128 << 10


def connect(
    store: c10d.Store,
    rank: int,
    size: int,
    pids: Sequence[int],
    hints: dict[str, str],
    timeout: timedelta,
    describe: str,
) -> ShmOps:
    """Create (rank 0) or map (others) the communicator's segment; see the module docstring."""
    # Every rank validates the settings (rank 0's values are used), so a bad value fails
    # everywhere at once instead of leaving the other ranks waiting for a segment.
    slot = config.shm_slot_bytes(hints.get("shm_slot_bytes"))
    configured = config.shm_oneshot_max(hints.get("shm_oneshot_max"))
    oneshot = _oneshot_max(size, slot) if configured is None else configured
    pair = _pair_bytes(size, config.shm_pair_bytes(hints.get("shm_pair_bytes")))
    if rank == 0:
        shm_segment.sweep_stale()
        layout = Layout(size, slot, pair)
        name = shm_segment.new_name()
        mm = shm_segment.create(name, layout.total)
        store.set("shm/segment", f"{name}\n{slot}\n{pair}\n{oneshot}")
    else:
        store.wait(["shm/segment"], timeout)
        name, slot_text, pair_text, oneshot_text = store.get("shm/segment").decode().split("\n")
        slot, pair, oneshot = int(slot_text), int(pair_text), int(oneshot_text)
        layout = Layout(size, slot, pair)
        mm = shm_segment.attach(name, layout.total)
    try:
        store.set(f"shm/mapped/{rank}", "1")
        if rank == 0:
            try:
                store.wait([f"shm/mapped/{r}" for r in range(size)], timeout)
            finally:
                shm_segment.unlink(name)
    except BaseException:
        mm.close()
        raise
    chan = ShmChannel(mm, layout, rank, pids, WaitPolicy(size), describe)
    return ShmOps(chan, oneshot)


class ShmOps:
    """API-level collectives and point-to-point over one channel (flat CPU tensors inside)."""

    def __init__(self, chan: ShmChannel, oneshot_max: int) -> None:
        self.chan = chan
        self.coll = ShmCollectives(chan, oneshot_max)
        self.p2p = ShmP2P(chan)
        self.size = chan.size
        self.rank = chan.rank

    def describe(self) -> str:
        policy = self.chan.policy
        wait = (
            "yield/sleep (more ranks than cores)" if policy.oversubscribed else "spin/yield/sleep"
        )
        return (
            f"shm ({self.size} rank{'s' if self.size > 1 else ''} on this host, "
            f"{self.chan.layout.slot_bytes >> 10} KiB slots, waits {wait})"
        )

    def close(self, state: int) -> None:
        self.chan.close(state)

    # -- reductions ----------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, end: float) -> None:
        if tensor.is_cpu and op.type is not RedOpType.AVG:  # the hot path: no staging
            if tensor.numel():
                self.coll.all_reduce(tensor if tensor.dim() == 1 else tensor.view(-1), op, end)
            return
        if tensor.numel() == 0:
            return
        with on_host(tensor) as host:
            flat = host.view(-1)
            self.coll.all_reduce(flat, op, end)
            finish_average(flat, op, self.size)

    def reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp, end: float) -> None:
        if tensor.numel() == 0:
            return
        if self.rank != root:
            self.coll.reduce(host_flat(tensor), root, op, end)
            return
        with on_host(tensor) as host:
            flat = host.view(-1)
            self.coll.reduce(flat, root, op, end)
            finish_average(flat, op, self.size)

    def reduce_scatter(
        self, output: torch.Tensor, inputs: torch.Tensor, op: ReduceOp, end: float
    ) -> None:
        """``inputs``: a flat CPU tensor of ``size * output.numel()`` elements."""
        if output.numel() == 0:
            return
        if output.is_cpu and op.type is not RedOpType.AVG:
            self.coll.reduce_scatter(output.view(-1), inputs.view(self.size, -1), op, end)
            return
        with on_host(output) as host:
            flat = host.view(-1)
            self.coll.reduce_scatter(flat, inputs.view(self.size, -1), op, end)
            finish_average(flat, op, self.size)

    def reduce_scatter_v(
        self, output: torch.Tensor, inputs: Sequence[torch.Tensor], op: ReduceOp, end: float
    ) -> None:
        with on_host(output) as host:
            flat = host.view(-1)
            self.coll.reduce_scatter_v(flat, [host_flat(t) for t in inputs], op, end)
            finish_average(flat, op, self.size)

    # -- rooted --------------------------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, root: int, end: float) -> None:
        if tensor.numel() == 0:
            return
        if tensor.is_cpu:
            self.coll.broadcast(tensor.view(-1), root, end)
            return
        with on_host(tensor) as host:
            self.coll.broadcast(host.view(-1), root, end)

    def scatter(
        self, output: torch.Tensor, inputs: Sequence[torch.Tensor], root: int, end: float
    ) -> None:
        if output.numel() == 0:
            return
        srcs = [host_flat(t) for t in inputs] if self.rank == root else []
        with on_host(output) as host:
            self.coll.scatter(host.view(-1), srcs, root, end)

    def gather(
        self, outputs: Sequence[torch.Tensor], inp: torch.Tensor, root: int, end: float
    ) -> None:
        if inp.numel() == 0:
            return
        if self.rank != root:
            self.coll.gather([], host_flat(inp), root, end)
            return
        stages = [on_host(o) for o in outputs]
        hosts = [s.__enter__().view(-1) for s in stages]
        self.coll.gather(hosts, host_flat(inp), root, end)
        for s in stages:
            s.__exit__(None, None, None)

    # -- all to all ------------------------------------------------------------------------
    def all_gather_flat(self, output: torch.Tensor, inp: torch.Tensor, end: float) -> None:
        """``output`` holds ``size`` copies' worth of elements, rank order."""
        if inp.numel() == 0:
            return
        src = host_flat(inp)
        if output.is_cpu and not overlaps(output, src):
            self.coll.all_gather(output.view(self.size, -1), src, end)
            return
        with on_host(output) as host:
            if overlaps(host, src):
                src = src.clone()
            self.coll.all_gather(host.view(self.size, -1), src, end)

    def all_gather_list(
        self, outputs: Sequence[torch.Tensor], inp: torch.Tensor, end: float
    ) -> None:
        if inp.numel() == 0:
            return
        flat = torch.empty(self.size * inp.numel(), dtype=inp.dtype)
        self.coll.all_gather(flat.view(self.size, -1), host_flat(inp), end)
        for r, out in enumerate(outputs):
            out.copy_(flat[r * inp.numel() : (r + 1) * inp.numel()].view(out.shape))

    def all_gather_v(self, outputs: Sequence[torch.Tensor], inp: torch.Tensor, end: float) -> None:
        src = host_flat(inp)
        if any(overlaps(o, src) for o in outputs if o.device.type == "cpu"):
            src = src.clone()
        stages = [on_host(o) for o in outputs]
        hosts = [s.__enter__().view(-1) for s in stages]
        self.coll.all_gather_v(hosts, src, end)
        for s in stages:
            s.__exit__(None, None, None)

    def all_to_all_flat(
        self,
        output: torch.Tensor,
        inp: torch.Tensor,
        out_splits: Sequence[int],
        in_splits: Sequence[int],
        end: float,
    ) -> None:
        """Flat element counts per peer; empty splits mean equal parts."""
        src = host_flat(inp)
        with on_host(output) as host:
            out = host.view(-1)
            if not in_splits:
                n = src.numel() // self.size
                in_splits = out_splits = [n] * self.size
                if n == 0:
                    return
            even = len(set(in_splits)) == 1 and list(in_splits) == list(out_splits)
            same = out.data_ptr() == src.data_ptr() and out.numel() == src.numel()
            if overlaps(out, src) and not (even and same):
                src = src.clone()
            self.coll.all_to_all(out, src, out_splits, in_splits, end)

    def barrier(self, end: float) -> None:
        self.coll.barrier(end)

    # -- point-to-point ----------------------------------------------------------------------
    def post(
        self, ops: Sequence[P2POp], tag: int | None
    ) -> list[tuple[Transfer, P2POp, torch.Tensor]]:
        """Post without blocking; the returned handles go to ``complete``."""
        posted = []
        for op in ops:
            sending = op.type is P2POpType.SEND
            staged = op.tensor if op.tensor.device.type == "cpu" else op.tensor.detach().to("cpu")
            posted.append((self.p2p.post(sending, op.peer, staged, tag), op, staged))
        return posted

    def complete(self, posted: list[tuple[Transfer, P2POp, torch.Tensor]], end: float) -> None:
        self.p2p.wait([t for t, _, _ in posted], end)
        for _, op, staged in posted:
            if staged is not op.tensor and op.type is P2POpType.RECV:
                op.tensor.copy_(staged)
