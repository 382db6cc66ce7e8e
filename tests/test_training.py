"""Training parity through torch.distributed on torchcomms (DDP, FSDP2, FSDP x TP on a 2-D mesh).

Each example runs under real torchrun with the switch on (``TORCH_DISTRIBUTED_USE_TORCHCOMMS=1``)
and off (plain gloo; the same job's processes train again with the switch turned off).  Losses and final parameters must match a single-process reference over
the concatenated global batch (examples/_training.py) within float32 summation-order error,
and the two runs must agree exactly: both reduce with gloo's algorithms, so the bridge may
not change a single bit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.harness import REPO_ROOT, run_torchrun

EXAMPLES = Path(REPO_ROOT) / "examples"
SUITE = Path(REPO_ROOT) / "tests" / "torchrun_suite.py"
sys.path.insert(0, str(EXAMPLES))
from _training import read_result, reference  # noqa: E402

STEPS = 4
SWITCH_ON = {"TORCH_DISTRIBUTED_USE_TORCHCOMMS": "1"}
# float32 results of a sharded/reordered sum vs the single-process sum.
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-6}
PARAM_TOL = {"rtol": 1e-5, "atol": 1e-6}


def _train(
    tmp_path: Path,
    script: str,
    nproc: int,
    extra: list[str],
    switch: bool,
    transport: str = "auto",
) -> Path:
    out = tmp_path / f"{script}-{nproc}-{'-'.join(extra) or 'plain'}-{int(switch)}-{transport}.json"
    env = dict(SWITCH_ON) if switch else {"TORCH_DISTRIBUTED_USE_TORCHCOMMS": "0"}
    env["TORCHCOMM_TRANSPORT"] = transport
    proc = run_torchrun(
        [str(EXAMPLES / script), "--steps", str(STEPS), "--out", str(out), *extra],
        nproc=nproc,
        timeout=240.0,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout
    expected_group = "_BackendWrapper" if switch or "--mesh-from-comms" in extra else "ProcessGroup"
    assert f"on {expected_group}:" in proc.stdout, proc.stdout
    assert out.exists(), proc.stdout
    return out


def _train_on_then_off(
    tmp_path: Path, script: str, nproc: int, extra: list[str], transport: str
) -> tuple[Path, Path]:
    """Switch on, then off, in one torchrun job (``tests/torchrun_suite.py``): the same
    processes train over the bridge, then over plain gloo."""
    on, off = (tmp_path / f"{script}-{nproc}-{transport}-{w}.json" for w in ("on", "off"))
    args = [str(EXAMPLES / script), "--steps", str(STEPS), *extra]
    switch_off = ("---", "@use_torchcomms=0", "---")
    proc = run_torchrun(
        [str(SUITE), *args, "--out", str(on), *switch_off, *args, "--out", str(off)],
        nproc=nproc,
        timeout=240.0,
        env={**SWITCH_ON, "TORCHCOMM_TRANSPORT": transport},
    )
    assert proc.returncode == 0, proc.stdout
    assert "on _BackendWrapper:" in proc.stdout and "on ProcessGroup:" in proc.stdout, proc.stdout
    assert on.exists() and off.exists(), proc.stdout
    return on, off


def _check_against_reference(path: Path, shards: int) -> tuple[list[float], dict]:
    losses, params = read_result(str(path))
    ref_losses, ref_params = reference(STEPS, shards)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **LOSS_TOL)
    assert params.keys() == ref_params.keys()
    for name, value in params.items():
        torch.testing.assert_close(value, ref_params[name].flatten(), **PARAM_TOL, msg=name)
    return losses, params


def _assert_identical(a: Path, b: Path) -> None:
    losses_a, params_a = read_result(str(a))
    losses_b, params_b = read_result(str(b))
    assert losses_a == losses_b
    for name in params_a:
        assert torch.equal(params_a[name], params_b[name]), name


#: The default run keeps two jobs: DDP over tcp with its bit-identity check against plain
#: gloo (switch on, then off, in one job) and FSDP2 on a mesh built from communicators over
#: shm (below; FSDP2's all_gather / reduce_scatter through the bridge): both transports
#: through the bridge.  The other cells (DDP on shm, more ranks, FSDP2 alone, FSDP2 x TP on
#: 4 ranks, the 2 x 2 mesh from communicators) run with ``-m slow``; TP's DTensor collectives
#: on torchcomms are also PyTorch's DTensor test base in ``tests/test_explicit_ranks.py``.
_SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    ("script", "nproc", "extra", "shards", "transport"),
    [
        pytest.param("train_ddp.py", 2, [], 2, "auto", marks=_SLOW),
        ("train_ddp.py", 2, [], 2, "tcp"),
        pytest.param("train_ddp.py", 4, [], 4, "auto", marks=_SLOW),
        pytest.param("train_ddp.py", 4, [], 4, "tcp", marks=_SLOW),
        pytest.param("train_fsdp.py", 2, [], 2, "auto", marks=_SLOW),
        pytest.param("train_fsdp.py", 4, [], 4, "auto", marks=_SLOW),
        pytest.param("train_fsdp.py", 4, ["--tp", "2"], 2, "auto", marks=_SLOW),
    ],
    ids=["ddp-2", "ddp-2-tcp", "ddp-4", "ddp-4-tcp", "fsdp2-2", "fsdp2-4", "fsdp2xtp-2x2"],
)
def test_training_matches_reference_and_plain_gloo(
    tmp_path: Path, script: str, nproc: int, extra: list[str], shards: int, transport: str
) -> None:
    """Switch on (shm on one host, or tcp forced) matches the reference; where the reduction
    order cannot differ, it also matches a run with the switch off (plain gloo) bit for bit.

    That is on tcp (the same gloo algorithms) and with 2 ranks (a + b either way).  With 4
    ranks on shm, shm sums in rank order and gloo in ring order, so float results may differ
    in the last bit: there the plain run would only test torch against the reference, and is
    skipped (it cost 15 s a cell on a 2-core machine).
    """
    if transport == "tcp" or nproc == 2:
        on, off = _train_on_then_off(tmp_path, script, nproc, extra, transport)
        _check_against_reference(on, shards)
        _check_against_reference(off, shards)
        _assert_identical(on, off)
    else:
        on = _train(tmp_path, script, nproc, extra, switch=True, transport=transport)
        _check_against_reference(on, shards)


def test_fsdp_on_a_mesh_built_from_communicators(tmp_path: Path) -> None:
    """No init_process_group: FSDP2 on a 1-D DeviceMesh from ``torchcomms.device_mesh`` over a
    communicator (2 ranks).  The 2-D mesh from split comms is checked group by group in
    tests/test_device_mesh.py, and trained with TP below (-m slow)."""
    out = _train(tmp_path, "train_fsdp.py", 2, ["--mesh-from-comms"], switch=False)
    _check_against_reference(out, 2)


@pytest.mark.slow
def test_fsdp_tp_on_a_mesh_built_from_communicators(tmp_path: Path) -> None:
    """No init_process_group: torchcomms.device_mesh.init_device_mesh over split comms."""
    out = _train(tmp_path, "train_fsdp.py", 4, ["--tp", "2", "--mesh-from-comms"], switch=False)
    _check_against_reference(out, 2)
