"""``CpuWindow``: one-sided windows of the CPU backend, shm to same-host peers, TCP to the rest.

Registration (collective, on the op thread, in issue order): the rank's window memory is
created (``transport.window.memory``: a 0600 ``/dev/shm`` segment when a same-host peer will
map it, else an anonymous mapping), the registered tensor's values are copied in and the
tensor is rebound onto it (``Tensor.set_``), so the caller's tensor *is* the window; then
the members exchange what they registered (an ``all_gather_single`` of a small record:
segment name, dtype, shape, server address), attach their same-host peers' segments,
meet in a barrier and unlink their own segment (every peer has mapped it: nothing is left
for the sweeper).  Deregistration flushes the links (every put and signal sent to a peer
has been applied), meets in a barrier, then rebinds the tensor onto private memory holding
the window's final values.

Per peer, an op is one of: a local copy (self), a copy into or out of the peer's mapped
segment plus a counter store (same host, ``UNIFIED``), or a frame on the link to the
peer's window server (``transport.window.tcp``, ``SEPARATE``).  Hosts are the members'
host identities (``TORCHCOMM_HOST_ID`` simulates them); ``transport=tcp`` makes every peer
``SEPARATE``.

Failures of window ops (a timeout, a dead peer) raise typed errors naming the peer but do
not fail the communicator: a window op involves one peer, and the comm's collectives find
out about a dead member by themselves.  A failed registration collective does (it runs
the comm's own all_gather and barrier).
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from torchcomms.backends.cpu.ops import Completion, CpuOps
from torchcomms.backends.cpu.window.net import WindowNet
from torchcomms.backends.window_contract import WindowBackend
from torchcomms.errors import CommError, CommTimeoutError, PeerFailureError
from torchcomms.runtime.deadline import Deadline
from torchcomms.runtime.work import TorchWork
from torchcomms.transport.procs import process_alive
from torchcomms.transport.wait_policy import WaitPolicy
from torchcomms.transport.window.memory import WindowMemory
from torchcomms.transport.window.tcp import LinkError, PeerLink
from torchcomms.types import OpOptions, TorchCommWinAccessType

#: Bytes of one member's registration record.
_RECORD = 512
_UNIFIED = TorchCommWinAccessType.WIN_ACCESS_TYPE_UNIFIED
_SEPARATE = TorchCommWinAccessType.WIN_ACCESS_TYPE_SEPARATE
_FLUSH, _GET, _SIGNAL = "to apply earlier puts (flush)", "to answer a get", "to signal"

Body = Callable[[Deadline], "Completion | None"]
Run = Callable[[OpOptions, bool, Body, tuple[()], Sequence[int]], TorchWork]


@dataclass
class WindowContext:
    """What a window needs from its communicator (``TorchCommGloo`` fills it)."""

    rank: int
    size: int
    pids: list[int]
    #: Per member: reached through shared memory (same host, shm allowed).
    unified: list[bool]
    run: Run
    prefix: Callable[[OpOptions], str]
    ops: Callable[[], CpuOps]
    net: Callable[[], WindowNet]


def _dtype(text: str) -> torch.dtype:
    value = getattr(torch, text.rpartition(".")[2], None)
    if not isinstance(value, torch.dtype):
        raise CommError(f"a peer registered an unknown dtype {text!r}")
    return value


def _bytes_of(t: torch.Tensor) -> memoryview:
    return t.reshape(-1).view(torch.uint8).numpy().data


class _Registration:
    """What one registration holds: this rank's memory, peers' metadata and mappings."""

    def __init__(self, mem: WindowMemory, tensor: torch.Tensor, owning: bool) -> None:
        self.mem = mem
        self.dtype = tensor.dtype
        self.shape = tuple(tensor.shape)
        self.numel = tensor.numel()
        self.strong: torch.Tensor | None = tensor if owning else None
        self.weak = weakref.ref(tensor)
        self.metas: list[tuple[torch.dtype, tuple[int, ...]]] = []
        self.peers: dict[int, WindowMemory] = {}  # same-host peers' mappings
        self.links: dict[int, PeerLink] = {}  # other-host peers
        self.consumed: list[int] = []

    def typed(self, rank: int) -> torch.Tensor:
        """``rank``'s whole window as a flat tensor of its dtype (self or same-host)."""
        dtype, shape = self.metas[rank]
        return self.peers.get(rank, self.mem).typed(dtype)[: _numel(shape)]


class CpuWindow(WindowBackend):
    """One window of a ``TorchCommGloo`` (module docstring); ops run on the comm's op thread."""

    def __init__(self, ctx: WindowContext, window_id: int) -> None:
        self._ctx = ctx
        self._id = window_id
        self._reg: _Registration | None = None
        self._policy = WaitPolicy(
            sum(ctx.unified), pids=[pid for pid, u in zip(ctx.pids, ctx.unified, strict=True) if u]
        )

    # -- registration ----------------------------------------------------------------------
    def register(self, tensor: torch.Tensor, owning: bool, options: OpOptions) -> torch.Tensor:
        ctx = self._ctx
        rank = ctx.rank
        shared = any(u for r, u in enumerate(ctx.unified) if r != rank)
        remote = [r for r in range(ctx.size) if r != rank and not ctx.unified[r]]

        def body(deadline: Deadline) -> None:
            mem = WindowMemory.create(ctx.size, tensor.numel() * tensor.element_size(), shared)
            try:
                self._register(mem, tensor, owning, remote, deadline)
            except BaseException:
                mem.release()
                raise

        ctx.run(options, False, body, (), ())
        return tensor

    def _register(
        self,
        mem: WindowMemory,
        tensor: torch.Tensor,
        owning: bool,
        remote: list[int],
        deadline: Deadline,
    ) -> None:
        ctx = self._ctx
        reg = _Registration(mem, tensor, owning)
        window = mem.typed(tensor.dtype)[: tensor.numel()]
        window.copy_(tensor.reshape(-1))
        record: dict[str, object] = {
            "seg": mem.name,
            "dtype": str(tensor.dtype),
            "shape": list(tensor.shape),
        }
        net = ctx.net() if remote else None
        if net is not None:
            net.server.add(self._id, mem.data, mem.signals)
            record.update(net.address())
        records = self._exchange(record, deadline)
        reg.metas = [(_dtype(str(r["dtype"])), tuple(r["shape"])) for r in records]  # type: ignore[arg-type]
        reg.consumed = [0] * ctx.size
        try:
            for r, rec in enumerate(records):
                if r == ctx.rank:
                    continue
                dtype, shape = reg.metas[r]
                nbytes = dtype.itemsize * _numel(shape)
                if ctx.unified[r]:
                    reg.peers[r] = WindowMemory.attach(str(rec["seg"]), ctx.size, nbytes)
                elif net is not None:
                    reg.links[r] = net.link(r, rec, deadline)
            ctx.ops().barrier(deadline)  # every peer mapped this rank's segment
        except BaseException:
            if net is not None:
                net.server.remove(self._id)
            for peer_mem in reg.peers.values():
                peer_mem.release()
            raise
        mem.unlink()
        # The caller's tensor becomes the window: later reads see what peers put.
        tensor.set_(
            window.untyped_storage(), window.storage_offset(), tensor.shape, tensor.stride()
        )
        self._reg = reg

    def _exchange(self, record: dict[str, object], deadline: Deadline) -> list[dict[str, object]]:
        ctx = self._ctx
        raw = json.dumps(record).encode()
        if len(raw) > _RECORD:
            raise CommError(f"window registration record too long ({len(raw)} B)")
        mine = torch.zeros(_RECORD, dtype=torch.uint8)
        mine[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        every = torch.zeros(ctx.size * _RECORD, dtype=torch.uint8)
        ctx.ops().all_gather_single(every, mine, deadline)
        out = []
        for r in range(ctx.size):
            chunk = bytes(every[r * _RECORD : (r + 1) * _RECORD].tolist()).rstrip(b"\0")
            out.append(json.loads(chunk.decode()))
        return out

    def deregister(self, options: OpOptions) -> None:
        ctx = self._ctx
        reg = self._reg
        assert reg is not None

        def body(deadline: Deadline) -> None:
            prefix = ctx.prefix(options)
            for peer, link in reg.links.items():

                def flush(peer: int = peer, link: PeerLink = link) -> None:
                    link.flush(deadline.left_s, lambda: self._check(peer, deadline, prefix, _FLUSH))

                self._guard(peer, deadline, prefix, _FLUSH, flush)
            ctx.ops().barrier(deadline)  # no peer sends to this window any more

        ctx.run(options, False, body, (), ())
        if reg.links:
            ctx.net().server.remove(self._id)
        self._reg = None
        user = reg.weak()
        if user is not None:
            private = user.detach().clone()
            user.set_(private.untyped_storage(), 0, private.shape, private.stride())
        for mem in reg.peers.values():
            mem.release()
        reg.mem.release()

    # -- what the validation reads ---------------------------------------------------------
    def meta(self, rank: int) -> tuple[torch.dtype, tuple[int, ...]]:
        assert self._reg is not None
        return self._reg.metas[rank]

    def access_type(self, rank: int) -> TorchCommWinAccessType:
        return _UNIFIED if rank == self._ctx.rank or self._ctx.unified[rank] else _SEPARATE

    def remote_tensor(self, rank: int) -> torch.Tensor:
        reg = self._reg
        assert reg is not None
        if rank == self._ctx.rank:
            return self._own(reg).view(reg.shape)
        return reg.typed(rank).view(reg.metas[rank][1])

    def registered_tensor(self) -> torch.Tensor | None:
        reg = self._reg
        return None if reg is None else reg.strong

    # -- operations --------------------------------------------------------------------------
    def put(
        self, tensor: torch.Tensor, dst: int, offset: int, async_op: bool, options: OpOptions
    ) -> TorchWork:
        reg = self._live()

        def body(deadline: Deadline) -> None:
            target = self._mapped(reg, dst)
            if target is not None:
                target[offset : offset + tensor.numel()].copy_(tensor.reshape(-1))
                return
            link = reg.links[dst]
            start = offset * tensor.element_size()
            self._guard(
                dst,
                deadline,
                self._ctx.prefix(options),
                "to take a put",
                lambda: link.put(self._id, start, _bytes_of(tensor), deadline.left_s()),
            )

        return self._ctx.run(options, async_op, body, (), (dst,))

    def get(
        self, tensor: torch.Tensor, src: int, offset: int, async_op: bool, options: OpOptions
    ) -> TorchWork:
        reg = self._live()

        def body(deadline: Deadline) -> None:
            source = self._mapped(reg, src)
            if source is not None:
                tensor.reshape(-1).copy_(source[offset : offset + tensor.numel()])
                return
            link = reg.links[src]
            start = offset * tensor.element_size()
            into = _bytes_of(tensor)
            prefix = self._ctx.prefix(options)

            def call() -> None:
                ok = link.get(
                    self._id,
                    start,
                    into,
                    deadline.left_s,
                    lambda: self._check(src, deadline, prefix, _GET),
                )
                if not ok:
                    raise CommError(
                        f"{prefix}peer rank {src} has no such window registered (deregistered?)"
                    )

            self._guard(src, deadline, prefix, _GET, call)

        return self._ctx.run(options, async_op, body, (), (src,))

    def signal(self, peer: int, async_op: bool, options: OpOptions) -> TorchWork:
        reg = self._live()
        me = self._ctx.rank

        def body(deadline: Deadline) -> None:
            if peer == me:
                reg.mem.signals.bump(me)
            elif peer in reg.peers:
                reg.peers[peer].signals.bump(me)
            else:
                link = reg.links[peer]
                self._guard(
                    peer,
                    deadline,
                    self._ctx.prefix(options),
                    "to take a signal",
                    lambda: link.signal(self._id, deadline.left_s()),
                )

        return self._ctx.run(options, async_op, body, (), (peer,))

    def wait_signal(self, peer: int, async_op: bool, options: OpOptions) -> TorchWork:
        reg = self._live()

        def body(deadline: Deadline) -> None:
            want = reg.consumed[peer] + 1
            prefix = self._ctx.prefix(options)
            reg.mem.signals.wait(
                peer, want, self._policy, lambda: self._check(peer, deadline, prefix, _SIGNAL)
            )
            reg.consumed[peer] = want

        return self._ctx.run(options, async_op, body, (), (peer,))

    # -- helpers -----------------------------------------------------------------------------
    def _own(self, reg: _Registration) -> torch.Tensor:
        return reg.mem.typed(reg.dtype)[: reg.numel]

    def _mapped(self, reg: _Registration, rank: int) -> torch.Tensor | None:
        """``rank``'s window, flat, where this process maps it (its own, or a same-host
        peer's); None where it is reached through its link."""
        if rank == self._ctx.rank:
            return self._own(reg)
        return reg.typed(rank) if rank in reg.peers else None

    def _live(self) -> _Registration:
        reg = self._reg
        assert reg is not None  # TorchCommWindow refuses ops on an unregistered window
        return reg

    def _check(self, peer: int, deadline: Deadline, prefix: str, what: str) -> None:
        """Raise if ``peer`` is gone or the deadline passed (between wait slices)."""
        ctx = self._ctx
        if ctx.unified[peer] or peer == ctx.rank:
            dead = not process_alive(ctx.pids[peer])
            left = False
        else:
            net = ctx.net()
            dead = peer in net.server.dead or peer in ctx.ops().dead_peers()
            left = peer in net.server.left
        if dead:
            error: CommError = PeerFailureError(
                f"{prefix}peer rank {peer} died (process gone) while this rank waited for it {what}"
            )
            error.ranks = error.dead_ranks = (peer,)
            raise error
        if left:
            error = PeerFailureError(
                f"{prefix}peer rank {peer} finalized the communicator while this rank waited "
                f"for it {what}"
            )
            error.ranks = (peer,)
            raise error
        if deadline.passed():
            error = CommTimeoutError(
                f"{prefix}timed out after {deadline.timeout.total_seconds():g} s waiting for "
                f"peer rank {peer} {what}"
            )
            error.ranks = (peer,)
            raise error

    def _guard(
        self, peer: int, deadline: Deadline, prefix: str, what: str, call: Callable[[], None]
    ) -> None:
        """Run a link call; a broken link becomes the typed error naming ``peer``."""
        try:
            call()
        except LinkError as exc:
            self._check(peer, deadline, prefix, what)  # dead or timed out: say that
            kind = CommTimeoutError if exc.kind == "timeout" else PeerFailureError
            error = kind(
                f"{prefix}the link to peer rank {peer} failed while waiting for it {what}: {exc}"
            )
            error.ranks = (peer,)
            raise error from None


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
