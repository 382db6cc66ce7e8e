"""``torchcomms.distwrap``: torch.distributed's API, run on torchcomms, as upstream ships it.

A script changes one import (``from torchcomms import distwrap as dist``); with
``init_process_group(..., use_torchcomms=True)`` every collective runs on the group's
``TorchComm``, and without it every call is torch.distributed's own.  Names torch.distributed
has and distwrap does not define are forwarded to it (``dist.get_backend``, ``dist.Backend``).

Owns: the mode and group registry (``registry``), what ``init_process_group`` reads
(``env``: backend strings, rank and size from the environment, pg_options as hints), the
group lifecycle (``groups``), the tensor collectives (``collectives``), point-to-point
(``p2p``), object collectives (``objects``), upstream's extensions (``extensions``) and the
pass-through path's stand-ins for what gloo refuses (``fallback``).

Imports: ``torch``, ``torch.distributed`` (at module level: this package is never imported
while torch.distributed initialises, nor by ``torchcomms/__init__``; ``from torchcomms import
distwrap`` loads it on demand), the bridge (``_backend_wrapper``, ``_c10d``), ``device_mesh``
(to register a split group), ``comm``, ``objcol``, ``types`` and ``work``.  Nothing in
torchcomms imports distwrap.
"""

from __future__ import annotations

from typing import Any

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
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    scatter,
)
from torchcomms.distwrap.extensions import (
    alltoallv_dedup_exec,
    alltoallv_dedup_init,
    alltoallv_dynamic_combine,
    alltoallv_dynamic_dispatch,
    get_mem_allocator,
    new_window,
    reduce_scatter_quantized,
    register_mem_pool,
)
from torchcomms.distwrap.groups import (
    destroy_process_group,
    init_process_group,
    new_group,
    split_group,
)
from torchcomms.distwrap.objects import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    scatter_object_list,
)
from torchcomms.distwrap.p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from torchcomms.distwrap.registry import torchcomms_is_enabled


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
    "alltoallv_dedup_exec",
    "alltoallv_dedup_init",
    "alltoallv_dynamic_combine",
    "alltoallv_dynamic_dispatch",
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
