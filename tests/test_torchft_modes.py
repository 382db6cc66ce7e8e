"""torchft's own training-mode scenarios, run on our communicators (replicas as threads).

torchft ships its integration scenarios in the wheel (``torchft.local_sgd_integ_test``,
``torchft.manager_integ_test``): LocalSGD recovery, DiLoCo healthy and recovery, Streaming
DiLoCo recovery, upscale (a replica joining mid-run) and commit failure over 1-3 fragments,
sync delays 0-1 and alpha 0 / 0.5 / 1, and DDP healthy, recovery (sync and async quorum,
several ranks per replica) and without the initial sync.  Each runs its replicas as
threads of one process under torchft's lighthouse and asserts, with torchft's own checks,
that the replicas' final state dicts are equal (and, where a failure is injected, that the
failed replica recovered).  Here every replica's process group is
``torchft.torchcomms.ProcessGroupTorchComms`` over a reconfigurable ``new_comm("gloo", cpu)``
(``TORCHCOMM_RANK=0``, ``TORCHCOMM_SIZE=1``, as torchft's tests set it), so several
reconfigurable communicators live in one process and reconfigure into one group per quorum.

torchft's error-injecting ``FakeProcessGroupWrapper`` (the DiLoCo trainer wraps its group in
it) parses reconfigure handles as torchft's JSON before handing them on, so over a torchcomms
group every quorum failed with ``JSONDecodeError`` and nothing committed (the DiLoCo symptom:
"healing is required step=0" on every quorum).  ``_PassThroughWrapper`` keeps its error
injection and hands the handles to the torchcomms group as they are.  The tests check that
our communicators really carried the job: every group created is ours and reconfigured.

The default run takes one scenario per mode; ``-m slow`` runs the other 25.  Needs torchft and
``parameterized`` (the ``ft`` extra); skipped where they cannot be imported.
"""

from __future__ import annotations

import os
import unittest
from datetime import timedelta
from typing import Any

import pytest
import torch

integ = pytest.importorskip(
    "torchft.local_sgd_integ_test",
    reason="torchft's scenarios need torchft and parameterized (pip install -e '.[ft]' and "
    "pip install --no-deps torchft-nightly, see the README)",
)
manager_integ = pytest.importorskip("torchft.manager_integ_test")

from torchft._test import diloco_trainer  # noqa: E402
from torchft.process_group import FakeProcessGroupWrapper, ReconfigureOptions  # noqa: E402
from torchft.torchcomms import ProcessGroupTorchComms  # noqa: E402

import torchcomms  # noqa: E402

CPU = torch.device("cpu")

#: One scenario per mode (torchft's test names, parameterized suffix included).
DEFAULT = [
    ("local_sgd", "test_local_sgd_recovery_0"),
    ("local_sgd", "test_diloco_healthy_0"),
    ("local_sgd", "test_diloco_recovery_0"),
    ("local_sgd", "test_streaming_diloco_recovery_0"),
    ("local_sgd", "test_streaming_diloco_upscale_10"),
    ("local_sgd", "test_streaming_diloco_commit_failure_07"),
    ("manager", "test_ddp_healthy"),
    ("manager", "test_ddp_recovery_1_sync_quorum"),
]
#: torchft's DDP scenarios over its own (non-native) process group, with ours patched in.
MANAGER = [
    "test_ddp_healthy",
    "test_ddp_recovery_0_async_quorum",
    "test_ddp_recovery_1_sync_quorum",
    "test_ddp_recovery_multi_rank",
    "test_ddp_skip_init_sync",
]
CASES = {"local_sgd": integ.LocalSGDIntegTest, "manager": manager_integ.ManagerIntegTest}


def _all_scenarios() -> list[tuple[str, str]]:
    names = [
        ("local_sgd", n)
        for n in dir(integ.LocalSGDIntegTest)
        if n.startswith("test_") and n[-1].isdigit()
    ]
    return names + [("manager", n) for n in MANAGER]


class _PassThroughWrapper(FakeProcessGroupWrapper):
    """torchft's error-injecting wrapper, reconfiguring with the inner group's own handles."""

    def reconfigure(self, opts: ReconfigureOptions) -> Any:
        self._future_error = None
        return self._pg.reconfigure(opts)


class _Ours:
    """Every torchcomms group the scenario made, to check that ours carried the job."""

    def __init__(self) -> None:
        self.comms: list[torchcomms.TorchComm] = []

    def group(self) -> ProcessGroupTorchComms:
        comm = torchcomms.new_comm(
            "gloo",
            CPU,
            name=f"torchft_{len(self.comms)}",
            enable_reconfigure=True,
            abort_process_on_timeout_or_error=False,
            timeout=timedelta(seconds=10),
        )
        self.comms.append(comm)
        return ProcessGroupTorchComms(comm, timeout=timedelta(seconds=10))


@pytest.fixture
def ours(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("TORCHCOMM_RANK", "0")
    monkeypatch.setenv("TORCHCOMM_SIZE", "1")
    monkeypatch.setenv("TORCHCOMM_ABORT_ON_ERROR", "0")
    made = _Ours()
    for module in (integ, manager_integ):
        monkeypatch.setattr(module, "ProcessGroupGloo", lambda *a, **k: made.group())
    monkeypatch.setattr(
        diloco_trainer.DiLoCoTrainer,
        "setup_pg",
        lambda self: _PassThroughWrapper(made.group()),
    )
    was_initialized = torch.distributed.is_initialized()
    yield made
    # the DiLoCo trainer initialises torch.distributed's default group for its DeviceMesh
    if torch.distributed.is_initialized() and not was_initialized:
        torch.distributed.destroy_process_group()


def _run(made: _Ours, module: str, name: str) -> None:
    case = CASES[module](name)
    with open(os.devnull, "w") as quiet:
        result = unittest.TextTestRunner(verbosity=0, stream=quiet).run(case)
    problems = [f"{test}: {text}" for test, text in result.failures + result.errors]
    assert result.wasSuccessful() and not result.skipped, problems or result.skipped
    # the scenario's groups were ours, and every one of them reconfigured into a quorum
    assert made.comms, "the scenario created no torchcomms group"
    for comm in made.comms:
        backend = comm.get_backend_impl()
        assert backend._uuids, f"{comm.get_name()} never reconfigured"  # type: ignore[attr-defined]


@pytest.mark.parametrize(("module", "name"), DEFAULT, ids=[n for _, n in DEFAULT])
def test_torchft_scenario(ours: _Ours, module: str, name: str) -> None:
    _run(ours, module, name)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("module", "name"),
    [c for c in _all_scenarios() if c not in DEFAULT],
    ids=[n for m, n in _all_scenarios() if (m, n) not in DEFAULT],
)
def test_every_torchft_scenario(ours: _Ours, module: str, name: str) -> None:
    _run(ours, module, name)


@pytest.mark.slow
def test_ft_diloco_example() -> None:
    """``examples/ft_diloco.py``: Streaming DiLoCo, replica 1 SIGKILLed at step 3 or soon after, healed."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    args = ["--steps", "8", "--kill-step", "3", "--pause", "0.005"]
    proc = subprocess.run(
        [sys.executable, "examples/ft_diloco.py", *args],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # killed once its step reached 3 (on a loaded machine it may commit a step or two more
    # before the signal lands), before the end, so the restart had steps left to heal into
    found = re.search(
        r"ok: replica 1 was killed at step (\d+), rejoined at step (\d+) \(healed", proc.stdout
    )
    assert found is not None, proc.stdout
    killed, rejoined = int(found.group(1)), int(found.group(2))
    assert 3 <= killed <= rejoined < 8, proc.stdout
    table = [line.split() for line in proc.stdout.splitlines() if line[:4].strip().isdigit()]
    assert [int(row[0]) for row in table] == list(range(1, 9)), proc.stdout
    assert all(row[-1] == "2" for row in table), proc.stdout  # every outer step had both
