"""``monitored_barrier`` as upstream's ``MonitoredBarrierTest`` drives it, on every placement.

A communicator wrapped in the c10d ``ProcessGroup`` (``_BackendWrapper``, what
``dist.monitored_barrier`` dispatches to) with ``TORCHCOMM_ABORT_ON_ERROR=1``, the default:
a straggler is rank 0's ``RuntimeError`` naming every missing rank (``wait_all_ranks``) or
the first, within timeout + 1 s, never the end of the process; the communicator stays
usable; a straggler that arrives late completes rank 0's next monitored barrier, as a gloo
message would.  One task per placement: shm by default; tcp and two simulated hosts with
``-m slow`` (the barrier uses the store, not the transport, so they check the same path).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

from tests.harness import RankContext, run_ranks, timeout_scale
from torchcomms import ReduceOp, new_comm
from torchcomms._comms import _BackendWrapper

CPU = torch.device("cpu")

#: (transport hint, simulated host of each rank; empty: one host)
PLACEMENTS = {"shm": ("auto", ()), "tcp": ("tcp", ()), "hier": ("auto", (0, 0, 1, 1))}


def _refused(pg: Any, timeout: timedelta, wait_all_ranks: bool) -> tuple[str, float]:
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        pg.monitored_barrier(timeout=timeout, wait_all_ranks=wait_all_ranks)
    return str(info.value), time.monotonic() - start


def _cases(ctx: RankContext, transport: str, hosts: tuple[int, ...], short_s: float) -> Any:
    rank, size = ctx.rank, ctx.world_size
    saved = os.environ.get("TORCHCOMM_HOST_ID")
    if hosts:
        os.environ["TORCHCOMM_HOST_ID"] = f"mb-host-{hosts[rank]}"
    try:
        comm = new_comm(
            "gloo",
            CPU,
            name="mb",
            store=ctx.store,
            hints={"transport": transport},
            timeout=timedelta(seconds=30),
        )
    finally:
        if saved is None:
            os.environ.pop("TORCHCOMM_HOST_ID", None)
        else:
            os.environ["TORCHCOMM_HOST_ID"] = saved
    pg = _BackendWrapper(comm)
    short, long = timedelta(seconds=short_s), timedelta(seconds=30)
    seen: dict[str, Any] = {"backend": comm.get_backend_impl().transport}  # type: ignore[attr-defined]

    def usable(case: str) -> None:
        t = torch.full((4,), rank + 1, dtype=torch.int64)
        comm.all_reduce(t, ReduceOp.SUM, False)
        assert int(t[0]) == size * (size + 1) // 2, (case, t)

    # every rank checks in
    pg.monitored_barrier(timeout=long, wait_all_ranks=True)
    pg.monitored_barrier(timeout=long, wait_all_ranks=False)
    # wait_all_ranks: no other rank checks in; rank 0 names them all
    if rank == 0:
        seen["all"] = _refused(pg, short, True)
    comm.barrier(False)
    usable("after wait_all_ranks")
    # fast fail, upstream's case: no other rank checks in; rank 0 names the first
    if rank == 0:
        seen["fast"] = _refused(pg, short, False)
    comm.barrier(False)
    usable("after fast fail")
    # fast fail with only the last rank missing: the others were never released
    if rank != size - 1:
        seen["last"] = _refused(pg, short, False)
    comm.barrier(False)
    usable("after the last rank missed")
    # everyone checks in again: the counts still match
    pg.monitored_barrier(timeout=long, wait_all_ranks=True)
    # a late straggler completes rank 0's next barrier
    if rank == 0:
        seen["late"] = _refused(pg, short, True)
        pg.monitored_barrier(timeout=long, wait_all_ranks=True)
    else:
        time.sleep(short_s * 1.5)  # rank 0 has given up on this arrival
        pg.monitored_barrier(timeout=long, wait_all_ranks=True)
    usable("at the end")
    comm.finalize()
    return seen


@pytest.mark.parametrize(
    "placement",
    # The barrier goes through the store, never the transport: tcp and two hosts with -m slow.
    [p if p == "shm" else pytest.param(p, marks=pytest.mark.slow) for p in PLACEMENTS],
)
def test_a_straggler_is_named_and_the_comm_stays_usable(placement: str) -> None:
    transport, hosts = PLACEMENTS[placement]
    world = len(hosts) or 3
    short_s = 0.5 * timeout_scale()
    ms = int(short_s * 1000)
    results = run_ranks(
        _cases,
        world,
        transport,
        hosts,
        short_s,
        timeout=90,
        env={"TORCHCOMM_ABORT_ON_ERROR": "1"},
    )
    first = ", ".join(map(str, range(1, world)))
    root = results[0]
    expected = {
        "all": f"[Rank 0]: Ranks {first} failed to pass monitoredBarrier in {ms} ms",
        "fast": f"[Rank 0]: Rank 1 failed to pass monitoredBarrier in {ms} ms",
        "last": f"[Rank 0]: Rank {world - 1} failed to pass monitoredBarrier in {ms} ms",
        "late": f"[Rank 0]: Ranks {first} failed to pass monitoredBarrier in {ms} ms",
    }
    for case, text in expected.items():
        message, took = root[case]
        assert message == text, (case, root)
        assert short_s - 0.05 <= took < short_s + 1.0, (case, took)
    for rank in range(1, world - 1):
        message, took = results[rank]["last"]
        assert message == f"[Rank {rank}]: Rank 0 did not release monitoredBarrier within {ms} ms"
        assert took < short_s + 1.0, (rank, took)
    assert "last" not in results[world - 1]
    kind = {"shm": "shm", "tcp": "tcp", "hier": "hier"}[placement]
    assert kind in root["backend"], root["backend"]
