"""The test files shipped inside ``torchcomms.distwrap``, run the way upstream's users run them.

``torchrun --nproc-per-node 2 -m pytest src/torchcomms/distwrap/tests/integration/
ImportOrderTest.py``: pytest imports the file as a module of the ``torchcomms`` package, so
``torchcomms/__init__`` runs before ``torch.distributed`` is imported, the order that once
made PyTorch turn its torchcomms integration off (issue 37).  The run has distwrap's
``use_torchcomms=True`` and ``TORCH_DISTRIBUTED_USE_TORCHCOMMS=1`` on, so an import-order
regression fails here: distwrap's world, a split of it, and torch.distributed's own world
must all run on communicators.  Upstream's own integration files are run, unmodified, by
``benchmarks/diagnostics/run_upstream_tests.py`` (docs/torch-distributed.md).
"""

from __future__ import annotations

from pathlib import Path

from tests.harness import REPO_ROOT, run_torchrun

INTEGRATION = Path(REPO_ROOT) / "src" / "torchcomms" / "distwrap" / "tests" / "integration"


def test_import_order_test_under_pytest_with_the_package_imported_first() -> None:
    test_file = INTEGRATION / "ImportOrderTest.py"
    proc = run_torchrun(
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", str(test_file)],
        nproc=2,
        timeout=120.0,
        env={
            "TEST_BACKEND": "gloo",
            "TEST_DEVICE": "cpu",
            "USE_TORCHCOMMS": "1",
            "TORCH_DISTRIBUTED_USE_TORCHCOMMS": "1",
            "EXPECT_TORCHCOMMS_FIRST": "1",
        },
    )
    assert proc.returncode == 0, proc.stdout
    # Each rank's pytest ran the three tests, none skipped.
    assert proc.stdout.count("3 passed") == 2, proc.stdout
