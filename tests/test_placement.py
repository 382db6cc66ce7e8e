"""Opt-in CPU placement (``TORCHCOMM_CPU_AFFINITY`` / hint ``cpu_affinity``).

* ``spread``: local rank i runs on allowed core i mod n, every thread of the process (the
  op thread, and threads started later), once per process; later comms keep it.
* ``off`` (the default) pins nothing.
* A bad value is refused at ``new_comm``, naming the setting.

Pinned processes are never reused (``fresh=True``): the placement would leak into later tests.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

import pytest
import torch

from tests.harness import RankContext, run_ranks
from torchcomms import ReduceOp, config, new_comm
from torchcomms.transport import core_sharing, placement

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


def _pinned_by_launcher(ctx: RankContext, cores: list[int]) -> dict[str, Any]:
    os.sched_setaffinity(0, {cores[ctx.rank]})  # as mpirun's binding leaves a rank
    comm = new_comm("gloo", CPU, name="bound", store=ctx.store)
    chan = comm.get_backend_impl()._ops.chan  # type: ignore[attr-defined]
    out = {"oversubscribed": chan.policy.oversubscribed, "unshare": chan.policy.unshare_cores}
    comm.finalize()
    return out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_launcher_that_gives_each_rank_its_own_core_is_not_oversubscription() -> None:
    """Each rank sees one allowed core, but together they have two: the waits may spin.
    Two ranks bound to one core must share it: no spin, and no stepping off it."""
    first, second = sorted(os.sched_getaffinity(0))[:2]
    own = run_ranks(_pinned_by_launcher, 2, [first, second], fresh=True)
    assert all(not r["oversubscribed"] and r["unshare"] for r in own), own
    shared = run_ranks(_pinned_by_launcher, 2, [first, first], fresh=True)
    assert all(r["oversubscribed"] and not r["unshare"] for r in shared), shared


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2 or not core_sharing.AVAILABLE, reason="needs two cores"
)
def test_a_thread_on_a_lower_ranks_core_steps_off_it_and_keeps_its_affinity() -> None:
    """``CoreSharing.check`` with a lower rank's word naming this thread's core: the kernel
    moves the thread to another allowed core, and its affinity is what it was; once per
    ``MIN_GAP_S``; a word naming another core moves nothing."""
    allowed = os.sched_getaffinity(0)
    core = min(allowed)
    words = memoryview(bytearray(16)).cast("q")
    sharing = core_sharing.CoreSharing(words, 0, [1])
    done: list[tuple[int, int, set[int], int]] = []

    def on_shared_core() -> None:
        os.sched_setaffinity(0, {core})
        os.sched_setaffinity(0, allowed)  # free again, but still running on ``core``
        words[1] = core + 1  # the lower rank runs there
        sharing.check()
        moved_to = ctypes.CDLL(None).sched_getcpu()
        words[1] = moved_to + 1  # it followed at once: too soon to move again
        sharing.check()
        done.append((sharing.moves, moved_to, os.sched_getaffinity(0), words[0] - 1))

    thread = threading.Thread(target=on_shared_core)  # a thread of its own: affinity is per thread
    thread.start()
    thread.join()
    moves, moved_to, after, published = done[0]
    assert moves == 1 and moved_to != core and after == allowed, done
    assert published == moved_to, done
    words[1] = 0  # no lower rank known: publish only
    sharing.check()
    assert sharing.moves == 1
