"""The rank and size c10d gave a group, read when c10d itself is creating it through us.

Under ``TORCH_DISTRIBUTED_USE_TORCHCOMMS=1`` PyTorch 2.13's ``_new_process_group_helper`` calls
``new_comm(backend, device, name=..., store=..., hints=...)`` without the rank and world size
it was given (``init_process_group(rank=r, world_size=n, store=s)``, the ``mp.spawn``
pattern), so a process without rank variables in its environment has nothing to read.  The
helper holds them as its ``group_rank`` and ``group_size`` arguments; the bootstrap reads them
from its frame, and only from that function of that module.  Runs on the creating thread.
"""

from __future__ import annotations

import sys

_C10D = "torch.distributed.distributed_c10d"
_HELPER = "_new_process_group_helper"
#: Frames between the helper and the bootstrap's question: new_comm, the backend's init, a
#: plug-in adapter, the bootstrap; generous so a wrapper in between does not hide it.
_MAX_DEPTH = 24


def group_rank_and_size() -> tuple[int, int] | None:
    """``(group_rank, group_size)`` of the c10d group being created by a caller, else None."""
    frame = sys._getframe(1)
    for _ in range(_MAX_DEPTH):
        parent = frame.f_back
        if parent is None:
            return None
        frame = parent
        if frame.f_code.co_name != _HELPER or frame.f_globals.get("__name__") != _C10D:
            continue
        rank = frame.f_locals.get("group_rank")
        size = frame.f_locals.get("group_size")
        if isinstance(rank, int) and isinstance(size, int) and 0 <= rank < size:
            return rank, size
        return None
    return None
