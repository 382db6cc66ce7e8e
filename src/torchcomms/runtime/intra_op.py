"""One OpenMP thread for the torch kernels a communication op runs (its copies, reductions).

Why: torch runs an elementwise kernel of more than 32768 elements as an OpenMP parallel
region over its intra-op threads (one per core unless the program or its launcher says
otherwise; torchrun says 1, ``mp.spawn`` and plain scripts do not), and the region's
workers keep spinning a while after it.  On a host whose cores the ranks share, they take
the core a peer rank needs to answer: 2 ranks on the 2-core VM with torch's default of 2
threads (``bench --threads 0``), a 1 MiB all_reduce in place took 7.2 ms over tcp and 7.7 ms
over shared memory, against 0.58 and 0.42 ms with this (gloo, whose reductions are its own
loops: 1.0-3.9 ms; benchmarks/results/issue53/threads0_*.json).

How: OpenMP's thread count is a setting of each thread (``omp_set_num_threads``), and torch
reads it on the calling thread (``omp_get_max_threads``).  ``one_thread`` sets it to 1 on the
calling thread for one op and ``restore`` puts it back, so the program's own kernels, other
threads and ``torch.set_num_threads`` are untouched; ``for_this_thread`` sets it for good on
a thread of the communicator's own (its executor).  The OpenMP runtime is the one torch
loaded (found in ``/proc/self/maps``); where none is found these do nothing.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

_NAMES = ("libgomp", "libiomp5", "libomp")


def _omp_set() -> Callable[[int], None] | None:
    """``omp_set_num_threads`` of the OpenMP runtime loaded in this process, or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if line.count(" ") >= 5}
    except OSError:
        return None
    for path in sorted(paths):
        if any(name in path.rsplit("/", 1)[-1] for name in _NAMES):
            try:
                call = ctypes.CDLL(path).omp_set_num_threads
            except (OSError, AttributeError):
                continue
            call.argtypes = [ctypes.c_int]
            call.restype = None
            return call
    return None


_set = _omp_set()
#: This thread's OpenMP thread count, after torch's first use of it on the thread (which
#: would otherwise overwrite what ``one_thread`` sets).
_get = torch.get_num_threads


def one_thread() -> int:
    """Run torch kernels on this thread with one OpenMP thread until ``restore``; the count
    to restore (1 when nothing changed, so ``restore`` does nothing)."""
    before = _get()
    if before > 1 and _set is not None:
        _set(1)
        return before
    return 1


def restore(before: int) -> None:
    """Undo ``one_thread`` (``before``: what it returned)."""
    if before > 1 and _set is not None:
        _set(before)


def for_this_thread() -> None:
    """One OpenMP thread on this thread for good (a thread that only runs comm ops)."""
    if _get() > 1 and _set is not None:
        _set(1)
