"""Whether every core this process may use is taken right now, for how long a wait spins.

Why: on a VM, a rank that blocks in ``poll`` leaves its vCPU idle, and waking an idle
vCPU costs 0.1-4 ms; two ranks that each block before the other answers fall into that
rhythm and stay there.  A spin of a millisecond keeps them out of it.  When the cores are
busy (training's compute and data loading beside the ranks), a long spin holds a core a
peer or the work needs, and a short one is better (measured with ``bench --load``).

The sign is Linux's count of runnable tasks (``/proc/loadavg``'s fourth field, this task
included) against the cores this process may run on.  Read with ``pread`` on a kept
descriptor (~1 us), at most once per ``REFRESH_S``; where it cannot be read the cores
count as busy (the short spin) and the next reading opens it again.  Any thread may ask; a
stale answer only costs speed.

Also where a thread runs (``current_cpu``) and which kernel (``KERNEL_ID``): the tcp
headers carry both, so a wait need not spin for a peer queued on its own core
(``transport.tcp.lane.Lane.spin_budget``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import time
from collections.abc import Callable

#: How long one reading of the run queue is trusted.
REFRESH_S = 0.005

_fd: int | None = None
_cores = 0
_busy = True
_checked = -1.0


def cores_busy() -> bool:
    """Whether more tasks are runnable on this machine than this process has cores."""
    global _fd, _cores, _busy, _checked
    now = time.monotonic()
    if now - _checked < REFRESH_S:
        return _busy
    _checked = now
    try:
        if _fd is None:
            _cores = len(os.sched_getaffinity(0))
            _fd = os.open("/proc/loadavg", os.O_RDONLY | os.O_CLOEXEC)
        running = int(os.pread(_fd, 128, 0).split()[3].split(b"/")[0])
    except (OSError, AttributeError, IndexError, ValueError):
        _fd = None  # opened again at the next reading
        _busy = True
        return _busy
    _busy = running > _cores
    return _busy


def _getcpu() -> Callable[[], int]:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        call = libc.sched_getcpu
    except (OSError, AttributeError):
        return lambda: -1
    call.restype = ctypes.c_int
    call.argtypes = []
    return call


#: The core the calling thread runs on now (-1 where unknown): ``sched_getcpu``, ~0.3 us.
current_cpu: Callable[[], int] = _getcpu()


def _kernel_id() -> int:
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip()
    except OSError:
        return 0
    return int.from_bytes(hashlib.sha256(boot).digest()[:8], "little", signed=True) or 1


#: This kernel's boot as a nonzero int64 (0 where unknown): processes that show the same
#: one share cores, also from different network namespaces (simulated hosts).
KERNEL_ID = _kernel_id()


def on_this_core(kernel: int, core: int) -> bool:
    """Whether a peer that said it ran on ``core`` of ``kernel`` ran on the core the calling
    thread runs on now: never when either is unknown (core -1, kernel 0)."""
    return bool(KERNEL_ID and kernel == KERNEL_ID and core >= 0 and core == current_cpu())
