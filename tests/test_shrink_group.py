"""``torch.distributed.shrink_group`` on CPU, through the torchcomms bridge.

With ``use_torchcomms`` on, the default group and ``new_group`` groups are our
``_BackendWrapper``; ``dist.shrink_group`` asks it for ``supports_shrinking`` and
``shrink(...)``.  Cases, on 3 ranks:

* the default group after a rank was SIGKILLed: the survivors shrink it, and the world,
  ranks and collectives of the new default group are right;
* a sub-group with ``SHRINK_ABORT`` while the survivors' async op waits for the excluded
  rank (alive, but it never joins): the op fails at once as aborted, and the shrunk group
  works.
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from tests.harness import RankContext, RankFailure, run_ranks

ENV = {"TORCHCOMM_ABORT_ON_ERROR": "0"}


def _init(ctx: RankContext) -> None:
    dist.config.use_torchcomms = True
    dist.init_process_group(
        "gloo",
        store=ctx.store,
        rank=ctx.rank,
        world_size=ctx.world_size,
        timeout=timedelta(seconds=20),
    )
    assert type(dist.group.WORLD).__name__ == "_BackendWrapper"


def _sum(value: int, group: Any = None) -> int:
    t = torch.full((4,), value, dtype=torch.int64)
    dist.all_reduce(t, group=group)
    return int(t[0])


def _default_group_after_kill(ctx: RankContext, report_dir: str) -> None:
    _init(ctx)
    try:
        assert _sum(1) == 3
        if ctx.rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        seen: dict[str, Any] = {}
        try:
            _sum(1)
            seen["before"] = None
        except RuntimeError as exc:
            seen["before"] = type(exc).__name__
        new_world = dist.shrink_group([2])
        seen["world"] = [dist.get_rank(), dist.get_world_size()]
        seen["is_world"] = new_world is dist.group.WORLD
        seen["sum"] = _sum(ctx.rank + 1)
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
        dist.all_gather(out, torch.tensor([ctx.rank * 7]))
        seen["gathered"] = [int(o) for o in out]
        seen["comm"] = [new_world._get_backend(torch.device("cpu")).get_comm().get_size()]
        Path(report_dir, f"rank{ctx.rank}.json").write_text(json.dumps(seen))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.config.use_torchcomms = False


def test_shrink_default_group_after_a_kill(tmp_path: Path) -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(_default_group_after_kill, 3, str(tmp_path), timeout=90, env=ENV)
    failure = info.value
    assert set(failure.died) == {2} and not failure.errors and not failure.timed_out, str(failure)
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["before"] == "PeerFailureError", seen
        assert seen["world"] == [rank, 2] and seen["is_world"], seen
        assert seen["sum"] == 3 and seen["gathered"] == [0, 7], seen
        assert seen["comm"] == [2], seen


def _sub_group_abort(ctx: RankContext) -> dict[str, Any]:
    _init(ctx)
    seen: dict[str, Any] = {}
    try:
        sub = dist.new_group([0, 1, 2])
        assert _sum(1, sub) == 3
        if ctx.rank == 1:  # excluded: alive, but it never joins another op of the group
            ctx.store.wait(["shrunk"], timedelta(seconds=60))
            return seen
        pending = dist.all_reduce(torch.ones(4), group=sub, async_op=True)
        time.sleep(0.3)  # it waits for rank 1
        start = time.monotonic()
        small = dist.shrink_group([1], group=sub, shrink_flags=c10d.SHRINK_ABORT)
        try:
            pending.wait()
            seen["pending"] = None
        except RuntimeError as exc:
            seen["pending"] = type(exc).__name__
        seen["pending_s"] = time.monotonic() - start
        seen["group"] = [dist.get_rank(small), dist.get_world_size(small)]
        seen["sum"] = _sum(ctx.rank, small)
        ctx.store.set(f"done/{ctx.rank}", "1")
        ctx.store.wait(["done/0", "done/2"], timedelta(seconds=30))
        if ctx.rank == 0:
            ctx.store.set("shrunk", "1")
        return seen
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.config.use_torchcomms = False


def test_shrink_sub_group_with_abort() -> None:
    results = run_ranks(_sub_group_abort, 3, timeout=90, env=ENV, fresh=True)
    for rank in (0, 2):
        seen = results[rank]
        assert seen["pending"] == "CommAbortedError", seen
        assert seen["pending_s"] < 10, seen
        assert seen["group"] == [0 if rank == 0 else 1, 2], seen
        assert seen["sum"] == 2, seen
