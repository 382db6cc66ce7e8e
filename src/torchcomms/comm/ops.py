"""``CommOps``: the operations of a ``TorchComm``, generated from the op table.

Each op's method is made from its declaration in ``optable`` (signature, argument checks,
pre-hook arguments, whether it has a sync fast path): it checks its arguments with the
reference's rules and error texts (shared by every backend, so backends may assume valid
input) and hands the backend call to ``CommCore._issue``, or to ``CommCore._sync`` for a
valid sync op with no hints or timeout while the lane is open.  The generated code is what
one would write by hand for each op (this is every op's hot path), made once at import.
``BatchSendRecv`` collects sends and receives and issues them as one op through the same
path.
"""

from __future__ import annotations

import inspect
import linecache
import os
from typing import Any

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


def _method_source(entry: optable.Op) -> str:
    """The op's method as source text (see the module docstring)."""
    name, args = entry.method, ", ".join(entry.names)
    lead = args + ", " if args else ""
    lines = [
        f"def {name}(self, {lead}async_op, hints=None, timeout=None):",
        f"    c = self._checker({name!r})",
    ]
    if entry.normalizes:
        lines.append(f"    {args}, = check(c, {args})")
    elif args:
        lines.append(f"    check(c, {args})")
    if entry.hot:
        tensor = _lane_tensors(entry)
        peer = entry.peer or "-1"
        lines += [
            "    if async_op is False and hints is None and timeout is None "
            "and self._lane is not None:",
            f"        return self._sync(NAME, {tensor}, {peer}, self._backend.{name}, "
            f"({lead}False,))",
        ]
    hooked = ", ".join([*entry.hook, "async_op"])
    lines += [
        "    c.async_op(async_op)",
        f"    return self._issue(NAME, Hook({hooked}), timeout, hints, self._backend.{name}, "
        f"({lead}async_op,))",
    ]
    return "\n".join(lines) + "\n"


def _lane_tensors(entry: optable.Op) -> str:
    """What the lane records of the op's data (``LaneObserver.op_sync``): its one tensor,
    ``(input, output)`` for an op with one of each, or ``None``."""
    ins, outs = entry.inputs, entry.outputs
    if ins is not None and outs is not None and ins[0] != outs[0]:
        assert ins[1] == outs[1] == optable.ONE, entry.name
        return f"({ins[0]}, {outs[0]})"
    return entry.names[0] if entry.names else "None"


def _make_method(entry: optable.Op) -> Any:
    scope: dict[str, Any] = {
        "NAME": entry.name,
        "check": entry.check,
        "Hook": hook_args.pre_hook_class(entry),
    }
    source = _method_source(entry)
    # A name inside the package (stack walks, the flight recorder's, count it as
    # torchcomms'), with its source in linecache, so a traceback shows the generated line.
    filename = os.path.join(os.path.dirname(__file__), f"<op {entry.method}>")
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), scope)
    method = scope[entry.method]
    declared = getattr(optable.OpMethods, entry.method)
    method.__doc__ = declared.__doc__
    method.__qualname__ = f"TorchComm.{entry.method}"
    method.__signature__ = inspect.signature(declared)
    method.__annotations__ = dict(declared.__annotations__)
    return method


for _entry in optable.OPS:
    setattr(CommOps, _entry.method, _make_method(_entry))
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
