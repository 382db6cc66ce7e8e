"""Opt-in CPU placement: pin the ranks of one host to cores, ``local rank i -> core i mod n``.

Why: with the scheduler free to choose, two ranks of a 2-core host often share one core
while the other idles (the bench saw ``cpu_cores_busy`` near 1.0), and a hand-over between
ranks on one core costs hundreds of microseconds on a small VM: the waiter holds the core
its peer needs, and every switch between two torch processes refills caches.  Spreading
the ranks over the allowed cores keeps each on a core of its own when there are enough,
and shares cores evenly when there are not.

``TORCHCOMM_CPU_AFFINITY`` (or the hint ``cpu_affinity``, read by ``config.cpu_affinity``):
``off`` (the default: the scheduler decides) or ``spread``.  The first communicator of a
process that asks for it places the process (every thread it has, and so every thread it
starts later); later communicators keep that placement.  The cores are the ones the process may use when it is
placed (``os.sched_getaffinity``), so a launcher's own pinning narrows them first.

Runs on the thread that creates the communicator, at connect.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable

logger = logging.getLogger("torchcomms.transport.placement")

_lock = threading.Lock()
_placed_core: int | None = None
_spread_over: int | None = None


def place(requested: str, local_index: int, local_count: int) -> int | None:
    """Pin this process to its core when ``requested`` is ``spread`` (once per process).

    ``local_index`` is this rank's position among the communicator's members on this host
    and ``local_count`` their number.  Returns the core, or None when nothing was pinned
    (``off``, or no affinity API on this platform).
    """
    global _placed_core, _spread_over
    if requested != "spread":
        return None
    with _lock:
        if _placed_core is not None:
            return _placed_core
        try:
            allowed = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # pragma: no cover - non-Linux
            return None
        core = allowed[local_index % len(allowed)]
        for tid in _threads():
            try:
                os.sched_setaffinity(tid, {core})
            except OSError:  # a thread that ended meanwhile
                continue
        _placed_core = core
        _spread_over = min(len(allowed), local_count)
        logger.info(
            "torchcomms: local rank %d of %d pinned to core %d (of %s)",
            local_index,
            local_count,
            core,
            allowed,
            extra={"core": core},
        )
        return core


def placed_core() -> int | None:
    """The core this process was pinned to by ``place``, if it was."""
    return _placed_core


def usable_cores(pids: Iterable[int] = ()) -> int:
    """How many cores this host's ranks run on: what ``place`` spread them over, else the
    union of the cores this process and the processes ``pids`` may use.

    The union, not this process's own count: a launcher that pins each rank to a core of
    its own (``mpirun``'s default binding) leaves every rank one allowed core, yet no two
    ranks share one.  A peer that has exited, or that this process may not inspect, is
    left out.
    """
    if _spread_over is not None:
        return _spread_over
    try:
        cores = set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return os.cpu_count() or 1
    for pid in pids:
        try:
            cores |= os.sched_getaffinity(pid)
        except OSError:  # gone, or not ours to inspect
            continue
    return len(cores)


def _threads() -> list[int]:
    """The kernel ids of this process's threads (affinity is per thread on Linux)."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # pragma: no cover - no /proc
        return [0]
