"""``TcpDirect``: what the tcp path moves over its point-to-point connections
(``transport.tcp.p2p``): send/recv, batched p2p, and the all_to_all that is not one ring
exchange, and reduce among a few ranks.

Untagged messages use even tags from a per-peer sequence number, tagged ones an odd tag
of their own (``CpuOps.post``); an all_to_all's parts use the collective's sequence number,
negative, so they never meet a user's message.  Posted without blocking and waited on by
the op's thread (or the returned completion), so mutually dependent sends and receives
cannot deadlock.  A mixin of ``TcpOps``, which owns the attributes declared here.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from torchcomms.backends.cpu.host_arrays import UserBytes, mark_written
from torchcomms.backends.cpu.ops import Completion
from torchcomms.backends.cpu.staging import finish_average, premultiplied
from torchcomms.backends.cpu.tcp.waits import TcpWaiter
from torchcomms.runtime.deadline import Deadline
from torchcomms.transport.tcp.lane import LanePeerGone
from torchcomms.transport.tcp.p2p import P2P, Transfer
from torchcomms.transport.tcp.ring import Combine, as_bytes
from torchcomms.types import P2POp, P2POpType, ReduceOp

# gloo tags are 32-bit: sequence numbers and user tags wrap within 2**30 (even / odd halves).
_TAG_SPAN = 2**30
_NO_BYTES = memoryview(bytearray())


def _received(tensor: torch.Tensor, staged: torch.Tensor) -> None:
    """A receive into ``staged`` is done: into ``tensor`` if it was a copy, else (written
    through a byte view) the autograd version bumped, as an in-place op would."""
    if staged is not tensor:
        tensor.copy_(staged.view(tensor.shape))
    else:
        mark_written((staged,))


class TcpDirect:
    """The point-to-point side of ``TcpOps`` (module docstring)."""

    p2p: P2P
    waiter: TcpWaiter
    rank: int
    size: int
    seq: int
    _send_seq: dict[int, int]
    _recv_seq: dict[int, int]
    _user_bytes: UserBytes

    def _reduce_tree(
        self,
        flat: torch.Tensor,
        root: int,
        op: ReduceOp,
        combine: Combine,
        deadline: Deadline,
    ) -> None:
        """A binomial tree to ``root`` over the point-to-point connections, after the
        header exchange (so every rank already saw every other's op): ``ceil(log2 n)``
        rounds of whole tensors, in which half of the ranks still holding a partial result
        send it to the other half.  For a few ranks, fewer meetings than the ring's
        ``2 (n-1)`` steps (each a wake-up of every rank) and no forwarding by ranks that
        are not on the way.  Ranks other than the root only read their tensor."""
        n = self.size
        me = (self.rank - root) % n  # the root is 0
        tag = -1 - self.seq % _TAG_SPAN
        src = premultiplied(flat, op)
        acc = src
        engine, waiter = self.p2p, self.waiter
        mask = 1
        while mask < n:
            if me & mask:
                peer = (me - mask + root) % n
                move = [engine.post_send(peer, tag, as_bytes(acc))]
            elif me + mask < n:
                peer = (me + mask + root) % n
                theirs = torch.empty_like(src)
                move = [engine.post_recv(peer, tag, as_bytes(theirs))]
            else:
                mask *= 2
                continue
            try:
                engine.wait(move, functools.partial(waiter.check_p2p, deadline, "reduce", [peer]))
            except LanePeerGone as gone:
                raise waiter.gone(gone, "reduce") from None
            if me & mask:
                return
            out = flat if me == 0 else (acc if acc is not flat else torch.empty_like(src))
            combine(acc, theirs, out)
            acc = out
            mask *= 2
        if acc is not flat:
            flat.copy_(acc)
        mark_written((flat,))
        finish_average(flat, op, n)

    def _all_to_all_direct(
        self,
        out: torch.Tensor,
        src: torch.Tensor,
        out_splits: Sequence[int],
        in_splits: Sequence[int],
        deadline: Deadline,
    ) -> None:
        """Every part at once over the point-to-point connections (``transport.tcp.p2p``):
        each rank posts its receives, then its sends, starting at the next rank so the
        ranks do not all send to one peer first, and copies its own part meanwhile.  The
        tag is this collective's sequence number, negative (user messages' tags are not),
        so the parts never meet a user's send/recv.  A part whose length differs from what
        its receiver expects fails that receive, naming the sender."""
        n, r = self.size, self.rank
        out_at = [0] * (n + 1)
        in_at = [0] * (n + 1)
        for q in range(n):
            out_at[q + 1] = out_at[q] + out_splits[q]
            in_at[q + 1] = in_at[q] + in_splits[q]
        tag = -1 - self.seq % _TAG_SPAN
        engine = self.p2p
        order = [(r + k) % n for k in range(1, n)]
        moves = [engine.post_recv(q, tag, as_bytes(out[out_at[q] : out_at[q + 1]])) for q in order]
        moves += [engine.post_send(q, tag, as_bytes(src[in_at[q] : in_at[q + 1]])) for q in order]
        out[out_at[r] : out_at[r + 1]].copy_(src[in_at[r] : in_at[r + 1]])
        waiter = self.waiter

        def between() -> None:  # the peers still waited for
            waiter.check_p2p(deadline, "all_to_all", sorted({m.peer for m in moves if not m.done}))

        try:
            engine.wait(moves, between)
        except LanePeerGone as gone:
            raise waiter.gone(gone, "all_to_all") from None
        mark_written((out,))

    # -- point-to-point ------------------------------------------------------------------
    def post(self, ops: Sequence[P2POp], tag: int | None, deadline: Deadline) -> Completion:
        """Untagged messages use even tags from a per-peer sequence number, tagged ones an
        odd tag of their own (see ``CpuOps.post``), over ``transport.tcp.p2p``."""
        return self._post_direct(self.p2p, ops, tag, deadline)

    def unattended(self) -> None:
        self.p2p.kick()

    def transfer(self, sending: bool, tensor: torch.Tensor, peer: int, deadline: Deadline) -> None:
        """``_post_direct`` for one untagged message, waited for here (no closures)."""
        staged = tensor
        if not (tensor.is_cpu and tensor.is_contiguous()):
            staged = tensor.detach().to("cpu").contiguous()
        seqs = self._send_seq if sending else self._recv_seq
        tag = 2 * (seqs[peer] % _TAG_SPAN)
        seqs[peer] += 1
        engine = self.p2p
        # A non-owning view (cheaper than ``as_bytes``); the op keeps ``staged`` alive.
        view = self._user_bytes.of(staged) if staged.nbytes else _NO_BYTES
        if sending:
            move = engine.post_send(peer, tag, view, staged)
        else:
            move = engine.post_recv(peer, tag, view, staged)
        if not move.done or move.error is not None:  # a send usually went out when posted
            what = "send" if sending else "recv"
            waiter = self.waiter
            try:
                engine.wait([move], lambda: waiter.check_p2p(deadline, what, [peer]))
            except LanePeerGone as gone:
                raise waiter.gone(gone, what) from None
        if not sending:
            _received(tensor, staged)

    def _tag(self, op: P2POp, user_tag: int | None) -> int:
        if user_tag is not None:
            return 2 * (user_tag % _TAG_SPAN) + 1
        seqs = self._send_seq if op.type is P2POpType.SEND else self._recv_seq
        tag = 2 * (seqs[op.peer] % _TAG_SPAN)
        seqs[op.peer] += 1
        return tag

    def _post_direct(
        self, engine: P2P, ops: Sequence[P2POp], user_tag: int | None, deadline: Deadline
    ) -> Completion:
        posted: list[tuple[P2POp, Transfer, torch.Tensor]] = []
        for op in ops:
            tensor = op.tensor
            staged = tensor
            if not (tensor.is_cpu and tensor.is_contiguous()):
                staged = tensor.detach().to("cpu").contiguous()
            view = as_bytes(staged)
            tag = self._tag(op, user_tag)
            if op.type is P2POpType.SEND:
                posted.append((op, engine.post_send(op.peer, tag, view), staged))
            else:
                posted.append((op, engine.post_recv(op.peer, tag, view), staged))
        waiter = self.waiter
        what = "send" if all(op.type is P2POpType.SEND for op in ops) else "recv"

        def complete() -> None:
            moves: list[Transfer] = [m for _, m, _ in posted]

            def between() -> None:  # the peers still waited for (not those done with)
                peers = sorted({m.peer for m in moves if not m.done})
                waiter.check_p2p(deadline, what, peers)

            try:
                engine.wait(moves, between)
            except LanePeerGone as gone:
                raise waiter.gone(gone, what) from None
            for op, _, staged in posted:
                if op.type is P2POpType.RECV:
                    _received(op.tensor, staged)

        return complete
