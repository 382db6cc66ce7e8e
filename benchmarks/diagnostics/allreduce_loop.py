"""A tight loop of sync all_reduces between 2 local ranks: the shm latency path alone.

    python benchmarks/diagnostics/allreduce_loop.py [--calls 10000] [--numel 2] [--pin]

Each rank times every call of ``comm.all_reduce`` (float32, SUM, sync) with nothing else
in the loop (the bench adds its own timing and checks around each call), and prints its
p10/p50/p90, its CPU time per op, and how many calls entered the channel's wait loop
(``wait_all``: the peer was not there within the inline checks).  ``--pin`` pins rank r to
CPU r.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import run_local_ranks


def parent() -> None:
    sys.exit(run_local_ranks(__file__, "ALLREDUCE_LOOP_CHILD"))


def _arg(name: str, default: int) -> int:
    return int(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


def child() -> None:
    import torch

    import torchcomms
    from torchcomms import ReduceOp

    torch.set_num_threads(1)
    calls, numel = _arg("--calls", 10_000), _arg("--numel", 2)
    comm = torchcomms.new_comm("gloo", torch.device("cpu"), name="allreduce_loop")
    rank = comm.get_rank()
    if "--pin" in sys.argv:
        os.sched_setaffinity(0, {rank})
    chan = comm.get_backend_impl()._ops.chan  # type: ignore[attr-defined]
    slow = [0]
    wait_all = chan.wait_all

    def counted(*args: object, **kwargs: object) -> None:
        slow[0] += 1
        wait_all(*args, **kwargs)

    chan.wait_all = counted
    t = torch.zeros(numel)  # zeros: the sums stay finite however many calls
    op = ReduceOp.SUM
    for _ in range(2000):
        comm.all_reduce(t, op, False)
    slow[0] = 0
    times = []
    cpu0 = time.process_time()
    for _ in range(calls):
        t0 = time.perf_counter()
        comm.all_reduce(t, op, False)
        times.append(time.perf_counter() - t0)
    cpu_us = (time.process_time() - cpu0) / calls * 1e6
    times.sort()
    p10, p50, p90 = (times[calls * q // 100] * 1e6 for q in (10, 50, 90))
    print(
        f"rank {rank}: p10 {p10:.1f} us, p50 {p50:.1f} us, p90 {p90:.1f} us; "
        f"CPU {cpu_us:.1f} us/op; wait loop entered {slow[0]}/{calls}"
    )
    comm.finalize()


if __name__ == "__main__":
    child() if os.environ.get("ALLREDUCE_LOOP_CHILD") else parent()
