"""Where a send/recv ping-pong's p99 comes from: when the slow round trips happen.

    python benchmarks/diagnostics/sendrecv_tail.py           # 20000 round trips, ranks pinned
    python benchmarks/diagnostics/sendrecv_tail.py --nogc    # the same with Python's GC off

Two ranks, each pinned to its own CPU (as ``mpirun`` binds them), exchange an 8-byte tensor
with sync ``send``/``recv``.  Rank 0 prints the p50 and p99 round trip, how many round trips
took over 3x the p50, the most common gaps (in round trips) between two such, and a sample
of their durations.  Evenly spaced outliers would point at something periodic in the library
(a flush, a check every N ops); gaps that scatter, and the same tail with the GC off, point
at the machine interrupting the ranks.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from collections import Counter
from itertools import pairwise
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import round_trip, run_local_ranks

ROUND_TRIPS = 20000
WARMUP = 500


def child() -> None:
    import torch

    import torchcomms

    torch.set_num_threads(1)
    rank = int(os.environ["TORCHCOMM_RANK"])
    os.sched_setaffinity(0, {rank % os.cpu_count()})  # type: ignore[operator]
    comm = torchcomms.new_comm("gloo", torch.device("cpu"), name="sendrecv_tail")
    tensor = torch.ones(2)
    if "--nogc" in sys.argv:
        gc.disable()
    times = [0.0] * ROUND_TRIPS
    clock = time.perf_counter_ns
    for i in range(ROUND_TRIPS + WARMUP):
        t0 = clock()
        round_trip(comm, rank, tensor, tensor)
        if i >= WARMUP:
            times[i - WARMUP] = (clock() - t0) / 1e3
    if rank == 0:
        ordered = sorted(times)
        p50, p99 = ordered[ROUND_TRIPS // 2], ordered[int(ROUND_TRIPS * 0.99)]
        slow = [i for i, v in enumerate(times) if v > 3 * p50]
        gaps = Counter(b - a for a, b in pairwise(slow)).most_common(6)
        sample = sorted(times[i] for i in slow)[:: max(1, len(slow) // 12)]
        print(f"round trip p50 {p50:.1f} us, p99 {p99:.1f} us (p99/p50 {p99 / p50:.2f})")
        print(f"over 3x p50: {len(slow)} of {ROUND_TRIPS} ({100 * len(slow) / ROUND_TRIPS:.2f} %)")
        print(f"most common gaps between them (round trips, count): {gaps}")
        print("their durations (us, a sample): " + ", ".join(f"{v:.0f}" for v in sample))
    comm.finalize()


if __name__ == "__main__":
    if os.environ.get("SENDRECV_TAIL_CHILD"):
        child()
    else:
        sys.exit(run_local_ranks(__file__, "SENDRECV_TAIL_CHILD"))
