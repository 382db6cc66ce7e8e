"""Tests of the multi-process harness itself (``tests/harness.py``).

Rank functions are module-level because the harness pickles them by reference. Spawning a
torch worker costs about 1.3 s of CPU, which dominates this file's run time, so the order
matters: successful tests first (they grow the shared pool to 4 workers once), then the
failure tests, smallest world size first, each reusing what the previous one left alive.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._C._distributed_c10d import ProcessGroupGloo

from tests import harness, shared_jobs
from tests.harness import RankContext, RankFailure, run_ranks

ENV_KEYS = (
    "TORCHCOMM_RANK",
    "TORCHCOMM_SIZE",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def _gone(pid: int) -> bool:
    """True if no process (not even a zombie) has this pid any more."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# ----------------------------------------------------------------------------- rank functions


def _identity(ctx: RankContext, tag: str) -> tuple[int, int, int, int, str]:
    return (ctx.rank, ctx.world_size, os.getpid(), ctx.task_id, tag)


def _pid(ctx: RankContext) -> int:
    return os.getpid()


def _store_exchange(ctx: RankContext) -> list[str]:
    ctx.store.set(f"from{ctx.rank}", f"hello from {ctx.rank}")
    return [ctx.store.get(f"from{r}").decode() for r in range(ctx.world_size)]


def _gloo_allreduce(ctx: RankContext) -> tuple[float, list[str]]:
    # Every rank drops a file into the shared tmpdir before the collective, so after it
    # all files must be visible to everyone.
    Path(ctx.tmpdir, f"rank{ctx.rank}").write_text("x")
    # Any: torch's stubs lack Backend.allreduce. The default device falls back to loopback
    # when the hostname does not resolve to a usable address.
    pg: Any = ProcessGroupGloo(ctx.store, ctx.rank, ctx.world_size, datetime.timedelta(seconds=20))
    tensor = torch.tensor([float(ctx.rank + 1)])
    pg.allreduce([tensor]).wait()  # default op: SUM
    return tensor.item(), sorted(os.listdir(ctx.tmpdir))


def _env_snapshot(ctx: RankContext) -> dict[str, Any]:
    snapshot: dict[str, Any] = {key: os.environ.get(key) for key in ENV_KEYS}
    snapshot["ctx_port"] = ctx.master_port
    snapshot["ctx_addr"] = ctx.master_addr
    snapshot["HARNESS_EXTRA"] = os.environ.get("HARNESS_EXTRA")
    snapshot["HARNESS_LEAK"] = os.environ.get("HARNESS_LEAK")
    snapshot["HOME"] = os.environ.get("HOME")
    os.environ["HARNESS_LEAK"] = "leaked"  # must not survive into the next task
    return snapshot


def _hang_on_rank0(ctx: RankContext) -> str:
    if ctx.rank == 0:
        time.sleep(600)
    return "fine"


def _raise_rank1_hang_rank0(ctx: RankContext) -> None:
    if ctx.rank == 1:
        raise RuntimeError("rank 1 gave up")
    time.sleep(600)


def _sigkill_rank1(ctx: RankContext) -> str:
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return "fine"


def _three_kinds_of_error(ctx: RankContext) -> Any:
    if ctx.rank == 1:
        raise ValueError("boom from rank 1")
    if ctx.rank == 2:
        raise SystemExit(3)
    if ctx.rank == 3:
        return lambda: None  # cannot be pickled back to the parent
    return "fine"


# --------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_return_values_per_rank(world_size: int) -> None:
    results = run_ranks(_identity, world_size, "tag")
    assert [r[:2] for r in results] == [(rank, world_size) for rank in range(world_size)]
    assert len({r[2] for r in results}) == world_size  # one process per rank
    assert len({r[3] for r in results}) == 1  # one task
    assert all(r[4] == "tag" for r in results)


def test_pool_is_reused_between_tasks() -> None:
    first = run_ranks(_identity, 2, "a")
    second = run_ranks(_identity, 2, "b")
    assert [r[2] for r in first] == [r[2] for r in second]
    assert second[0][3] > first[0][3]  # fresh task id


def test_store_exchange() -> None:
    expected = [f"hello from {r}" for r in range(3)]
    assert run_ranks(_store_exchange, 3) == [expected] * 3
    # Keys are prefixed per task, so the same keys do not collide with the previous task.
    assert run_ranks(_store_exchange, 3) == [expected] * 3


def test_gloo_allreduce_and_shared_tmpdir() -> None:
    results = run_ranks(_gloo_allreduce, 4)
    assert results == [(10.0, ["rank0", "rank1", "rank2", "rank3"])] * 4


def test_env_set_during_task_and_restored_after() -> None:
    before = os.environ.get("HOME")
    first = run_ranks(_env_snapshot, 2, env={"HARNESS_EXTRA": "yes", "HOME": None})
    ports = {snap["MASTER_PORT"] for snap in first}
    assert len(ports) == 1
    for rank, snap in enumerate(first):
        assert snap["TORCHCOMM_RANK"] == snap["RANK"] == snap["LOCAL_RANK"] == str(rank)
        assert snap["TORCHCOMM_SIZE"] == snap["WORLD_SIZE"] == snap["LOCAL_WORLD_SIZE"] == "2"
        assert snap["MASTER_ADDR"] == snap["ctx_addr"] == "127.0.0.1"
        assert snap["MASTER_PORT"] == str(snap["ctx_port"])
        assert snap["HARNESS_EXTRA"] == "yes"
        assert snap["HOME"] is None  # None in env= unsets
        assert snap["HARNESS_LEAK"] is None

    second = run_ranks(_env_snapshot, 2)
    for snap in second:
        assert snap["HARNESS_EXTRA"] is None
        assert snap["HARNESS_LEAK"] is None  # set by the previous task, then restored
        assert snap["HOME"] == before
        assert snap["MASTER_PORT"] not in ports  # fresh port per task
    assert os.environ.get("HOME") == before  # the parent's environment is untouched


def _parent_pid(ctx: RankContext) -> int:
    return os.getppid()


def test_fresh_uses_new_processes_and_discards_them() -> None:
    pooled = run_ranks(_pid, 2)
    fresh = run_ranks(_pid, 2, fresh=True)
    assert set(fresh).isdisjoint(pooled)
    assert all(_gone(pid) for pid in fresh)
    assert run_ranks(_pid, 2) == pooled  # the pool was left alone
    # Pooled and fresh workers fork from the fork server; spawn=True ones are new interpreters
    # started by pytest itself.
    forked = run_ranks(_parent_pid, 2, fresh=True)
    assert len(set(forked)) == 1 and forked[0] != os.getpid()
    assert run_ranks(_parent_pid, 2, spawn=True) == [os.getpid()] * 2


def test_killed_worker_is_reported_and_pool_respawns() -> None:
    four = run_ranks(_pid, 4)
    pids = four[:2]
    with pytest.raises(RankFailure) as info:
        run_ranks(_sigkill_rank1, 2)
    assert info.value.died.keys() == {1}
    assert info.value.errors == {} and info.value.timed_out == []
    message = str(info.value)
    assert f"--- rank 1 died: worker pid {pids[1]} was killed by signal SIGKILL" in message
    assert _gone(pids[1])
    # Only the dead rank's worker was replaced: rank 0 returned normally and stays first; the
    # idle workers move up behind it.
    assert run_ranks(_pid, 4)[:3] == [four[0], four[2], four[3]]


def test_hanging_rank_times_out_and_next_run_works() -> None:
    pids = run_ranks(_pid, 1)
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_hang_on_rank0, 1, timeout=2.0)
    elapsed = time.monotonic() - start
    assert info.value.timed_out == [0]
    assert info.value.errors == {} and info.value.died == {}
    message = str(info.value)
    assert "--- rank 0 timed out (no result within the" in message
    assert "_hang_on_rank0" in message  # the faulthandler stack dump of the stuck worker
    assert elapsed < 2.0 * harness.timeout_scale() + 8.0
    assert all(_gone(pid) for pid in pids)
    assert set(run_ranks(_pid, 1)).isdisjoint(pids)


def test_failure_grace_period_bounds_wait_for_other_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(harness, "FAILURE_GRACE_S", 0.5)
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_raise_rank1_hang_rank0, 2, timeout=60.0)
    assert time.monotonic() - start < 30.0
    assert list(info.value.errors) == [1]
    assert info.value.timed_out == [0]
    message = str(info.value)
    assert "RuntimeError: rank 1 gave up" in message
    grace = 0.5 * harness.timeout_scale()
    assert f"--- rank 0 timed out (still running {grace:.1f} s after another rank failed" in message


def test_every_failing_rank_is_reported() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(_three_kinds_of_error, 4)
    assert sorted(info.value.errors) == [1, 2, 3]
    assert info.value.died == {} and info.value.timed_out == []
    message = str(info.value)
    assert "--- rank 1 raised:\nTraceback (most recent call last)" in message
    assert "ValueError: boom from rank 1" in message
    assert "--- rank 2 raised:" in message
    assert "SystemExit: 3" in message  # sys.exit() in a rank is an error, not a death
    assert "--- rank 3 raised:" in message
    assert "could not be pickled" in info.value.errors[3]
    assert "rank 0" not in message


def test_a_failed_task_keeps_the_ranks_that_returned_and_replaces_the_rest() -> None:
    before = run_ranks(_pid, 4)
    with pytest.raises(RankFailure):
        run_ranks(_three_kinds_of_error, 4)
    after = run_ranks(_pid, 4)
    assert after[0] == before[0]  # rank 0 returned "fine": kept
    assert set(after[1:]).isdisjoint(before)  # the ranks that raised were replaced
    assert all(_gone(pid) for pid in before[1:])


def test_local_function_is_rejected_before_running() -> None:
    def local(ctx: RankContext) -> None:
        pass

    with pytest.raises(TypeError, match="module-level function"):
        run_ranks(local, 2)


def test_run_torchrun() -> None:
    """``run_torchrun`` starts one process per rank with torchrun's variables: read from the
    shared 4-rank job's output (``tests/shared_jobs.py``), which prints each rank's RANK."""
    proc, _ = shared_jobs.torchrun_scripts_4()
    assert proc.returncode == 0, proc.stdout
    for rank in range(shared_jobs.NPROC):
        assert f"[suite] start quickstart.py rank {rank}" in proc.stdout, proc.stdout


def test_torchrun_suite_splits_jobs_and_stops_at_a_failing_script(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests import torchrun_suite

    assert torchrun_suite.jobs(["a", "x", "---", "---", "b"]) == [["a", "x"], ["b"]]
    ok = tmp_path / "ok.py"
    ok.write_text("import sys\nprint('ran', sys.argv[1:])\nsys.exit(0)\n")
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nsys.exit(3)\n")
    never = tmp_path / "never.py"
    never.write_text("print('must not run')\n")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(sys, "argv", ["suite"])
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(SystemExit) as info:
        torchrun_suite.main([str(ok), "1", "---", str(bad), "---", str(never)])
    assert info.value.code == 3
    out = capsys.readouterr().out
    assert "ran ['1']" in out and "[suite] done ok.py" in out
    assert "[suite] failed bad.py rank ?: exit 3" in out
    assert "must not run" not in out
