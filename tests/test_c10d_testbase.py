"""PyTorch's own torchcomms test base class, ``C10dTorchCommsTestBase``, run on CPU/gloo.

Upstream PyTorch runs its c10d tests against torchcomms by subclassing
``torch.testing._internal.common_distributed.C10dTorchCommsTestBase`` (a
``MultiProcContinuousTest``): it spawns ``world_size`` workers that each run ``_init_pg`` once
(``torch.distributed.config.use_torchcomms = True``, ``TORCHCOMM_RANK``/``TORCHCOMM_SIZE``,
``MASTER_ADDR``/``MASTER_PORT``, ``TORCHCOMM_STORE_PATH``, a ``FileStore`` rendezvous and
``init_process_group("gloo", store=..., timeout=120 s)``), then run every test method on that
group. ``TestC10dTorchCommsCPU`` below is such a subclass (device_type ``"cpu"``, world size 2)
with all_reduce, all_gather_into_tensor, reduce_scatter_tensor, new_group and
batch_isend_irecv tests.

Why it runs in a child pytest: importing ``torch.testing._internal.common_utils`` has global
side effects on the importing process (``torch.backends.disable_global_flags()``, patched
``ScriptFunction.__call__``, argv parsing) that must not leak into the rest of our test session,
and it needs the ``expecttest`` package. So ``test_pytorch_testbase_runs_under_pytest`` starts
``python -m pytest`` on this file with ``TORCHCOMMS_C10D_TESTBASE=1`` (which defines the class)
and checks that all its tests passed; without ``expecttest`` it is skipped, saying so.

``test_reproduced_init_pg_checks`` repeats the base class's ``_init_pg`` steps and the same
checks in our harness, so the path is covered even where ``expecttest`` is missing.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.harness import REPO_ROOT, RankContext, free_port, run_ranks, timeout_scale

ENV_FLAG = "TORCHCOMMS_C10D_TESTBASE"
WORLD_SIZE = 2
CHILD_TIMEOUT_S = 180.0


# ------------------------------------------------------------------ checks shared by both paths


def check_world_is_bridge() -> None:
    pg = dist.group.WORLD
    assert type(pg).__name__ == "_BackendWrapper", type(pg)
    assert torch.distributed.config.use_torchcomms
    assert dist.get_backend() == "gloo"
    assert os.environ["TORCHCOMM_RANK"] == str(dist.get_rank())
    assert os.environ["TORCHCOMM_SIZE"] == str(dist.get_world_size())
    assert pg.get_comm().get_rank() == dist.get_rank()


def check_all_reduce(rank: int, size: int) -> None:
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    torch.testing.assert_close(t, torch.full((4,), float(size * (size + 1) // 2)), rtol=0, atol=0)
    t = torch.tensor([rank + 3], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    assert torch.equal(t, torch.tensor([size + 2])), t


def check_all_gather_into_tensor(rank: int, size: int) -> None:
    out = torch.full((size * 3,), -1, dtype=torch.int64)
    dist.all_gather_into_tensor(out, torch.arange(3, dtype=torch.int64) + 10 * rank)
    want = torch.cat([torch.arange(3, dtype=torch.int64) + 10 * r for r in range(size)])
    assert torch.equal(out, want), out


def check_reduce_scatter_tensor(rank: int, size: int) -> None:
    inp = torch.arange(size * 2, dtype=torch.int64) * (rank + 1)
    out = torch.full((2,), -1, dtype=torch.int64)
    dist.reduce_scatter_tensor(out, inp)
    total = torch.arange(size * 2, dtype=torch.int64) * sum(range(1, size + 1))
    assert torch.equal(out, total[2 * rank : 2 * rank + 2]), out


def check_new_group(rank: int, size: int) -> None:
    # a group rank 0 alone is in: everyone else gets NON_GROUP_MEMBER and does not hang it
    solo = dist.new_group([0])
    if rank == 0:
        t = torch.tensor([7])
        dist.all_reduce(t, group=solo)
        assert torch.equal(t, torch.tensor([7])) and solo.size() == 1
    else:
        assert solo is dist.GroupMember.NON_GROUP_MEMBER
    dist.destroy_process_group(solo)  # keeps the ranks' group counts (and names) in step
    everyone = dist.new_group(list(range(size)))
    assert type(everyone).__name__ == "_BackendWrapper"
    t = torch.tensor([1 << rank])
    dist.all_reduce(t, group=everyone)
    assert torch.equal(t, torch.tensor([(1 << size) - 1])), t
    dist.destroy_process_group(everyone)


def check_batch_isend_irecv(rank: int, size: int) -> None:
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    got = torch.full((3,), -1, dtype=torch.int64)
    ops = [
        dist.P2POp(dist.isend, torch.full((3,), 100 + rank, dtype=torch.int64), nxt),
        dist.P2POp(dist.irecv, got, prv),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    assert torch.equal(got, torch.full((3,), 100 + prv, dtype=torch.int64)), got


ALL_CHECKS = (
    check_all_reduce,
    check_all_gather_into_tensor,
    check_reduce_scatter_tensor,
    check_new_group,
    check_batch_isend_irecv,
)


# --------------------------------------------------------------- PyTorch's base class (child)


if os.environ.get(ENV_FLAG) == "1":
    from torch.testing._internal.common_distributed import C10dTorchCommsTestBase

    class TestC10dTorchCommsCPU(C10dTorchCommsTestBase):
        """Runs in PyTorch's own worker processes, one ``_init_pg`` for the whole class."""

        device_type = "cpu"
        world_size = WORLD_SIZE

        def test_init_pg(self) -> None:
            self.assertEqual(self.backend_str(), "gloo")
            self.assertTrue(os.path.exists(os.environ["TORCHCOMM_STORE_PATH"]))
            check_world_is_bridge()

        def test_all_reduce(self) -> None:
            check_all_reduce(self.rank, self.world_size)

        def test_all_gather_into_tensor(self) -> None:
            check_all_gather_into_tensor(self.rank, self.world_size)

        def test_reduce_scatter_tensor(self) -> None:
            check_reduce_scatter_tensor(self.rank, self.world_size)

        def test_new_group(self) -> None:
            check_new_group(self.rank, self.world_size)

        def test_batch_isend_irecv(self) -> None:
            check_batch_isend_irecv(self.rank, self.world_size)


@pytest.mark.skipif(
    importlib.util.find_spec("expecttest") is None,
    reason="torch.testing._internal.common_utils needs the 'expecttest' package "
    "(pip install expecttest); the reproduced checks below still run",
)
@pytest.mark.skipif(os.environ.get(ENV_FLAG) == "1", reason="already inside the child run")
def test_pytorch_testbase_runs_under_pytest() -> None:
    env = dict(os.environ)
    env[ENV_FLAG] = "1"
    env.pop("TORCH_DISTRIBUTED_USE_TORCHCOMMS", None)
    cmd = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
        os.path.join("tests", "test_c10d_testbase.py"), "-k", "TestC10dTorchCommsCPU",
    ]  # fmt: skip
    proc = subprocess.run(
        cmd,
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S * timeout_scale(),
        check=False,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert re.search(r"\b6 passed\b", output), output[-3000:]
    assert "skipped" not in output.splitlines()[-1], output[-3000:]


# ----------------------------------------------------- the same checks, reproduced in our harness


def _reproduced_rank(ctx: RankContext, master_port: int) -> list[str]:
    """``C10dTorchCommsTestBase._init_pg`` step by step, then every check."""
    store_path = os.path.join(ctx.tmpdir, "rdvz")
    dist.config.use_torchcomms = True
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(master_port)
    os.environ["TORCHCOMM_RANK"] = str(ctx.rank)
    os.environ["TORCHCOMM_SIZE"] = str(ctx.world_size)
    os.environ["TORCHCOMM_STORE_PATH"] = store_path
    os.environ["LOCAL_RANK"] = str(ctx.rank)
    store = dist.FileStore(store_path, ctx.world_size)
    done: list[str] = []
    try:
        dist.init_process_group(
            backend="gloo",
            world_size=ctx.world_size,
            rank=ctx.rank,
            store=store,
            timeout=timedelta(seconds=120),
        )
        check_world_is_bridge()
        for check in ALL_CHECKS:
            check(ctx.rank, ctx.world_size)
            done.append(check.__name__)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.config.use_torchcomms = False
    return done


@pytest.mark.skipif(
    importlib.util.find_spec("expecttest") is not None,
    reason="expecttest is installed: test_pytorch_testbase_runs_under_pytest runs these checks "
    "in PyTorch's own base class",
)
def test_reproduced_init_pg_checks() -> None:
    results = run_ranks(_reproduced_rank, WORLD_SIZE, free_port(), timeout=120.0)
    assert results == [[c.__name__ for c in ALL_CHECKS]] * WORLD_SIZE, results
