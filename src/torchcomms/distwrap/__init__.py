"""``torchcomms.distwrap``: torch.distributed's API, run on torchcomms, as upstream ships it.

A script changes one import (``from torchcomms import distwrap as dist``); with
``init_process_group(..., use_torchcomms=True)`` every collective runs on the group's
``TorchComm``, and without it every call is torch.distributed's own.  Names torch.distributed
has and distwrap does not define are forwarded to it (``dist.get_backend``, ``dist.Backend``).

Modules, as upstream lays them out: ``new_comm`` (the group lifecycle: ``init_process_group``,
``new_group``, ``split_group``, ``destroy_process_group``), ``collectives`` (tensor,
point-to-point and object calls, memory pools), ``collectives_extension`` (``new_window``,
``reduce_scatter_quantized``), ``fallback`` (the pass-through path's stand-ins for what gloo
refuses), ``pginfo`` (the per-group registry) and ``utils`` (the mode, backend strings, rank
and size, and the lookups).  This module re-exports the public calls, torch.distributed's
names upstream re-exports, and ``P2POp``.

Imports: ``torch``, ``torch.distributed`` (at module level: this package is never imported
while torch.distributed initialises, nor by ``torchcomms/__init__``; ``from torchcomms import
distwrap`` loads it on demand), the bridge (``_backend_wrapper``, ``bridge``), ``device_mesh``
(to register a split group), ``comm``, ``objcol``, ``types`` and ``work``.  Nothing in
torchcomms imports distwrap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as _dist
from torch.distributed import (
    GroupMember,
    HashStore,
    ProcessGroup,
    ProcessGroupGloo,
    ReduceOp,
    Store,
    Work,
    get_process_group_ranks,
    get_rank,
    get_world_size,
    group,
    is_available,
    is_initialized,
)

from torchcomms.distwrap.collectives import (
    _make_nccl_premul_sum,
    all_gather,
    all_gather_into_tensor,
    all_gather_object,
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    batch_isend_irecv,
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    get_mem_allocator,
    irecv,
    isend,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    register_mem_pool,
    scatter,
    scatter_object_list,
    send,
)
from torchcomms.distwrap.collectives_extension import new_window, reduce_scatter_quantized
from torchcomms.distwrap.new_comm import (
    destroy_process_group,
    init_process_group,
    new_group,
    split_group,
)
from torchcomms.distwrap.utils import torchcomms_is_enabled


class P2POp:
    """``torch.distributed.P2POp`` that also takes distwrap's ``isend``/``irecv`` as ``op``."""

    def __init__(
        self,
        op: Callable[..., Any],
        tensor: torch.Tensor,
        peer: int | None = None,
        group: ProcessGroup | None = None,
        tag: int = 0,
        group_peer: int | None = None,
    ) -> None:
        mapped = {isend: _dist.distributed_c10d.isend, irecv: _dist.distributed_c10d.irecv}
        self._p2p_op = _dist.P2POp(
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
    def group(self) -> ProcessGroup | None:
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


def __getattr__(name: str) -> Any:
    """Forward the rest of torch.distributed (``get_backend``, ``Backend``, ``TCPStore``...)."""
    if not name.startswith("__"):
        try:
            return getattr(_dist, name)
        except AttributeError:
            pass
    raise AttributeError(f"module 'torchcomms.distwrap' has no attribute '{name}'")


__all__ = [
    "GroupMember",
    "HashStore",
    "P2POp",
    "ProcessGroup",
    "ProcessGroupGloo",
    "ReduceOp",
    "Store",
    "Work",
    "_make_nccl_premul_sum",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "destroy_process_group",
    "gather",
    "gather_object",
    "get_mem_allocator",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "group",
    "init_process_group",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "new_group",
    "new_window",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_quantized",
    "reduce_scatter_tensor",
    "register_mem_pool",
    "scatter",
    "scatter_object_list",
    "send",
    "split_group",
    "torchcomms_is_enabled",
]

if hasattr(_dist, "ProcessGroupNCCL"):  # CUDA builds of torch only
    ProcessGroupNCCL = _dist.ProcessGroupNCCL
    __all__ += ["ProcessGroupNCCL"]
