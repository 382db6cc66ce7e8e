"""Point-to-point calls: ``send``/``recv``/``isend``/``irecv``, ``P2POp``, ``batch_isend_irecv``.

Peers are global ranks (``dst``/``src``/``peer``) or group ranks (``group_dst``/``group_src``/
``group_peer``), exactly one of the two, as in torch.distributed.  With ``use_torchcomms=True``
a receive needs its source (no wildcard receive: ``ValueError``), a non-zero ``tag`` travels
as the communicator's ``tag`` hint, and ``batch_isend_irecv`` issues one batch
(``batch_op_create``) whose work each op's entry in the returned list shares.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from torchcomms.distwrap import registry
from torchcomms.work import TorchWork


def _hints(tag: int) -> dict[str, str] | None:
    return {"tag": str(int(tag))} if tag else None


def _recv_src(pg: dist.ProcessGroup, src: int | None, group_src: int | None, op: str) -> int:
    if src is None and group_src is None:
        raise ValueError(f"torchcomms does not support wildcard {op} (src=None)")
    return registry.resolve_peer(pg, src, group_src, ("src", "group_src"), op)


def send(
    tensor: torch.Tensor,
    dst: int | None = None,
    group: dist.ProcessGroup | None = None,
    tag: int = 0,
    group_dst: int | None = None,
) -> None:
    if not registry.torchcomms_is_enabled():
        dist.send(tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)
        return
    pg = registry.get_group(group)
    peer = registry.resolve_peer(pg, dst, group_dst, ("dst", "group_dst"), "send")
    registry.comm_for(pg, "send", tensor=tensor).send(tensor, peer, False, hints=_hints(tag))


def recv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: dist.ProcessGroup | None = None,
    tag: int = 0,
    group_src: int | None = None,
) -> int:
    """Receive into ``tensor``; returns the sender's global rank."""
    if not registry.torchcomms_is_enabled():
        return dist.recv(tensor, src=src, group=group, tag=tag, group_src=group_src)
    pg = registry.get_group(group)
    peer = _recv_src(pg, src, group_src, "recv")
    registry.comm_for(pg, "recv", tensor=tensor).recv(tensor, peer, False, hints=_hints(tag))
    return registry.global_ranks(pg)[peer]


def isend(
    tensor: torch.Tensor,
    dst: int | None = None,
    group: dist.ProcessGroup | None = None,
    tag: int = 0,
    group_dst: int | None = None,
) -> Any:
    if not registry.torchcomms_is_enabled():
        work = dist.isend(tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)
        if work is None:
            raise AssertionError("dist.isend returned None")
        return work
    pg = registry.get_group(group)
    peer = registry.resolve_peer(pg, dst, group_dst, ("dst", "group_dst"), "isend")
    return registry.comm_for(pg, "isend", tensor=tensor).send(tensor, peer, True, hints=_hints(tag))


def irecv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: dist.ProcessGroup | None = None,
    tag: int = 0,
    group_src: int | None = None,
) -> Any:
    if not registry.torchcomms_is_enabled():
        work = dist.irecv(tensor, src=src, group=group, tag=tag, group_src=group_src)
        if work is None:
            raise AssertionError("dist.irecv returned None")
        return work
    pg = registry.get_group(group)
    peer = _recv_src(pg, src, group_src, "irecv")
    return registry.comm_for(pg, "irecv", tensor=tensor).recv(tensor, peer, True, hints=_hints(tag))


class P2POp:
    """``torch.distributed.P2POp`` that also takes distwrap's ``isend``/``irecv`` as ``op``."""

    def __init__(
        self,
        op: Callable[..., Any],
        tensor: torch.Tensor,
        peer: int | None = None,
        group: dist.ProcessGroup | None = None,
        tag: int = 0,
        group_peer: int | None = None,
    ) -> None:
        mapped = {isend: dist.distributed_c10d.isend, irecv: dist.distributed_c10d.irecv}
        self._p2p_op = dist.P2POp(
            op=mapped.get(op, op),
            tensor=tensor,
            peer=peer,
            group=group,
            tag=tag,
            group_peer=group_peer,
        )

    @property
    def op(self) -> Callable[..., Any]:
        return self._p2p_op.op

    @property
    def tensor(self) -> torch.Tensor:
        return self._p2p_op.tensor

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self._p2p_op.group

    @property
    def peer(self) -> int | None:
        return self._p2p_op.peer

    @property
    def tag(self) -> int:
        return self._p2p_op.tag

    @property
    def group_peer(self) -> int | None:
        return self._p2p_op.group_peer

    def __repr__(self) -> str:
        return repr(self._p2p_op)


def _unwrap(ops: Any) -> list[dist.P2POp]:
    if not isinstance(ops, (list, tuple)) or not ops:
        raise ValueError("batch_isend_irecv: p2p_op_list must be a non-empty list of P2POp")
    found: list[dist.P2POp] = []
    for entry in ops:
        op = getattr(entry, "_p2p_op", entry)
        if not isinstance(op, dist.P2POp):
            raise ValueError(
                "batch_isend_irecv: every entry must be a P2POp (torchcomms.distwrap's or "
                f"torch.distributed's), got {type(op).__name__}"
            )
        found.append(op)
    return found


def batch_isend_irecv(p2p_op_list: list[Any]) -> list[Any]:
    """Issue every send and receive of ``p2p_op_list`` together; one work per op."""
    ops = _unwrap(p2p_op_list)
    if not registry.torchcomms_is_enabled():
        works = dist.batch_isend_irecv(ops)
        if works is None:
            raise AssertionError("dist.batch_isend_irecv returned None")
        return list(works)
    pg = registry.get_group(ops[0].group)
    if any(registry.get_group(op.group) is not pg for op in ops):
        raise ValueError("batch_isend_irecv: all ops need to use the same group")
    comm = registry.comm_for(pg, "batch_isend_irecv", tensor=ops[0].tensor)
    batch = comm.batch_op_create()
    for op in ops:
        if registry.comm_for(pg, "batch_isend_irecv", tensor=op.tensor) is not comm:
            raise ValueError("batch_isend_irecv: all ops need tensors on the same device type")
        if op.group_peer is not None:
            peer = op.group_peer
        elif op.peer is not None:
            peer = registry.group_rank(pg, op.peer, "batch_isend_irecv")
        else:
            raise ValueError("torchcomms does not support wildcard P2P operations (peer=None)")
        name = getattr(op.op, "__name__", "")
        if "send" in name:
            batch.send(op.tensor, peer)
        elif "recv" in name:
            batch.recv(op.tensor, peer)
        else:
            raise ValueError(f"batch_isend_irecv: unknown P2P operation {name!r}")
    work: TorchWork = batch.issue(True)
    return [work] * len(ops)
