"""Linux futex wait/wake on shared memory, through ``ctypes`` (no compiler needed).

A waiter that has nothing better to do blocks in the kernel until a peer rings its
doorbell word (or a short timeout passes), instead of polling with timed sleeps whose
wake-up latency is tens of microseconds, or yielding, which under the EEVDF scheduler
often hands the core straight back to the yielder.  Shared (not process-private)
futexes, because the words live in a segment mapped by several processes.
"""

from __future__ import annotations

import ctypes
import platform
import sys

_SYS_FUTEX = {"x86_64": 202, "amd64": 202}.get(platform.machine().lower())
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load() -> object | None:
    if not sys.platform.startswith("linux") or _SYS_FUTEX is None:
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn


_syscall = _load()
AVAILABLE = _syscall is not None


def wait(address: int, expected: int, timeout_s: float) -> None:
    """Sleep while the 32-bit word at ``address`` equals ``expected`` (at most ``timeout_s``)."""
    if _syscall is None:
        return
    seconds = max(timeout_s, 0.0)
    ts = _Timespec(int(seconds), int((seconds - int(seconds)) * 1e9))
    _syscall(  # type: ignore[operator]
        ctypes.c_long(_SYS_FUTEX or 0),
        ctypes.c_void_p(address),
        ctypes.c_int(_FUTEX_WAIT),
        ctypes.c_int(expected & 0xFFFFFFFF),
        ctypes.byref(ts),
        None,
        ctypes.c_int(0),
    )


def wake(address: int, count: int = 1) -> None:
    """Wake up to ``count`` waiters blocked on the word at ``address``."""
    if _syscall is None:
        return
    _syscall(  # type: ignore[operator]
        ctypes.c_long(_SYS_FUTEX or 0),
        ctypes.c_void_p(address),
        ctypes.c_int(_FUTEX_WAKE),
        ctypes.c_int(count),
        None,
        None,
        ctypes.c_int(0),
    )
