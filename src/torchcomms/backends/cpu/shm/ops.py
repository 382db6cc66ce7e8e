"""``ShmOps``: every op of the CPU backend over shared memory (every member on this host).

``open_collectives`` sets up one segment per communicator (rank 0 creates it under a
fresh random name and publishes the name and sizes through the comm's store; every
member maps it and acknowledges; rank 0 then unlinks the file at once, so ``/dev/shm``
never keeps an entry past initialisation, even if a process is killed later) and returns
the flat-tensor algorithms over it.  ``ShmOps`` turns the API's arguments (tensor lists,
split sizes, device tensors, AVG) into those algorithms (``cpu.shm.collectives``) and the
rings of ``transport.shm.p2p``.  The hierarchical path (``cpu.hier.ops``) builds on
``open_collectives`` too.  Runs on the op's thread (see ``cpu.ops``).
"""

from __future__ import annotations

import platform
from collections.abc import Mapping, Sequence
from datetime import timedelta

import torch
import torch._C._distributed_c10d as c10d

from torchcomms import config
from torchcomms.backends.cpu import connect as cpu_connect
from torchcomms.backends.cpu import host_arrays
from torchcomms.backends.cpu.ops import Completion, CpuOps
from torchcomms.backends.cpu.shm.collectives import ShmCollectives
from torchcomms.backends.cpu.staging import (
    all_on_host,
    host_flat,
    on_host,
    overlaps,
    reduced_on_host,
)
from torchcomms.errors import CommError
from torchcomms.runtime import fingerprint as F
from torchcomms.runtime.deadline import Deadline
from torchcomms.transport.shm import segment as shm_segment
from torchcomms.transport.shm.channel import (
    STATE_FAILED,
    STATE_FINALIZED,
    STATE_TIMED_OUT,
    ShmChannel,
)
from torchcomms.transport.shm.layout import Layout, pid_words
from torchcomms.transport.shm.p2p import ShmP2P, Transfer
from torchcomms.transport.wait_policy import WaitPolicy
from torchcomms.types import P2POp, P2POpType, RedOpType, ReduceOp

_SUPPORTED_MACHINES = ("x86_64", "amd64", "i686", "i386")
_AVG = RedOpType.AVG
_NO_BYTES = memoryview(bytearray())


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


def open_collectives(
    store: c10d.Store,
    rank: int,
    size: int,
    pids: Mapping[int, int],
    hints: dict[str, str],
    timeout: timedelta,
    describe: str,
) -> ShmCollectives:
    """Create (rank 0) or map (others) a segment for ``size`` members; see the module docstring.

    Collective over the members; ``describe`` (``comm=NAME``) prefixes wait errors.
    ``pids``: the members' pids this rank knows: all of them on rank 0, which records them
    in the segment, where the others read them (``chan.pids``); rank 0's at least elsewhere.
    """
    # Every rank validates the settings (rank 0's values are used), so a bad value fails
    # everywhere at once instead of leaving the other ranks waiting for a segment.
    slot = config.shm_slot_bytes(hints.get("shm_slot_bytes"))
    configured = config.shm_oneshot_max(hints.get("shm_oneshot_max"))
    oneshot = _oneshot_max(size, slot) if configured is None else configured
    pair = _pair_bytes(size, config.shm_pair_bytes(hints.get("shm_pair_bytes")))
    deadline = Deadline(timeout)
    local_pids = {r: pid for r, pid in pids.items() if r != rank}
    prefix = f"[TorchCommGloo {describe} rank={rank}] new_comm: "
    what = "the shm set-up"
    if rank == 0:
        shm_segment.sweep_stale()
        layout = Layout(size, slot, pair)
        name = shm_segment.new_name()
        mm = shm_segment.create(name, layout.total)
        with memoryview(mm).cast("q") as words:  # the members read them there
            for r, word in enumerate(pid_words(layout)):
                words[word] = pids[r]
        store.set("shm/segment", f"{name}\n{slot}\n{pair}\n{oneshot}")
    else:
        cpu_connect.wait_keys(store, {"shm/segment": 0}, deadline, local_pids, prefix, what)
        name, slot_text, pair_text, oneshot_text = store.get("shm/segment").decode().split("\n")
        slot, pair, oneshot = int(slot_text), int(pair_text), int(oneshot_text)
        layout = Layout(size, slot, pair)
        try:
            mm = shm_segment.attach(name, layout.total)
        except FileNotFoundError:  # rank 0 gave up and unlinked it: say why, if it says
            try:
                cpu_connect.wait_keys(
                    store, {"shm/failed": 0}, Deadline(timedelta(seconds=1)), {}, prefix, what
                )
            except CommError:
                raise FileNotFoundError(f"{prefix}shm segment {name} vanished") from None
            raise cpu_connect.failure_from(store.get("shm/failed").decode(), prefix, what) from None
    try:
        store.set(f"shm/mapped/{rank}", "1")
        if rank == 0:
            try:
                mapped = {f"shm/mapped/{r}": r for r in range(size)}
                cpu_connect.wait_keys(store, mapped, deadline, local_pids, prefix, what)
            except CommError as exc:
                cpu_connect.publish_failure(store, "shm/failed", exc)
                raise
            finally:
                shm_segment.unlink(name)
    except BaseException:
        mm.close()
        raise
    with memoryview(mm).cast("q") as words:
        every_pid = [int(words[word]) for word in pid_words(layout)]
    chan = ShmChannel(mm, layout, rank, every_pid, WaitPolicy(size, pids=every_pid), describe)
    return ShmCollectives(chan, oneshot, config.mismatch_check())


class ShmOps(CpuOps):
    """API-level collectives and point-to-point over one segment (flat CPU tensors inside)."""

    def __init__(self, coll: ShmCollectives) -> None:
        self.chan = coll.chan
        self.coll = coll
        rendezvous = config.shm_p2p_rendezvous()  # read when the communicator is made
        self.p2p = ShmP2P(coll.chan, lambda: rendezvous and coll.single.usable is True)
        self._user_bytes = host_arrays.UserBytes()
        self.size = coll.size
        self.rank = coll.rank

    def describe(self) -> str:
        policy = self.chan.policy
        wait = (
            "yield/sleep (more ranks than cores)" if policy.oversubscribed else "spin/yield/sleep"
        )
        return (
            f"shm ({self.size} rank{'s' if self.size > 1 else ''} on this host, "
            f"{self.chan.layout.slot_bytes >> 10} KiB slots, waits {wait})"
        )

    def fail(
        self, dead: Sequence[int] = (), missing: Sequence[int] = (), blamed: Sequence[int] = ()
    ) -> None:
        if dead or not missing:
            self.chan.set_state(STATE_FAILED, dead)
        else:
            self.chan.set_state(STATE_TIMED_OUT, missing)

    def abort(self) -> None:
        self.chan.abort()

    def close(self, failed: bool) -> None:
        self.chan.close(STATE_FAILED if failed else STATE_FINALIZED)

    # -- reductions ----------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, deadline: Deadline) -> None:
        if tensor.is_cpu and op._type is not _AVG:  # the hot path: no staging
            if tensor.numel():
                self.coll.all_reduce(tensor if tensor.dim() == 1 else tensor.view(-1), op, deadline)
            else:
                self.coll.empty(F.ALL_REDUCE, tensor.dtype, deadline, redop=op)
            return
        if tensor.numel() == 0:
            self.coll.empty(F.ALL_REDUCE, tensor.dtype, deadline, redop=op)
            return
        with reduced_on_host(tensor, op, self.size) as flat:
            self.coll.all_reduce(flat, op, deadline)

    def reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp, deadline: Deadline) -> None:
        if tensor.is_cpu and op._type is not _AVG and tensor.numel():  # the hot path
            self.coll.reduce(tensor if tensor.dim() == 1 else tensor.view(-1), root, op, deadline)
            return
        if tensor.numel() == 0:
            self.coll.empty(F.REDUCE, tensor.dtype, deadline, root, op)
            return
        if self.rank != root:
            self.coll.reduce(host_flat(tensor), root, op, deadline)
            return
        with reduced_on_host(tensor, op, self.size) as flat:
            self.coll.reduce(flat, root, op, deadline)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, deadline: Deadline
    ) -> None:
        """``input`` holds ``size * output.numel()`` elements, rank ``r``'s part at row ``r``."""
        if output.numel() == 0:
            self.coll.empty(F.REDUCE_SCATTER, output.dtype, deadline, redop=op)
            return
        rows = host_flat(input).view(self.size, -1)
        if output.is_cpu and op._type is not _AVG:
            self.coll.reduce_scatter(output.view(-1), rows, op, deadline)
            return
        with reduced_on_host(output, op, self.size) as flat:
            self.coll.reduce_scatter(flat, rows, op, deadline)

    def reduce_scatter_v(
        self,
        output: torch.Tensor,
        input_list: Sequence[torch.Tensor],
        op: ReduceOp,
        deadline: Deadline,
    ) -> None:
        with reduced_on_host(output, op, self.size) as flat:
            self.coll.reduce_scatter_v(flat, [host_flat(t) for t in input_list], op, deadline)

    #: Equal parts are a case of the variable-size exchange.
    reduce_scatter = reduce_scatter_v

    # -- rooted --------------------------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, root: int, deadline: Deadline) -> None:
        if tensor.numel() == 0:
            self.coll.empty(F.BROADCAST, tensor.dtype, deadline, root)
            return
        if tensor.is_cpu:
            self.coll.broadcast(tensor if tensor.dim() == 1 else tensor.view(-1), root, deadline)
            return
        with on_host(tensor) as host:
            self.coll.broadcast(host.view(-1), root, deadline)

    def scatter(
        self,
        output: torch.Tensor,
        input_list: Sequence[torch.Tensor],
        root: int,
        deadline: Deadline,
    ) -> None:
        if output.numel() == 0:
            self.coll.empty(F.SCATTER, output.dtype, deadline, root)
            return
        srcs = [host_flat(t) for t in input_list] if self.rank == root else []
        with on_host(output) as host:
            self.coll.scatter(host.view(-1), srcs, root, deadline)

    def gather(
        self,
        output_list: Sequence[torch.Tensor],
        input: torch.Tensor,
        root: int,
        deadline: Deadline,
    ) -> None:
        if input.numel() == 0:
            self.coll.empty(F.GATHER, input.dtype, deadline, root)
            return
        if self.rank != root:
            self.coll.gather([], host_flat(input), root, deadline)
            return
        with all_on_host(output_list) as hosts:
            self.coll.gather(hosts, host_flat(input), root, deadline)

    # -- all to all ------------------------------------------------------------------------
    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, deadline: Deadline
    ) -> None:
        """``output`` holds ``size`` copies' worth of elements, rank order."""
        if input.numel() == 0:
            self.coll.empty(F.ALL_GATHER, input.dtype, deadline)
            return
        src = host_flat(input)
        if output.is_cpu and (not overlaps(output, src) or _own_row(output, src, self.rank)):
            # In place (``input`` is this rank's row of ``output``) needs no copy: both paths
            # read a row of this rank's input before anything writes that row.
            self.coll.all_gather(output.view(self.size, -1), src, deadline)
            return
        with on_host(output) as host:
            if overlaps(host, src):
                src = src.clone()
            self.coll.all_gather(host.view(self.size, -1), src, deadline)

    def all_gather(
        self, output_list: Sequence[torch.Tensor], input: torch.Tensor, deadline: Deadline
    ) -> None:
        n = input.numel()
        if n == 0:
            self.coll.empty(F.ALL_GATHER, input.dtype, deadline)
            return
        flat = torch.empty(self.size * n, dtype=input.dtype)
        self.coll.all_gather(flat.view(self.size, -1), host_flat(input), deadline)
        for r, out in enumerate(output_list):
            out.copy_(flat[r * n : (r + 1) * n].view(out.shape))

    def all_gather_v(
        self, output_list: Sequence[torch.Tensor], input: torch.Tensor, deadline: Deadline
    ) -> None:
        src = host_flat(input)
        if any(overlaps(o, src) for o in output_list if o.is_cpu):
            src = src.clone()
        with all_on_host(output_list) as hosts:
            self.coll.all_gather_v(hosts, src, deadline)

    def all_to_all_flat(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        out_splits: Sequence[int],
        in_splits: Sequence[int],
        deadline: Deadline,
    ) -> None:
        src = host_flat(input)
        with on_host(output) as host:
            out = host.view(-1)
            # Equal parts only for the call that has no splits: splits that happen to be
            # equal on this rank may not be on another, and every rank must take one path.
            uniform = not in_splits
            if uniform:
                n = src.numel() // self.size
                in_splits = out_splits = [n] * self.size
                if n == 0:
                    self.coll.empty(F.ALL_TO_ALL, src.dtype, deadline)
                    return
            same = out.data_ptr() == src.data_ptr() and out.numel() == src.numel()
            if overlaps(out, src) and not (uniform and same):
                src = src.clone()
            self.coll.all_to_all(out, src, out_splits, in_splits, uniform, deadline)

    def barrier(self, deadline: Deadline) -> None:
        self.coll.barrier(deadline)

    # -- point-to-point ----------------------------------------------------------------------
    def transfer(self, sending: bool, tensor: torch.Tensor, peer: int, deadline: Deadline) -> None:
        staged = tensor if tensor.is_cpu else tensor.detach().to("cpu")
        p2p = self.p2p
        if staged.is_contiguous():  # the direct path first (``transport.shm.p2p``)
            data = self._user_bytes.of(staged) if staged.nbytes else _NO_BYTES
            if sending:
                if p2p.send_now(peer, data):
                    return
            elif p2p.recv_now(peer, data, deadline):
                if staged is tensor:
                    host_arrays.mark_written((tensor,))
                else:
                    tensor.copy_(staged)
                return
        p2p.wait([p2p.post(sending, peer, staged, None)], deadline)
        if staged is not tensor and not sending:
            tensor.copy_(staged)

    def post(self, ops: Sequence[P2POp], tag: int | None, deadline: Deadline) -> Completion:
        posted: list[tuple[Transfer, P2POp, torch.Tensor]] = []
        for op in ops:
            sending = op.type is P2POpType.SEND
            staged = op.tensor if op.tensor.is_cpu else op.tensor.detach().to("cpu")
            posted.append((self.p2p.post(sending, op.peer, staged, tag), op, staged))

        def complete() -> None:
            self.p2p.wait([t for t, _, _ in posted], deadline)
            for _, op, staged in posted:
                if staged is not op.tensor and op.type is P2POpType.RECV:
                    op.tensor.copy_(staged)

        return complete


def _own_row(output: torch.Tensor, src: torch.Tensor, rank: int) -> bool:
    """Whether ``src`` is exactly row ``rank`` of the flat, contiguous ``output``."""
    n = src.numel()
    return (
        output.is_contiguous()
        and output.numel() >= (rank + 1) * n
        and src.data_ptr() == output.data_ptr() + rank * n * src.element_size()
        and src.dtype == output.dtype
    )
