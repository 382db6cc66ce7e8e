"""distwrap and the torch.distributed bridge when the ``torchcomms`` package is imported first.

Ours, in the style of upstream's integration tests beside it (``unittest``, configured by
``TEST_BACKEND`` / ``TEST_DEVICE`` / ``USE_TORCHCOMMS``).  Run as upstream's users run these
files, ``torchrun --nproc-per-node 2 -m pytest ImportOrderTest.py``: pytest imports this file
as ``torchcomms.distwrap.tests.integration.ImportOrderTest``, so ``torchcomms/__init__`` runs
before anything imports ``torch.distributed``, the order in which PyTorch's own import of
torchcomms once failed and turned its torchcomms integration off for the process.
``tests/test_distwrap_package_tests.py`` runs it so; with ``EXPECT_TORCHCOMMS_FIRST=1`` the
file also checks that the order really was that.
"""

from __future__ import annotations

import os
import sys
import unittest

# Before this file imports anything.  sys.modules lists modules in the order their imports
# finished (CPython moves a module to the end when its import completes), and each of the two
# imports the other inside its own import: the one imported first finishes last.
_FINISHED = [m for m in sys.modules if m in ("torchcomms", "torch.distributed")]

import torch  # noqa: E402
import torch.distributed as torch_dist  # noqa: E402
from torch.distributed import distributed_c10d  # noqa: E402

from torchcomms import distwrap as dist  # noqa: E402
from torchcomms._backend_wrapper import _BackendWrapper  # noqa: E402
from torchcomms.distwrap.tests.integration.test_helpers import (  # noqa: E402
    get_backend,
    get_device,
    get_rank_and_size,
    use_torchcomms,
)


class ImportOrderTest(unittest.TestCase):
    def test_import_order_is_the_one_asked_for(self) -> None:
        if os.environ.get("EXPECT_TORCHCOMMS_FIRST") != "1":
            self.skipTest("EXPECT_TORCHCOMMS_FIRST is not set")
        self.assertEqual(_FINISHED, ["torch.distributed", "torchcomms"], "torchcomms was not first")

    def test_torch_distributed_loaded_torchcomms(self) -> None:
        self.assertTrue(distributed_c10d._TORCHCOMM_AVAILABLE)

    def test_distwrap_world_then_torch_s_own(self) -> None:
        rank, size = get_rank_and_size()
        device = get_device(rank)
        torchcomms = use_torchcomms()
        dist.init_process_group(backend=get_backend(), use_torchcomms=torchcomms)
        store = distributed_c10d._get_default_store()
        try:
            world = dist.group.WORLD
            self.assertEqual(isinstance(world, _BackendWrapper), torchcomms)
            t = torch.full((4,), float(rank + 1), device=device)
            dist.all_reduce(t)
            self.assertEqual(t.tolist(), [float(size * (size + 1) // 2)] * 4)
            halves = [list(range(size // 2)), list(range(size // 2, size))]
            sub = dist.split_group(parent_pg=world, split_ranks=halves)
            self.assertIsNotNone(sub)
            mine = halves[0] if rank in halves[0] else halves[1]
            t = torch.full((2,), float(rank + 1), device=device)
            dist.all_reduce(t, group=sub)
            self.assertEqual(t.tolist(), [float(sum(r + 1 for r in mine))] * 2)
        finally:
            dist.destroy_process_group()
        if not torch_dist.config.use_torchcomms:
            return  # TORCH_DISTRIBUTED_USE_TORCHCOMMS is off: torch's own world is gloo's
        # torch.distributed's own init under TORCH_DISTRIBUTED_USE_TORCHCOMMS=1.
        torch_dist.init_process_group(
            "gloo", store=torch_dist.PrefixStore("bridge", store), rank=rank, world_size=size
        )
        try:
            self.assertIsInstance(torch_dist.group.WORLD, _BackendWrapper)
            t = torch.ones(3, device=device)
            torch_dist.all_reduce(t)
            self.assertEqual(t.tolist(), [float(size)] * 3)
        finally:
            torch_dist.destroy_process_group()


if __name__ == "__main__":
    unittest.main()
