"""Reconfigure under churn: no member's next step cuts off a member still meeting.

torchft reconfigures on every quorum change, so a fast replica must not break a slow one's
recovery.  Each member serves the store its handle names; the first handle's server is
where a reconfigure meets.  These tests make that member (rank 0) as fast as it can be
(no pause anywhere) and the last member slow (a pause before each reconfigure), then:

* alternate alone / everyone / alone for 20 rounds (uuids 3k, 3k+1, 3k+2), then finalize,
  at worlds 2-4 over shm, tcp and two simulated hosts: every member's every reconfigure
  and every collective must succeed.  An all_reduce follows each step of the even rounds;
  the odd rounds go from one reconfigure to the next, as a collective would hide the race
  (before the fix, a slow member's final handshake of the "everyone" step read from a
  server that the fast one took down by finalizing);
* let the fast member exit as an interpreter does (its exit handlers run, then the
  process ends) right after a reconfigure with everyone returns, while the slow member's
  thread gets the GIL only every 0.1 s (a busy thread beside it): the others still finish
  that reconfigure and then work among themselves;
* split a store-less communicator (rank 0 serves its store) into a group without rank 0,
  which finalizes at once: the group still connects and works.

The default run: shm at 4 ranks and two hosts at 4 (both fail without the fix), the exit
and the split; ``-m slow``: tcp at 2-4 ranks, shm at 2-3, the exit over tcp.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness import RankContext, RankFailure, run_ranks
from torchcomms import ReduceOp, TorchComm, new_comm

CPU = torch.device("cpu")
ROUNDS = 20
SLOW_S = 0.02

#: (transport hint, simulated host of each rank; empty: one host)
PLACEMENTS = {"shm": ("auto", ()), "tcp": ("tcp", ()), "hier": ("auto", (0, 0, 1, 1))}


def _new(ctx: RankContext, transport: str, hosts: tuple[int, ...]) -> TorchComm:
    saved = os.environ.get("TORCHCOMM_HOST_ID")
    if hosts:
        os.environ["TORCHCOMM_HOST_ID"] = f"churn-host-{hosts[ctx.rank]}"
    try:
        return new_comm(
            "gloo",
            CPU,
            name="churn",
            store=ctx.store,
            hints={"transport": transport},
            timeout=timedelta(seconds=30),
            enable_reconfigure=True,
        )
    finally:
        if saved is None:
            os.environ.pop("TORCHCOMM_HOST_ID", None)
        else:
            os.environ["TORCHCOMM_HOST_ID"] = saved


def _handles(ctx: RankContext, comm: TorchComm, key: str) -> list[str]:
    ctx.store.set(f"{key}/{ctx.rank}", comm.get_init_handle())
    return [ctx.store.get(f"{key}/{r}").decode() for r in range(ctx.world_size)]


def _sum(comm: TorchComm, value: int) -> int:
    t = torch.full((4,), value, dtype=torch.int64)
    comm.all_reduce(t, ReduceOp.SUM, False)
    return int(t[0])


def _alternate(ctx: RankContext, transport: str, hosts: tuple[int, ...]) -> int:
    rank, size = ctx.rank, ctx.world_size
    slow = rank == size - 1 and size > 1
    comm = _new(ctx, transport, hosts)
    handles = _handles(ctx, comm, "handles")
    own = handles[rank]
    for k in range(ROUNDS):
        for step, members in enumerate(([own], handles, [own])):
            if slow:
                time.sleep(SLOW_S)
            comm.reconfigure(uuid=3 * k + step, init_handles=members)
            assert (comm.get_rank(), comm.get_size()) == (members.index(own), len(members))
            if k % 2:
                continue  # nothing between two reconfigures: the race is not masked by an op
            got = _sum(comm, rank + 1)
            want = size * (size + 1) // 2 if len(members) > 1 else rank + 1
            assert got == want, (k, step, got, want)
    comm.finalize()
    return ROUNDS


@pytest.mark.parametrize(("placement", "world"), [("shm", 4), ("hier", 4)])
def test_alone_everyone_alone_twenty_rounds(placement: str, world: int) -> None:
    transport, hosts = PLACEMENTS[placement]
    assert run_ranks(_alternate, world, transport, hosts, timeout=150) == [ROUNDS] * world


@pytest.mark.slow
@pytest.mark.parametrize(
    ("placement", "world"), [("shm", 2), ("shm", 3), ("tcp", 2), ("tcp", 3), ("tcp", 4)]
)
def test_alone_everyone_alone_at_more_worlds(placement: str, world: int) -> None:
    transport, hosts = PLACEMENTS[placement]
    assert run_ranks(_alternate, world, transport, hosts, timeout=150) == [ROUNDS] * world


@contextlib.contextmanager
def _gil_starved(interval_s: float) -> Iterator[None]:
    """Slow this process's calling thread: a busy thread keeps the GIL ``interval_s`` at a time."""
    done = threading.Event()
    hog = threading.Thread(target=lambda: [None for _ in iter(done.is_set, True)], daemon=True)
    saved = sys.getswitchinterval()
    sys.setswitchinterval(interval_s)
    hog.start()
    try:
        yield
    finally:
        done.set()
        hog.join()
        sys.setswitchinterval(saved)


def _exit_after_reconfigure(ctx: RankContext, transport: str, report: str) -> None:
    rank, size = ctx.rank, ctx.world_size
    comm = _new(ctx, transport, ())
    handles = _handles(ctx, comm, "handles")
    if rank == size - 1:
        with _gil_starved(0.1):  # each step of its handshake waits ~0.1 s for the GIL
            comm.reconfigure(uuid=1, init_handles=handles)
    else:
        comm.reconfigure(uuid=1, init_handles=handles)
    if rank == 0:
        atexit._run_exitfuncs()  # what the interpreter does on exit, then the process ends
        os._exit(0)
    comm.reconfigure(uuid=2, init_handles=handles[1:])
    seen: dict[str, Any] = {"rank_size": [comm.get_rank(), comm.get_size()], "sum": _sum(comm, 1)}
    Path(report, f"rank{rank}.json").write_text(json.dumps(seen))
    comm.finalize()


@pytest.mark.parametrize("transport", ["auto", pytest.param("tcp", marks=pytest.mark.slow)])
def test_a_member_that_exits_at_once_cuts_off_nobody(transport: str, tmp_path: Path) -> None:
    world = 3
    with pytest.raises(RankFailure) as info:
        run_ranks(_exit_after_reconfigure, world, transport, str(tmp_path), timeout=90, fresh=True)
    failure = info.value
    assert set(failure.died) == {0}, str(failure)
    assert not failure.timed_out and not failure.errors, str(failure)
    for rank in range(1, world):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen == {"rank_size": [rank - 1, world - 1], "sum": world - 1}, (rank, seen)


def _split_then_leave(ctx: RankContext, transport: str) -> list[int]:
    """Store-less comm (rank 0 serves its store); rank 0 is in no child and leaves at once."""
    rank, size = ctx.rank, ctx.world_size
    comm = new_comm(
        "gloo",
        CPU,
        name="churn_split",
        hints={"transport": transport},
        timeout=timedelta(seconds=30),
    )
    members = list(range(1, size))
    if rank == 0:
        assert comm.split([], "child") is None
        comm.finalize()
        return []
    if rank == size - 1:
        time.sleep(SLOW_S)
    child = comm.split(members, "child")
    assert child is not None
    got = [_sum(child, 1) for _ in range(3)]
    child.finalize()
    comm.finalize()
    return got


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_split_outsider_that_finalizes_at_once_cuts_off_nobody(transport: str) -> None:
    results = run_ranks(_split_then_leave, 3, transport, timeout=90)
    assert results == [[], [2, 2, 2], [2, 2, 2]], results
