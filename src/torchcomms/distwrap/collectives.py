"""The tensor collectives, with ``torch.distributed``'s names and signatures.

With ``use_torchcomms=True`` each call runs on the group's ``TorchComm`` for the tensor's
device (validation, errors, timeouts, hooks and the flight recorder are the communicator's);
an async call returns the ``TorchWork``, a sync one ``None``.  Otherwise each call is
``torch.distributed``'s own, given the caller's arguments unchanged, except an all_gather of
unequal sizes on gloo (torch refuses it), which runs as point-to-point transfers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from torchcomms._c10d.args import _reduce_op
from torchcomms.distwrap import fallback, registry
from torchcomms.types import ReduceOp as TcReduceOp
from torchcomms.work import TorchWork

Result = Any  # dist.Work | TorchWork | None, as the mode and async_op say

_SUM = dist.ReduceOp.SUM


def to_torchcomms_op(op: Any) -> TcReduceOp:
    """torch.distributed's reduce op (incl. ``_make_nccl_premul_sum``'s) as torchcomms'."""
    if isinstance(op, TcReduceOp):
        return op
    if isinstance(op, c10d.ReduceOp.RedOpType):
        op = c10d.ReduceOp(op)
    try:
        return _reduce_op(op)
    except (TypeError, KeyError, AttributeError):
        raise ValueError(f"Unsupported ReduceOp: {op!r}") from None


def _make_nccl_premul_sum(mul_factor: float | torch.Tensor) -> dist.ReduceOp:
    """A PREMUL_SUM reduce op (inputs times ``mul_factor``, then summed), as torch makes it.

    On the torchcomms path it reduces as ``ReduceOp.PREMUL_SUM(mul_factor)``; torch's gloo
    refuses PREMUL_SUM, so on the pass-through path only NCCL groups accept it.
    """
    return dist._make_nccl_premul_sum(mul_factor)


def _done(work: TorchWork, async_op: bool) -> TorchWork | None:
    return work if async_op else None


def _same_size(tensors: list[torch.Tensor]) -> bool:
    return len({t.numel() for t in tensors}) <= 1


def all_reduce(
    tensor: torch.Tensor,
    op: Any = _SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Result:
    if not registry.torchcomms_is_enabled():
        return dist.all_reduce(tensor, op, group, async_op)
    pg = registry.get_group(group)
    comm = registry.comm_for(pg, "all_reduce", tensor=tensor)
    return _done(comm.all_reduce(tensor, to_torchcomms_op(op), async_op), async_op)


def broadcast(
    tensor: torch.Tensor,
    src: int | None = None,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Result:
    if not registry.torchcomms_is_enabled():
        return dist.broadcast(tensor, src=src, group=group, async_op=async_op, group_src=group_src)
    pg = registry.get_group(group)
    root = registry.resolve_peer(pg, src, group_src, ("src", "group_src"), "broadcast")
    comm = registry.comm_for(pg, "broadcast", tensor=tensor)
    return _done(comm.broadcast(tensor, root, async_op), async_op)


def reduce(
    tensor: torch.Tensor,
    dst: int | None = None,
    op: Any = _SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Result:
    if not registry.torchcomms_is_enabled():
        return dist.reduce(
            tensor, dst=dst, op=op, group=group, async_op=async_op, group_dst=group_dst
        )
    pg = registry.get_group(group)
    root = registry.resolve_peer(pg, dst, group_dst, ("dst", "group_dst"), "reduce")
    comm = registry.comm_for(pg, "reduce", tensor=tensor)
    return _done(comm.reduce(tensor, root, to_torchcomms_op(op), async_op), async_op)


def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Result:
    if not registry.torchcomms_is_enabled():
        if not _same_size(tensor_list) and fallback.backend_of(group, tensor) == "gloo":
            return fallback.all_gather_uneven(tensor_list, tensor, group, async_op)
        return dist.all_gather(tensor_list, tensor, group, async_op)
    pg = registry.get_group(group)
    comm = registry.comm_for(pg, "all_gather", tensor=tensor)
    if _same_size(tensor_list):
        work = comm.all_gather(tensor_list, tensor, async_op)
    else:
        work = comm.all_gather_v(tensor_list, tensor, async_op)
    return _done(work, async_op)


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Result:
    if not registry.torchcomms_is_enabled():
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group, async_op)
    pg = registry.get_group(group)
    comm = registry.comm_for(pg, "all_gather_into_tensor", tensor=input_tensor)
    return _done(comm.all_gather_single(output_tensor, input_tensor, async_op), async_op)


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: Any = _SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Result:
    if not registry.torchcomms_is_enabled():
        return dist.reduce_scatter(output, input_list, op, group, async_op)
    pg = registry.get_group(group)
    comm = registry.comm_for(pg, "reduce_scatter", tensor=output)
    tc_op = to_torchcomms_op(op)
    if _same_size(input_list):
        work = comm.reduce_scatter(output, input_list, tc_op, async_op)
    else:
        work = comm.reduce_scatter_v(output, input_list, tc_op, async_op)
    return _done(work, async_op)


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: Any = _SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Result:
    if not registry.torchcomms_is_enabled():
        return dist.reduce_scatter_tensor(output, input, op, group, async_op)
    pg = registry.get_group(group)
    comm = registry.comm_for(pg, "reduce_scatter_tensor", tensor=output)
    work = comm.reduce_scatter_single(output, input, to_torchcomms_op(op), async_op)
    return _done(work, async_op)


def all_to_all(
    output_tensor_list: list[torch.Tensor],
    input_tensor_list: list[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Result:
    if not registry.torchcomms_is_enabled():
        return dist.all_to_all(output_tensor_list, input_tensor_list, group, async_op)
    pg = registry.get_group(group)
    if not input_tensor_list:
        raise ValueError("all_to_all: input_tensor_list must not be empty")
    comm = registry.comm_for(pg, "all_to_all", tensor=input_tensor_list[0])
    return _done(comm.all_to_all(output_tensor_list, input_tensor_list, async_op), async_op)


def _even_splits(t: torch.Tensor, n: int, what: str) -> list[int]:
    rows = t.shape[0] if t.dim() > 0 else 0
    if rows % n:
        raise ValueError(
            f"all_to_all_single: {what} has {rows} rows, which do not split evenly across "
            f"{n} ranks (pass {what}_split_sizes)"
        )
    return [rows // n] * n


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Result:
    if not registry.torchcomms_is_enabled():
        return dist.all_to_all_single(
            output, input, output_split_sizes, input_split_sizes, group, async_op
        )
    pg = registry.get_group(group)
    comm = registry.comm_for(pg, "all_to_all_single", tensor=input)
    if output_split_sizes is None and input_split_sizes is None:
        return _done(comm.all_to_all_single(output, input, async_op), async_op)
    n = comm.get_size()
    out_sizes = (
        list(output_split_sizes)
        if output_split_sizes is not None
        else _even_splits(output, n, "output")
    )
    in_sizes = (
        list(input_split_sizes)
        if input_split_sizes is not None
        else _even_splits(input, n, "input")
    )
    return _done(comm.all_to_all_v_single(output, input, out_sizes, in_sizes, async_op), async_op)


def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int | None = None,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Result:
    if not registry.torchcomms_is_enabled():
        return dist.scatter(
            tensor, scatter_list, src=src, group=group, async_op=async_op, group_src=group_src
        )
    pg = registry.get_group(group)
    root = registry.resolve_peer(pg, src, group_src, ("src", "group_src"), "scatter", default=0)
    comm = registry.comm_for(pg, "scatter", tensor=tensor)
    inputs = list(scatter_list or []) if comm.get_rank() == root else []
    return _done(comm.scatter(tensor, inputs, root, async_op), async_op)


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int | None = None,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Result:
    if not registry.torchcomms_is_enabled():
        return dist.gather(
            tensor, gather_list, dst=dst, group=group, async_op=async_op, group_dst=group_dst
        )
    pg = registry.get_group(group)
    root = registry.resolve_peer(pg, dst, group_dst, ("dst", "group_dst"), "gather", default=0)
    comm = registry.comm_for(pg, "gather", tensor=tensor)
    outputs = list(gather_list or []) if comm.get_rank() == root else []
    return _done(comm.gather(outputs, tensor, root, async_op), async_op)


def barrier(
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    device_ids: list[int] | None = None,
) -> Result:
    if not registry.torchcomms_is_enabled():
        return dist.barrier(group, async_op, device_ids)
    pg = registry.get_group(group)
    return _done(registry.default_comm(pg, "barrier").barrier(async_op), async_op)
