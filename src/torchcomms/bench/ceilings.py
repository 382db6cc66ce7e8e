"""Memory-bandwidth probe: copy (``b = a``) and add (``c = a + b``) on buffers far larger than the LLC.

Bytes are counted as the kernel moves them: a copy reads ``M`` and writes ``M`` (2M), an add
reads 2M and writes M (3M).  The same accounting is used by the ceiling models in ``ops``.
The N-process figure is measured by the benchmark's own ranks running the probe at the same
time (``runner`` synchronises them); here is only the single-process kernel.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch

_MIB = 1 << 20


def llc_bytes() -> int | None:
    """Size of the largest CPU cache of cpu0, from sysfs (``None`` if unknown)."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    best = None
    try:
        entries = os.listdir(base)
    except OSError:
        return None
    for entry in entries:
        try:
            with open(os.path.join(base, entry, "size")) as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
        digits = text.rstrip("KMGkmg")
        if digits.isdigit():
            size = int(digits) * scale
            best = size if best is None else max(best, size)
    return best


def probe_bytes(quick: bool) -> int:
    """Buffer size: 8x the LLC, at least 64 MiB, at most 512 MiB; in quick mode 2x the LLC, at
    least 32 MiB, at most 64 MiB (a quick run stays quick on a VM that reports a 480 MiB LLC,
    at the price of a ceiling that may count cache bandwidth)."""
    llc = llc_bytes() or 32 * _MIB
    if quick:
        return min(max(2 * llc, 32 * _MIB), 64 * _MIB)
    return min(max(8 * llc, 64 * _MIB), 512 * _MIB)


class Probe:
    """Three buffers of ``nbytes`` each, touched once so page faults are not timed."""

    def __init__(self, nbytes: int) -> None:
        n = max(nbytes // 4, 1)
        self.nbytes = n * 4
        self.a = torch.ones(n, dtype=torch.float32)
        self.b = torch.ones(n, dtype=torch.float32)
        self.c = torch.zeros(n, dtype=torch.float32)

    def copy(self, reps: int) -> tuple[float, int]:
        """Median seconds of one copy over ``reps`` (after a warm-up), and the bytes it moves."""
        return _median_time(lambda: self.b.copy_(self.a), reps), 2 * self.nbytes

    def add(self, reps: int) -> tuple[float, int]:
        """Median seconds of one add over ``reps`` (after a warm-up), and the bytes it moves."""
        return _median_time(lambda: torch.add(self.a, self.b, out=self.c), reps), 3 * self.nbytes


def _median_time(kernel: Callable[[], object], reps: int) -> float:
    kernel()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        kernel()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
