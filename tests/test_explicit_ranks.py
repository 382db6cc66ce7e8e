"""Explicit ranks under ``TORCH_DISTRIBUTED_USE_TORCHCOMMS=1`` (issue 37, item 3).

``init_process_group(backend, rank=r, world_size=n, ...)`` with no rank variables in the
environment is how ``mp.spawn`` scripts and PyTorch's own ``MultiProcessTestCase`` /
``DTensorTestBase`` suites start.  PyTorch 2.13 calls ``new_comm`` without that rank; ours
reads it from c10d's group helper (``torchcomms.bridge.c10d_caller``).

* ``test_dtensor_testbase_on_torchcomms_equals_gloo``: PyTorch's ``DTensorTestBase`` (world 2,
  ``init_method=file://``, explicit ranks) runs one DTensor / tensor-parallel / FSDP2 case with
  the switch on and the same case on plain gloo, in a child pytest; every result tensor of
  the two runs must be bit-identical, and the switched run must have run on ``_BackendWrapper``
  with no ``RANK``/``TORCHCOMM_RANK`` in its environment.
* ``test_mp_spawn_script_with_explicit_ranks``: an ``mp.spawn`` script whose workers call
  ``init_process_group("gloo", rank=r, world_size=n, store=TCPStore)`` with ``import
  torchcomms`` first, as a user writes it; checks the group type and the values.

Why a child pytest: ``torch.testing._internal.common_utils`` changes global state of the
process that imports it (see tests/test_c10d_testbase.py).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.harness import REPO_ROOT, free_port, timeout_scale

ENV_FLAG = "TORCHCOMMS_EXPLICIT_RANKS_CHILD"
OUT_VAR = "TORCHCOMMS_EXPLICIT_RANKS_OUT"
WORLD_SIZE = 2
CHILD_TIMEOUT_S = 240.0
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHCOMM_RANK", "TORCHCOMM_SIZE",
                 "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PALS_RANKID")  # fmt: skip


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["TORCH_DISTRIBUTED_USE_TORCHCOMMS"] = "1"
    env["TORCHCOMM_ABORT_ON_ERROR"] = "0"
    return env


# ------------------------------------------------------------- the case (runs in the child)


def dtensor_tp_fsdp_case(rank: int, size: int) -> dict[str, torch.Tensor]:
    """DTensor redistribution, a tensor-parallel MLP and two FSDP2 steps; every result."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    out: dict[str, torch.Tensor] = {}
    mesh = init_device_mesh("cpu", (size,))
    torch.manual_seed(0)
    x = torch.randn(8, 6)
    w = torch.randn(6, 4)
    dx = distribute_tensor(x, mesh, [Shard(0)])
    dw = distribute_tensor(w, mesh, [Replicate()])
    out["matmul"] = (dx @ dw).full_tensor()
    out["redistributed"] = dx.redistribute(mesh, [Shard(1)]).to_local().clone()
    out["sum"] = dx.sum().full_tensor()

    torch.manual_seed(1)
    mlp = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 6))
    tp = parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    y = tp(x)
    y.sum().backward()
    out["tp_out"] = y.detach().clone()
    out["tp_grad0"] = tp[0].weight.grad.full_tensor()
    out["tp_grad2"] = tp[2].weight.grad.full_tensor()

    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        batch = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(batch).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        out[f"fsdp_loss{step}"] = loss.detach().clone()
    for name, param in model.named_parameters():
        out[f"fsdp_{name}"] = param.full_tensor().detach().clone()
    dist.barrier()
    return out


if os.environ.get(ENV_FLAG) == "1":
    import torch.distributed as dist
    from torch.testing._internal.common_utils import run_tests
    from torch.testing._internal.distributed._tensor.common_dtensor import (
        DTensorTestBase,
        with_comms,
    )

    class _Case(DTensorTestBase):
        use_torchcomms = True

        @property
        def world_size(self) -> int:
            return WORLD_SIZE

        def init_pg(self, eager_init: bool, backend: str | None = None) -> None:
            dist.config.use_torchcomms = self.use_torchcomms  # in the rank's own process
            super().init_pg(eager_init, backend)

        @with_comms
        def test_case(self) -> None:
            want = "_BackendWrapper" if self.use_torchcomms else "ProcessGroup"
            self.assertEqual(type(dist.group.WORLD).__name__, want)
            self.assertFalse([v for v in LAUNCHER_VARS if v in os.environ])
            if self.use_torchcomms:
                comm = dist.group.WORLD.get_comm()
                self.assertEqual((comm.get_rank(), comm.get_size()), (self.rank, WORLD_SIZE))
            results = dtensor_tp_fsdp_case(self.rank, self.world_size)
            mode = "torchcomms" if self.use_torchcomms else "gloo"
            torch.save(results, Path(os.environ[OUT_VAR]) / f"{mode}_{self.rank}.pt")

    class TestOnTorchcomms(_Case):
        use_torchcomms = True

    class TestOnGloo(_Case):
        use_torchcomms = False

    if __name__ == "__main__":
        run_tests()


# ----------------------------------------------------------------------------- the tests


@pytest.mark.skipif(
    importlib.util.find_spec("expecttest") is None,
    reason="torch.testing._internal.common_utils needs the 'expecttest' package",
)
@pytest.mark.skipif(os.environ.get(ENV_FLAG) == "1", reason="already inside the child run")
def test_dtensor_testbase_on_torchcomms_equals_gloo(tmp_path: Path) -> None:
    env = _child_env()
    env[ENV_FLAG] = "1"
    env[OUT_VAR] = str(tmp_path)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           os.path.join("tests", "test_explicit_ranks.py"), "-k", "TestOn"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT_S * timeout_scale(), check=False)  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert re.search(r"\b2 passed\b", output), output[-3000:]
    for rank in range(WORLD_SIZE):
        ours = torch.load(tmp_path / f"torchcomms_{rank}.pt")
        gloo = torch.load(tmp_path / f"gloo_{rank}.pt")
        assert ours.keys() == gloo.keys() and len(ours) > 10, (ours.keys(), gloo.keys())
        for key, value in gloo.items():
            assert torch.equal(ours[key], value), (rank, key, ours[key], value)


SPAWN_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import torch.multiprocessing as mp

    def worker(rank, world, port):
        import torchcomms  # first, as users write it
        import torch.distributed as dist
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
        dist.init_process_group("gloo", rank=rank, world_size=world, store=store)
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t)
        pair = dist.new_group([0, 1])
        u = torch.tensor([1 << rank])
        if rank < 2:
            dist.all_reduce(u, group=pair)
        comm = dist.group.WORLD.get_comm()
        fields = [rank, type(dist.group.WORLD).__name__, comm.get_rank(), comm.get_size(),
                  ",".join(map(str, t.tolist())), u.item()]
        # one write: under PYTHONUNBUFFERED each print argument is a write of its own
        sys.stdout.write(" ".join(["RESULT"] + [str(f) for f in fields]) + "\\n")
        sys.stdout.flush()
        dist.destroy_process_group()

    if __name__ == "__main__":
        world, port = int(sys.argv[1]), int(sys.argv[2])
        mp.spawn(worker, args=(world, port), nprocs=world)
    """
)


def test_mp_spawn_script_with_explicit_ranks(tmp_path: Path) -> None:
    world = 3
    script = tmp_path / "spawn_script.py"
    script.write_text(SPAWN_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(world), str(free_port())],
                          env=_child_env(), capture_output=True, text=True,
                          timeout=120 * timeout_scale(), check=False)  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    lines = sorted(line.split()[1:] for line in proc.stdout.splitlines()
                   if line.startswith("RESULT"))  # fmt: skip
    total = float(world * (world + 1) // 2)
    want = [[str(r), "_BackendWrapper", str(r), str(world), ",".join([str(total)] * 3),
             "3" if r < 2 else str(1 << r)] for r in range(world)]  # fmt: skip
    assert lines == want, (lines, proc.stdout[-3000:])
