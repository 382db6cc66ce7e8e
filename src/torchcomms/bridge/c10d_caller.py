"""What c10d gave a group (rank, size, timeout, reconfigure), read when c10d itself is
creating it through us.

Under ``TORCH_DISTRIBUTED_USE_TORCHCOMMS=1`` PyTorch 2.13's ``_new_process_group_helper`` calls
``new_comm(backend, device, name=..., store=..., hints=...)`` without the rank and world size
it was given (``init_process_group(rank=r, world_size=n, store=s)``, the ``mp.spawn``
pattern), so a process without rank variables in its environment has nothing to read.  The
helper holds them as its ``group_rank`` and ``group_size`` arguments; the bootstrap reads them
from its frame, and only from that function of that module.  Runs on the creating thread.

Likewise the group's ``timeout`` (no release passes it, but 2.15 for reconfigurable groups) and,
on 2.14+, its ``enable_reconfigure`` (2.14 does not pass it; 2.15 does): read from the same
frame, so ``init_process_group(timeout=..., enable_reconfigure=...)`` means the same on every
supported release.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType

_C10D = "torch.distributed.distributed_c10d"
_HELPER = "_new_process_group_helper"
#: Frames between the helper and the bootstrap's question: new_comm, the backend's init, a
#: plug-in adapter, the bootstrap; generous so a wrapper in between does not hide it.
_MAX_DEPTH = 24


def _helper_frame() -> FrameType | None:
    """c10d's group-creating frame among the callers of our caller's caller, else None."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return None
        if frame.f_code.co_name == _HELPER and frame.f_globals.get("__name__") == _C10D:
            return frame
        frame = frame.f_back
    return None


def group_rank_and_size() -> tuple[int, int] | None:
    """``(group_rank, group_size)`` of the c10d group being created by a caller, else None."""
    frame = _helper_frame()
    if frame is None:
        return None
    rank = frame.f_locals.get("group_rank")
    size = frame.f_locals.get("group_size")
    if isinstance(rank, int) and isinstance(size, int) and 0 <= rank < size:
        return rank, size
    return None


@dataclass(frozen=True)
class GroupSettings:
    #: The group's timeout when the user chose one (c10d's own default is left to ours).
    timeout: timedelta | None
    enable_reconfigure: bool


def group_settings() -> GroupSettings | None:
    """The timeout and reconfigure mode of the c10d group being created by a caller, else
    None.  A timeout equal to c10d's default (``default_pg_timeout``) is not reported: the
    user did not choose it, and ``TORCHCOMM_TIMEOUT_SECONDS`` (or ours) applies."""
    frame = _helper_frame()
    if frame is None:
        return None
    timeout = frame.f_locals.get("timeout")
    chosen = isinstance(timeout, timedelta) and timeout > timedelta(0)
    if not chosen or timeout == frame.f_globals.get("default_pg_timeout"):
        timeout = None
    return GroupSettings(timeout, frame.f_locals.get("enable_reconfigure") is True)
