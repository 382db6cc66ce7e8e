"""Pure metric functions: size units, the size sweep, percentiles, algbw/busbw, ceilings.

Conventions are nccl-tests': sizes in binary units (``1K`` = 1024 B), bandwidths in
GB/s with GB = 1e9 B, ``algbw = S / t`` and ``busbw = algbw * factor``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

GB = 1e9

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Parse ``8``, ``1K``, ``64M``, ``2G`` (binary units; ``KB``/``KiB`` accepted) to bytes."""
    match = _SIZE_RE.match(text)
    if match is None:
        raise ValueError(
            f"invalid size {text!r} (expected an integer with an optional K/M/G suffix)"
        )
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def format_size(nbytes: int) -> str:
    """Bytes in the largest binary unit that divides them exactly: ``64 MiB``, ``1536 B``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def size_sweep(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """nccl-tests' ``-b/-e/-f`` sweep: ``b, b*f, b*f^2, ...`` while ``<= e``."""
    if min_bytes < 0 or max_bytes < min_bytes:
        raise ValueError(f"invalid size range {min_bytes}..{max_bytes}")
    if min_bytes == max_bytes:
        return [min_bytes]
    if factor < 2:
        raise ValueError(f"size factor must be >= 2 (got {factor})")
    if min_bytes == 0:
        raise ValueError("a sweep (-b < -e) needs -b > 0")
    sizes = []
    size = min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation (numpy's default method)."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(times_s: Sequence[float]) -> dict[str, float]:
    """p50 (primary), mean, p99, min and max of iteration times, in microseconds."""
    us = [t * 1e6 for t in times_s]
    return {
        "p50_us": percentile(us, 50),
        "mean_us": sum(us) / len(us),
        "p99_us": percentile(us, 99),
        "min_us": min(us),
        "max_us": max(us),
    }


def algbw(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s: ``S / t``."""
    if seconds <= 0:
        return 0.0
    return nbytes / seconds / GB


def busbw(algbw_gbps: float, factor: float) -> float:
    """Bus bandwidth in GB/s: ``algbw * factor`` (the op's nccl-tests factor)."""
    return algbw_gbps * factor


def ceiling_algbw(mem_bw_gbps: float, traffic_per_byte: float) -> float:
    """Memory-bound ceiling on algbw: ``B / k`` when the op moves ``k * S`` bytes of memory."""
    if traffic_per_byte <= 0:
        return math.inf
    return mem_bw_gbps / traffic_per_byte


def wire_ceiling_algbw(wire_gbps: float, busbw_factor: float) -> float:
    """Wire-bound ceiling on algbw: busbw (each rank's traffic on its link, nccl-tests'
    factor) cannot pass the wire's ``W`` GB/s, so ``algbw <= W / factor``."""
    if busbw_factor <= 0:
        return math.inf
    return wire_gbps / busbw_factor


def ceiling_model(transport: str, hosts: int) -> str:
    """``wire`` when the bytes cross TCP (the transport is tcp, or the ranks span hosts),
    else ``memory`` (shared memory on one host)."""
    return "wire" if hosts > 1 or transport.startswith("tcp") else "memory"


def ratio(gloo_p50_us: float, ours_p50_us: float) -> float:
    """``gloo p50 / ours p50``: above 1 means ours is faster."""
    if ours_p50_us <= 0:
        return math.nan
    return gloo_p50_us / ours_p50_us
