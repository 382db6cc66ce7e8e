"""torch.distributed's collective, point-to-point and object calls, routed (upstream's ``collectives``).

With ``use_torchcomms=True`` each call runs on the group's ``TorchComm`` for the tensor's
device (validation, errors, timeouts, hooks and the flight recorder are the communicator's);
an async call returns the ``TorchWork``, a sync one ``None``.  Peers are global ranks
(``src``/``dst``/``peer``) or group ranks (``group_src``/``group_dst``/``group_peer``), never
both; ``scatter``, ``gather`` and the rooted object calls default to global rank 0, as
torch's do.  A receive needs its source (no wildcard receive), a non-zero ``tag`` travels as
the communicator's ``tag`` hint, and ``batch_isend_irecv`` issues one batch
(``batch_op_create``) whose work each op's entry in the returned list shares.  Object calls
run ``torchcomms.objcol`` on the group's default communicator (CPU's when it has several).

Otherwise each call is ``torch.distributed``'s own, given the caller's arguments unchanged,
except an all_gather of unequal sizes on gloo (torch refuses it), which runs as
point-to-point transfers (``fallback``).  ``get_mem_allocator`` / ``register_mem_pool`` are
the CUDA memory-pool plumbing: no allocator on CPU (a ``RuntimeError`` naming the limit), and
registering a pool is a no-op with torchcomms (as upstream).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d
from torch.distributed import ProcessGroup, ReduceOp

from torchcomms import objcol
from torchcomms.bridge.args import _reduce_op
from torchcomms.distwrap.fallback import fallback_all_gather_gloo
from torchcomms.distwrap.utils import (
    _backend_for_device,
    _comm_for,
    _default_comm,
    _group_rank,
    _resolve_group,
    _resolve_peer,
    get_group,
    torchcomms_is_enabled,
)
from torchcomms.runtime.work import TorchWork
from torchcomms.types import ReduceOp as TcReduceOp

Result = Any  # dist.Work | TorchWork | None, as the mode and async_op say
#: A reduce op as torch.distributed takes it (``ReduceOp.SUM`` is typed as its enum member).
_Op = ReduceOp | ReduceOp.RedOpType


def _convert_reduce_op(op: Any) -> TcReduceOp:
    """torch.distributed's reduce op (incl. ``_make_nccl_premul_sum``'s) as torchcomms'."""
    if isinstance(op, TcReduceOp):
        return op
    if isinstance(op, c10d.ReduceOp.RedOpType):
        op = c10d.ReduceOp(op)
    try:
        return _reduce_op(op)
    except (TypeError, KeyError, AttributeError):
        raise ValueError(f"Unsupported ReduceOp: {op!r}") from None


def _make_nccl_premul_sum(mul_factor: float | torch.Tensor) -> ReduceOp:
    """A PREMUL_SUM reduce op (inputs times ``mul_factor``, then summed), as torch makes it.

    On the torchcomms path it reduces as ``ReduceOp.PREMUL_SUM(mul_factor)``; torch's gloo
    refuses PREMUL_SUM, so on the pass-through path only NCCL groups accept it.
    """
    return dist._make_nccl_premul_sum(mul_factor)


def _done(work: TorchWork, async_op: bool) -> TorchWork | None:
    return work if async_op else None


def _same_size(tensors: list[torch.Tensor]) -> bool:
    return len({t.numel() for t in tensors}) <= 1


# -- collectives -----------------------------------------------------------------------------


def all_reduce(
    tensor: torch.Tensor,
    op: _Op = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Result:
    if not torchcomms_is_enabled():
        return dist.all_reduce(tensor, op, group, async_op)
    pg = _resolve_group(group)
    comm = _comm_for(pg, "all_reduce", tensor=tensor)
    return _done(comm.all_reduce(tensor, _convert_reduce_op(op), async_op), async_op)


def broadcast(
    tensor: torch.Tensor,
    src: int | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Result:
    if not torchcomms_is_enabled():
        return dist.broadcast(tensor, src=src, group=group, async_op=async_op, group_src=group_src)
    pg = _resolve_group(group)
    root = _resolve_peer(pg, src, group_src, ("src", "group_src"), "broadcast")
    comm = _comm_for(pg, "broadcast", tensor=tensor)
    return _done(comm.broadcast(tensor, root, async_op), async_op)


def reduce(
    tensor: torch.Tensor,
    dst: int | None = None,
    op: _Op = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Result:
    if not torchcomms_is_enabled():
        return dist.reduce(
            tensor, dst=dst, op=op, group=group, async_op=async_op, group_dst=group_dst
        )
    pg = _resolve_group(group)
    root = _resolve_peer(pg, dst, group_dst, ("dst", "group_dst"), "reduce")
    comm = _comm_for(pg, "reduce", tensor=tensor)
    return _done(comm.reduce(tensor, root, _convert_reduce_op(op), async_op), async_op)


def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Result:
    if not torchcomms_is_enabled():
        if not _same_size(tensor_list):
            pg = get_group(group)
            if _backend_for_device(pg, tensor.device.type) == "gloo":
                return fallback_all_gather_gloo(tensor_list, tensor, pg, async_op)
        return dist.all_gather(tensor_list, tensor, group, async_op)
    pg = _resolve_group(group)
    comm = _comm_for(pg, "all_gather", tensor=tensor)
    if _same_size(tensor_list):
        work = comm.all_gather(tensor_list, tensor, async_op)
    else:
        work = comm.all_gather_v(tensor_list, tensor, async_op)
    return _done(work, async_op)


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Result:
    if not torchcomms_is_enabled():
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group, async_op)
    pg = _resolve_group(group)
    comm = _comm_for(pg, "all_gather_into_tensor", tensor=input_tensor)
    return _done(comm.all_gather_single(output_tensor, input_tensor, async_op), async_op)


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: _Op = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Result:
    if not torchcomms_is_enabled():
        return dist.reduce_scatter(output, input_list, op, group, async_op)
    pg = _resolve_group(group)
    comm = _comm_for(pg, "reduce_scatter", tensor=output)
    tc_op = _convert_reduce_op(op)
    if _same_size(input_list):
        work = comm.reduce_scatter(output, input_list, tc_op, async_op)
    else:
        work = comm.reduce_scatter_v(output, input_list, tc_op, async_op)
    return _done(work, async_op)


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: _Op = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Result:
    if not torchcomms_is_enabled():
        return dist.reduce_scatter_tensor(output, input, op, group, async_op)
    pg = _resolve_group(group)
    comm = _comm_for(pg, "reduce_scatter_tensor", tensor=output)
    work = comm.reduce_scatter_single(output, input, _convert_reduce_op(op), async_op)
    return _done(work, async_op)


def all_to_all(
    output_tensor_list: list[torch.Tensor],
    input_tensor_list: list[torch.Tensor],
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Result:
    if not torchcomms_is_enabled():
        return dist.all_to_all(output_tensor_list, input_tensor_list, group, async_op)
    pg = _resolve_group(group)
    if not input_tensor_list:
        raise ValueError("all_to_all: input_tensor_list must not be empty")
    comm = _comm_for(pg, "all_to_all", tensor=input_tensor_list[0])
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
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Result:
    if not torchcomms_is_enabled():
        return dist.all_to_all_single(
            output, input, output_split_sizes, input_split_sizes, group, async_op
        )
    pg = _resolve_group(group)
    comm = _comm_for(pg, "all_to_all_single", tensor=input)
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
    group: ProcessGroup | None = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Result:
    if not torchcomms_is_enabled():
        return dist.scatter(
            tensor, scatter_list, src=src, group=group, async_op=async_op, group_src=group_src
        )
    pg = _resolve_group(group)
    root = _resolve_peer(pg, src, group_src, ("src", "group_src"), "scatter", default=0)
    comm = _comm_for(pg, "scatter", tensor=tensor)
    inputs = list(scatter_list or []) if comm.get_rank() == root else []
    return _done(comm.scatter(tensor, inputs, root, async_op), async_op)


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Result:
    if not torchcomms_is_enabled():
        return dist.gather(
            tensor, gather_list, dst=dst, group=group, async_op=async_op, group_dst=group_dst
        )
    pg = _resolve_group(group)
    root = _resolve_peer(pg, dst, group_dst, ("dst", "group_dst"), "gather", default=0)
    comm = _comm_for(pg, "gather", tensor=tensor)
    outputs = list(gather_list or []) if comm.get_rank() == root else []
    return _done(comm.gather(outputs, tensor, root, async_op), async_op)


def barrier(
    group: ProcessGroup | None = None,
    async_op: bool = False,
    device_ids: list[int] | None = None,
) -> Result:
    if not torchcomms_is_enabled():
        return dist.barrier(group, async_op, device_ids)
    pg = _resolve_group(group)
    return _done(_default_comm(pg, "barrier").barrier(async_op), async_op)


# -- point to point --------------------------------------------------------------------------


def _hints(tag: int) -> dict[str, str] | None:
    return {"tag": str(int(tag))} if tag else None


def _recv_src(pg: ProcessGroup, src: int | None, group_src: int | None, op: str) -> int:
    if src is None and group_src is None:
        raise ValueError(f"torchcomms does not support wildcard {op} (src=None)")
    return _resolve_peer(pg, src, group_src, ("src", "group_src"), op)


def send(
    tensor: torch.Tensor,
    dst: int | None = None,
    group: ProcessGroup | None = None,
    tag: int = 0,
    group_dst: int | None = None,
) -> None:
    if not torchcomms_is_enabled():
        dist.send(tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)
        return
    pg = _resolve_group(group)
    peer = _resolve_peer(pg, dst, group_dst, ("dst", "group_dst"), "send")
    _comm_for(pg, "send", tensor=tensor).send(tensor, peer, False, hints=_hints(tag))


def recv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: ProcessGroup | None = None,
    tag: int = 0,
    group_src: int | None = None,
) -> int:
    """Receive into ``tensor``; returns the sender's global rank."""
    if not torchcomms_is_enabled():
        return dist.recv(tensor, src=src, group=group, tag=tag, group_src=group_src)
    pg = _resolve_group(group)
    peer = _recv_src(pg, src, group_src, "recv")
    _comm_for(pg, "recv", tensor=tensor).recv(tensor, peer, False, hints=_hints(tag))
    return int(dist.get_process_group_ranks(pg)[peer])


def isend(
    tensor: torch.Tensor,
    dst: int | None = None,
    group: ProcessGroup | None = None,
    tag: int = 0,
    group_dst: int | None = None,
) -> Any:
    if not torchcomms_is_enabled():
        work = dist.isend(tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)
        if work is None:
            raise AssertionError("dist.isend returned None")
        return work
    pg = _resolve_group(group)
    peer = _resolve_peer(pg, dst, group_dst, ("dst", "group_dst"), "isend")
    return _comm_for(pg, "isend", tensor=tensor).send(tensor, peer, True, hints=_hints(tag))


def irecv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: ProcessGroup | None = None,
    tag: int = 0,
    group_src: int | None = None,
) -> Any:
    if not torchcomms_is_enabled():
        work = dist.irecv(tensor, src=src, group=group, tag=tag, group_src=group_src)
        if work is None:
            raise AssertionError("dist.irecv returned None")
        return work
    pg = _resolve_group(group)
    peer = _recv_src(pg, src, group_src, "irecv")
    return _comm_for(pg, "irecv", tensor=tensor).recv(tensor, peer, True, hints=_hints(tag))


def _unwrap(ops: Any) -> list[dist.P2POp]:
    """torch's ``P2POp``s of a list of distwrap's or torch's (distwrap's wraps one)."""
    if not isinstance(ops, (list, tuple)):
        raise ValueError("batch_isend_irecv: p2p_op_list must be a list of P2POp")
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
    if not torchcomms_is_enabled():
        if not ops:
            raise ValueError("batch_isend_irecv: p2p_op_list must be a non-empty list of P2POp")
        works = dist.batch_isend_irecv(ops)
        if works is None:
            raise AssertionError("dist.batch_isend_irecv returned None")
        return list(works)
    if not ops:
        return []
    pg = _resolve_group(ops[0].group)
    if any(get_group(op.group) is not pg for op in ops):
        raise ValueError("batch_isend_irecv: all ops need to use the same group")
    comm = _comm_for(pg, "batch_isend_irecv", tensor=ops[0].tensor)
    batch = comm.batch_op_create()
    for op in ops:
        if _comm_for(pg, "batch_isend_irecv", tensor=op.tensor) is not comm:
            raise ValueError("batch_isend_irecv: all ops need tensors on the same device type")
        if op.group_peer is not None:
            peer = op.group_peer
        elif op.peer is not None:
            peer = _group_rank(pg, op.peer, "batch_isend_irecv")
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


# -- objects ---------------------------------------------------------------------------------


def all_gather_object(object_list: list[Any], obj: Any, group: ProcessGroup | None = None) -> None:
    if not torchcomms_is_enabled():
        dist.all_gather_object(object_list, obj, group)
        return
    pg = _resolve_group(group)
    objcol.all_gather_object(_default_comm(pg, "all_gather_object"), object_list, obj)


def gather_object(
    obj: Any,
    object_gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: ProcessGroup | None = None,
    group_dst: int | None = None,
) -> None:
    if not torchcomms_is_enabled():
        dist.gather_object(obj, object_gather_list, dst=dst, group=group, group_dst=group_dst)
        return
    pg = _resolve_group(group)
    root = _resolve_peer(pg, dst, group_dst, ("dst", "group_dst"), "gather_object", default=0)
    comm = _default_comm(pg, "gather_object")
    objcol.gather_object(comm, obj, root=root, object_gather_list=object_gather_list)


def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int | None = None,
    group: ProcessGroup | None = None,
    group_src: int | None = None,
) -> None:
    if not torchcomms_is_enabled():
        dist.scatter_object_list(
            scatter_object_output_list,
            scatter_object_input_list,
            src=src,
            group=group,
            group_src=group_src,
        )
        return
    pg = _resolve_group(group)
    root = _resolve_peer(pg, src, group_src, ("src", "group_src"), "scatter_object_list", default=0)
    objcol.scatter_object_list(
        _default_comm(pg, "scatter_object_list"),
        root=root,
        scatter_object_output_list=scatter_object_output_list,
        scatter_object_input_list=scatter_object_input_list,
    )


def broadcast_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: ProcessGroup | None = None,
    device: torch.device | None = None,
    group_src: int | None = None,
) -> None:
    if not torchcomms_is_enabled():
        dist.broadcast_object_list(
            object_list, src=src, group=group, device=device, group_src=group_src
        )
        return
    pg = _resolve_group(group)
    root = _resolve_peer(
        pg, src, group_src, ("src", "group_src"), "broadcast_object_list", default=0
    )
    objcol.broadcast_object_list(_default_comm(pg, "broadcast_object_list"), object_list, root=root)


# -- memory pools ----------------------------------------------------------------------------


def get_mem_allocator(group: ProcessGroup | None, device: torch.device) -> Any:
    """The group's memory allocator for ``device``: CUDA only, so an error on CPU."""
    device = torch.device(device)
    if torchcomms_is_enabled():
        pg = _resolve_group(group)
        comm = _comm_for(pg, "get_mem_allocator", device_type=device.type)
        allocator = getattr(comm, "mem_allocator", None)
        if allocator is None:
            raise RuntimeError(
                f"get_mem_allocator: the {comm.get_backend()!r} communicator for device "
                f"{device.type!r} has no memory allocator (torchcomms allocators are CUDA "
                "caching allocators; CPU communicators use ordinary tensors)"
            )
        return allocator
    backend = get_group(group)._get_backend(device)
    allocator = getattr(backend, "mem_allocator", None)
    if allocator is None:
        raise RuntimeError(
            f"get_mem_allocator: backend {backend.name()!r} for device {device.type!r} has no "
            "memory allocator (only CUDA backends such as NCCL provide one)"
        )
    return allocator


def register_mem_pool(group: ProcessGroup | None, device: torch.device, pool: Any) -> None:
    """Register ``pool`` with the group's backend; torchcomms manages its own (no-op)."""
    if torchcomms_is_enabled():
        return
    device = torch.device(device)
    backend = get_group(group)._get_backend(device)
    register = getattr(backend, "register_mem_pool", None)
    if register is None:
        raise RuntimeError(
            f"register_mem_pool: backend {backend.name()!r} for device {device.type!r} has no "
            "memory pools (only CUDA backends such as NCCL register torch.cuda.MemPool)"
        )
    register(pool)
