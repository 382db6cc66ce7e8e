"""Sync send/recv ping-pong between 2 local ranks over the shm transport.

    python benchmarks/diagnostics/pingpong.py               # wherever the scheduler puts them
    python benchmarks/diagnostics/pingpong.py --same-core   # both ranks pinned to CPU 0
    python benchmarks/diagnostics/pingpong.py --start-same-core  # on CPU 0, then set free

Prints the p50 and p90 round trip over 3000 exchanges, how often a wait fell asleep on
its futex (after 1 ms of yielding), rank 0's CPU time per round trip, and its
``sched_yield`` calls per round trip with the time spent inside them (on a shared core,
the time the peer ran). Pinning both
ranks to one core shows what a cell of the bench costs when the scheduler keeps two ranks
on one core.  ``--start-same-core`` pins both to CPU 0 for the first 200 exchanges, then
gives them back every core, and times only what follows: whether they stay on one core (the
scheduler's choice) or split again (``transport.core_sharing``; compare with
``TORCHCOMM_SHM_UNSHARE_CORES=0``).  It also prints the p99 and the moves each rank made.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import round_trip, run_local_ranks


def parent() -> None:
    sys.exit(run_local_ranks(__file__, "PINGPONG_CHILD"))


def child() -> None:
    import torch

    import torchcomms

    comm = torchcomms.new_comm("gloo", torch.device("cpu"), name="pingpong")
    chan = comm.get_backend_impl()._ops.chan  # type: ignore[attr-defined]
    dozes = [0]
    doze = chan._doze

    def counted(*args: object) -> None:
        dozes[0] += 1
        doze(*args)

    chan._doze = counted
    real_yield = os.sched_yield
    yields = [0, 0.0]

    def timed_yield() -> None:
        t0 = time.perf_counter()
        real_yield()
        yields[0] += 1
        yields[1] += time.perf_counter() - t0

    os.sched_yield = timed_yield  # the waits look it up at each wait
    start_shared = "--start-same-core" in sys.argv
    every_core = os.sched_getaffinity(0)
    if "--same-core" in sys.argv or start_shared:
        os.sched_setaffinity(0, {0})
    rank = comm.get_rank()
    x, y = torch.ones(4), torch.empty(4)
    rtts = []
    cpu0 = time.process_time()
    for i in range(3200 if start_shared else 3000):
        if start_shared and i == 200:
            os.sched_setaffinity(0, every_core)
            rtts.clear()
            cpu0 = time.process_time()
            yields[:] = [0, 0.0]
            dozes[0] = 0
        t0 = time.perf_counter()
        round_trip(comm, rank, x, y)
        rtts.append(time.perf_counter() - t0)
    cpu_us = (time.process_time() - cpu0) / len(rtts) * 1e6  # this rank's CPU per round trip
    per_rt = len(rtts)
    rtts.sort()
    sharing = chan._sharing
    print(f"rank {rank}: stepped off a shared core {sharing.moves if sharing else 0} times")
    if rank == 0:
        p50, p90 = rtts[len(rtts) // 2] * 1e6, rtts[len(rtts) * 9 // 10] * 1e6
        p99 = rtts[len(rtts) * 99 // 100] * 1e6
        print(
            f"round trip p50 {p50:.1f} us, p90 {p90:.1f} us, p99 {p99:.1f} us; "
            f"futex sleeps: {dozes[0]}; "
            f"rank 0 CPU {cpu_us:.0f} us per round trip; {yields[0] / per_rt:.1f} yields "
            f"per round trip, {yields[1] / per_rt * 1e6:.0f} us inside them"
        )
    comm.finalize()


if __name__ == "__main__":
    child() if os.environ.get("PINGPONG_CHILD") else parent()
