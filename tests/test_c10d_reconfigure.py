"""c10d's native reconfigure (torch 2.14+) on a group built under the switch (issue 52).

``init_process_group("gloo", enable_reconfigure=True)`` under ``TORCH_DISTRIBUTED_USE_TORCHCOMMS``
gives our ``_BackendWrapper``; PyTorch's own ``dist._get_reconfigure_handle`` and
``dist._reconfigure`` then drive it, the handles travelling through the default store as
PyTorch's docstring shows.  One 3-rank task: all three reconfigure (the first incarnation on
2.15, which defers the comm; a renewal on 2.14, which builds it at once), ranks 0 and 1 go on
alone while rank 2 stays out, then rank 2 joins again, each step checked by an all_reduce of
known values and by what ``dist.get_rank``/``get_world_size`` say.  Skipped on releases without
``ReconfigureOptions``.
"""

from __future__ import annotations

import inspect
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from tests.harness import SRC_DIR, RankContext, run_ranks, timeout_scale

pytestmark = pytest.mark.skipif(
    not hasattr(torch._C._distributed_c10d, "ReconfigureOptions"),
    reason="this torch has no native reconfigure (ReconfigureOptions is new in 2.14)",
)

GROUP_TIMEOUT = timedelta(seconds=45)


def _passes_timeout_to_new_comm() -> bool:
    """Whether the release hands the group's timeout to ``new_comm`` (2.15, for
    ``enable_reconfigure`` groups)."""
    create = getattr(c10d, "_create_torchcomms_backend", None)
    return create is not None and "timeout" in inspect.signature(create).parameters


def _handles(ctx: RankContext, uuid: int, members: list[int]) -> list[str]:
    """Every member's handle, in ``members`` order, exchanged through the default store."""
    store = ctx.store
    store.set(f"handle/{uuid}/{ctx.rank}", dist._get_reconfigure_handle())
    return [store.get(f"handle/{uuid}/{r}").decode() for r in members]


def _sum_check(members: list[int]) -> list[float]:
    t = torch.full((5,), float(members.index(dist.get_rank()) + 1))
    dist.all_reduce(t)
    return t.tolist()


def _rank(ctx: RankContext) -> dict[str, Any]:
    dist.config.use_torchcomms = True
    dist.init_process_group(
        "gloo",
        store=ctx.store,
        rank=ctx.rank,
        world_size=ctx.world_size,
        timeout=GROUP_TIMEOUT,
        enable_reconfigure=True,
    )
    pg = dist.group.WORLD
    seen: dict[str, Any] = {"type": type(pg).__name__, "supports": dist._supports_reconfigure()}
    seen["timeout"] = str(pg.get_comm().get_options().timeout)
    everyone = list(range(ctx.world_size))

    dist._reconfigure(uuid=1, handles=_handles(ctx, 1, everyone)).wait()
    seen["first"] = (dist.get_rank(), dist.get_world_size(), _sum_check(everyone))

    pair = [0, 1]
    if ctx.rank in pair:
        work = dist._reconfigure(uuid=2, handles=_handles(ctx, 2, pair), timeout=GROUP_TIMEOUT)
        work.wait()
        seen["pair"] = (dist.get_rank(), dist.get_world_size(), _sum_check(pair))
        ctx.store.set(f"pair_done/{ctx.rank}", "1")
    else:  # stays out until the pair has finished
        ctx.store.wait([f"pair_done/{r}" for r in pair], timedelta(seconds=60))

    dist._reconfigure(uuid=3, handles=_handles(ctx, 3, everyone)).wait()
    seen["again"] = (dist.get_rank(), dist.get_world_size(), _sum_check(everyone))
    dist.destroy_process_group()
    return seen


def test_a_switch_group_reconfigures_to_two_and_back_through_c10d_alone() -> None:
    results = run_ranks(_rank, 3, timeout=120.0, fresh=True)
    for rank, seen in enumerate(results):
        assert seen["type"] == "_BackendWrapper" and seen["supports"] is True, seen
        if _passes_timeout_to_new_comm():
            assert seen["timeout"] == str(GROUP_TIMEOUT), seen
        assert seen["first"] == (rank, 3, [6.0] * 5), (rank, seen)
        assert seen["again"] == (rank, 3, [6.0] * 5), (rank, seen)
        if rank < 2:
            assert seen["pair"] == (rank, 2, [3.0] * 5), (rank, seen)
        else:
            assert "pair" not in seen, seen


def test_torchfts_own_native_group_resize_runs_on_the_bridge() -> None:
    """torchft's own test of a native c10d group (``reconfigure_test.py``, as the installed
    torchft ships it): three spawned workers ``init_process_group("gloo",
    enable_reconfigure=True)``, resize 3 -> 2 -> 3 through ``reconfigure_with_store``, abort and
    recover; here under the switch, so the group is ours."""
    import importlib.util
    import os
    import subprocess
    import sys

    spec = importlib.util.find_spec("torchft.reconfigure_test")
    if spec is None or spec.origin is None:
        pytest.skip("torchft (with its reconfigure_test.py) is not installed")
    env = dict(os.environ, TORCH_DISTRIBUTED_USE_TORCHCOMMS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SRC_DIR, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", spec.origin,
         "-k", "resize_and_recover and gloo"],
        env=env, capture_output=True, text=True, timeout=180 * timeout_scale(),
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "1 passed" in out, out[-2000:]
    # every worker's group went through our bridge
    assert out.count("Using TorchComms backend") == 3, out[-4000:]
