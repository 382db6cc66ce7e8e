"""Opt-in CPU placement (``TORCHCOMM_CPU_AFFINITY`` / hint ``cpu_affinity``).

* ``spread``: local rank i runs on allowed core i mod n, every thread of the process (the
  op thread, and threads started later), once per process; later comms keep it.
* ``off`` (the default) pins nothing.
* A bad value is refused at ``new_comm``, naming the setting.

Pinned processes are never reused (``fresh=True``): the placement would leak into later tests.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch

from tests.harness import RankContext, run_ranks
from torchcomms import ReduceOp, config, new_comm
from torchcomms.transport import placement

CPU = torch.device("cpu")


def _placed(ctx: RankContext) -> dict[str, Any]:
    allowed = sorted(os.sched_getaffinity(0))
    comm = new_comm("gloo", CPU, name="placed", store=ctx.store)
    t = torch.full((4,), float(ctx.rank + 1))
    comm.all_reduce(t, ReduceOp.SUM, False)
    later: list[set[int]] = []
    thread = threading.Thread(target=lambda: later.append(os.sched_getaffinity(0)))
    thread.start()
    thread.join()
    second = new_comm("gloo", CPU, name="second", store=ctx.store, hints={"cpu_affinity": "off"})
    out = {
        "allowed": allowed,
        "core": placement.placed_core(),
        "main": sorted(os.sched_getaffinity(0)),
        "thread": sorted(later[0]),
        "sum": float(t[0]),
        "second_core": placement.placed_core(),
        "policy_spins": comm.get_backend_impl()._ops.chan.policy.spins,  # type: ignore[attr-defined]
    }
    second.finalize()
    comm.finalize()
    return out


def test_spread_pins_local_rank_i_to_core_i_mod_n() -> None:
    results = run_ranks(_placed, 2, env={"TORCHCOMM_CPU_AFFINITY": "spread"}, fresh=True)
    for rank, r in enumerate(results):
        want = r["allowed"][rank % len(r["allowed"])]
        assert r["core"] == want and r["main"] == [want] and r["thread"] == [want], r
        assert r["second_core"] == want, r  # the first comm placed the process; kept
        assert r["sum"] == 3.0, r
        # Two ranks on at least two cores: each has a core of its own, so waits may spin.
        if len(r["allowed"]) >= 2:
            assert r["policy_spins"] > 0, r


def _not_placed(ctx: RankContext) -> dict[str, Any]:
    before = sorted(os.sched_getaffinity(0))
    comm = new_comm("gloo", CPU, name="free", store=ctx.store)
    out = {
        "before": before,
        "after": sorted(os.sched_getaffinity(0)),
        "core": placement.placed_core(),
    }
    comm.finalize()
    return out


def test_off_by_default_pins_nothing() -> None:
    for r in run_ranks(_not_placed, 2, env={"TORCHCOMM_CPU_AFFINITY": None}, fresh=True):
        assert r["before"] == r["after"] and r["core"] is None, r


def _bad_value(ctx: RankContext) -> str:
    with pytest.raises(RuntimeError) as info:
        new_comm("gloo", CPU, name="bad", store=ctx.store, hints={"cpu_affinity": "everywhere"})
    return str(info.value)


def test_a_bad_value_is_refused_naming_the_setting() -> None:
    for text in run_ranks(_bad_value, 1, fresh=True):
        assert "hint cpu_affinity" in text and "'everywhere'" in text and "spread" in text, text
    with pytest.raises(RuntimeError, match="TORCHCOMM_CPU_AFFINITY"):
        os.environ["TORCHCOMM_CPU_AFFINITY"] = "bogus"
        try:
            config.cpu_affinity(None)
        finally:
            del os.environ["TORCHCOMM_CPU_AFFINITY"]
