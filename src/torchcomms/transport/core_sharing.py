"""Step off a core that a lower-ranked peer of this host runs on, without pinning anything.

Why: when nothing pins the ranks (``torchrun``, ``mp.spawn``), the scheduler sometimes puts
two ranks of a small host on one core and keeps them there while another core idles: a
rank that spins or yields never looks idle, so the balancer leaves it where its cache is.
Every hand-over between them then costs ~150 us instead of a few, and the p99 of small ops
jumps 5-30x (``docs/benchmark.md``, "Ranks that share a core").  Pinning cures it
(``TORCHCOMM_CPU_AFFINITY=spread``) but pins the user's process for good.

The remedy here is lighter.  When a wait outlasts its spin phase, the waiting thread
publishes the core it runs on in its word of the segment.  If a lower-ranked member
published the same core, the thread narrows its own affinity to the other allowed cores,
which makes the kernel move it at once, then restores the affinity it had.  Only the
higher rank of a pair moves, so two ranks never chase each other, and a thread moves at
most once per ``MIN_GAP_S``.  Used only when the ranks have a core each
(``WaitPolicy.oversubscribed`` is false); ``TORCHCOMM_SHM_UNSHARE_CORES=0`` turns it off.

Runs on the thread that waits (the communicator's op thread, or the caller's for a sync op).
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable, Sequence


def _getcpu_function() -> Callable[[], int] | None:
    """glibc's ``sched_getcpu`` (a vDSO read, ~0.1 us through ctypes), or None without it."""
    try:
        fn = ctypes.CDLL(None).sched_getcpu
    except (AttributeError, OSError):  # pragma: no cover - not glibc
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = []
    return fn


_getcpu = _getcpu_function()
AVAILABLE = _getcpu is not None and hasattr(os, "sched_setaffinity")

#: Least time between two moves of one thread (a move costs ~50 us: the kernel migrates the
#: thread before ``sched_setaffinity`` returns).
MIN_GAP_S = 0.01


class CoreSharing:
    """This rank's view of where its lower-ranked peers run (``flags`` words: core + 1, 0 unknown)."""

    __slots__ = ("_flags", "_lower", "_mine", "_next", "moves")

    def __init__(self, flags: memoryview, mine: int, lower: Sequence[int]) -> None:
        self._flags = flags
        self._mine = mine
        self._lower = list(lower)
        self._next = 0.0
        #: How many times this thread stepped off a shared core (for tests and diagnostics).
        self.moves = 0

    def check(self) -> None:
        """Publish this thread's core; step off it if a lower-ranked peer published it too."""
        assert _getcpu is not None
        core = _getcpu() + 1
        flags = self._flags
        flags[self._mine] = core
        if core <= 0 or not any(flags[w] == core for w in self._lower):
            return
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + MIN_GAP_S
        if _step_off(core - 1):
            self.moves += 1
            flags[self._mine] = _getcpu() + 1


def _step_off(core: int) -> bool:
    """Move the calling thread off ``core`` and give it back the affinity it had."""
    try:
        allowed = os.sched_getaffinity(0)
        others = allowed - {core}
        if not others or core not in allowed:
            return False
        os.sched_setaffinity(0, others)  # the kernel migrates the thread before returning
        os.sched_setaffinity(0, allowed)
    except OSError:  # affinity refused (a container's cpuset changed meanwhile)
        return False
    return True
