"""``CommOps``: the operations of a ``TorchComm``, and ``BatchSendRecv``.

Each op's code is its method in ``optable.methods`` (``OpMethods``): it checks the
arguments with the reference's rules and hands the backend call to ``CommCore._issue``, or
to ``CommCore._sync`` for a plain sync call while the lane is open.  ``BatchSendRecv``
collects sends and receives and issues them as one op through the same path.
"""

from __future__ import annotations

import torch

from torchcomms import optable
from torchcomms.comm.core import CommCore
from torchcomms.optable import OpName, hook_args
from torchcomms.runtime.work import TorchWork
from torchcomms.types import (
    UNSET_BATCH_TIMEOUT,
    BatchP2POptions,
    P2POp,
    P2POpType,
)


class CommOps(CommCore, optable.OpMethods):
    """Collectives and point-to-point of a communicator (see the module docstring)."""

    def batch_op_create(self) -> BatchSendRecv:
        """A batch of sends and receives issued together, so mutual pairs cannot deadlock."""
        self._checker("batch_op_create")
        return BatchSendRecv(self)


_SEND, _RECV = optable.BY_NAME[OpName.send], optable.BY_NAME[OpName.recv]


class BatchSendRecv:
    """Sends and receives collected with ``send``/``recv`` and issued together by ``issue``."""

    def __init__(self, comm: CommOps) -> None:
        self._comm = comm
        self.ops: list[P2POp] = []

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        _SEND.check(self._comm._checker("batch send"), tensor, dst)
        self.ops.append(P2POp(P2POpType.SEND, tensor, dst))

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        _RECV.check(self._comm._checker("batch recv"), tensor, src)
        self.ops.append(P2POp(P2POpType.RECV, tensor, src))

    def issue(self, async_op: bool, options: BatchP2POptions | None = None) -> TorchWork:
        comm = self._comm
        c = comm._checker("batch_op_issue")
        c.async_op(async_op)
        if not self.ops:
            raise c.fail("Cannot issue empty batch operation")
        for op in self.ops:
            c.tensor(op.tensor)
            c.peer("peer", op.peer, "send to" if op.type is P2POpType.SEND else "recv from")
        opts = options or BatchP2POptions()
        timeout = None if opts.timeout is UNSET_BATCH_TIMEOUT else opts.timeout
        ops = list(self.ops)
        backend = comm._backend
        return comm._issue(
            OpName.batch_op_issue,
            hook_args.BatchOpIssuePreHookArgs(len(ops), async_op),
            timeout,
            opts.hints,
            backend.batch_op_issue,
            (ops, async_op),
            post_args=hook_args.BatchOpIssuePostHookArgs,
        )
