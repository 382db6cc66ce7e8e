"""``python -m torchcomms.tools.fr DIR [--trace out.json]`` (issue 6 item 4).

One real 3-rank job produces the dumps: on communicator ``tool_hang`` ranks 0-1 sit inside
all_reduce #2 (dumped live, from a thread) while rank 2 never enters it; on ``tool_mm``
(collective check on) rank 1 issues a different size at #2.  The report must name the rank
that never entered, the waiting ranks and for how long, the failed ops and the mismatch;
the Chrome/Perfetto trace must have one track per rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import harness
from tests.harness import RankContext, run_ranks
from torchcomms import CollectiveMismatchError, ReduceOp, new_comm
from torchcomms.hooks import FlightRecorderHook
from torchcomms.tools import fr as frtool

CPU = torch.device("cpu")


def _scaled(seconds: float) -> float:
    return seconds * harness.timeout_scale()


def _job(ctx: RankContext) -> None:
    rank, store = ctx.rank, ctx.store
    wait = timedelta(seconds=_scaled(60))
    recorder = FlightRecorderHook()  # the process-wide buffer every comm records into
    recorder.reset()  # this worker may have run other tasks
    os.environ["TORCHCOMM_CHECK_COLLECTIVES"] = "1"
    try:
        mm = new_comm("gloo", CPU, name="tool_mm", store=store)
    finally:
        del os.environ["TORCHCOMM_CHECK_COLLECTIVES"]
    hang = new_comm("gloo", CPU, name="tool_hang", store=store, timeout=timedelta(seconds=300))

    mm.all_reduce(torch.ones(4), ReduceOp.SUM, False)
    with pytest.raises(CollectiveMismatchError):
        mm.all_reduce(torch.ones(5 if rank == 1 else 4), ReduceOp.SUM, False)

    t = torch.ones(8)
    hang.all_reduce(t, ReduceOp.SUM, False)
    assert torch.equal(t, torch.full((8,), 3.0)), t
    # Files, not the store, signal across threads here: one store client must not be used
    # by two threads at once (the waiting thread would hold it).
    flag = os.path.join(ctx.tmpdir, "{}")

    def await_files(*names: str) -> None:
        deadline = time.monotonic() + wait.total_seconds()
        while not all(os.path.exists(flag.format(n)) for n in names):
            assert time.monotonic() < deadline, f"rank {rank}: no {names} in time"
            time.sleep(0.01)

    def touch(name: str) -> None:
        with open(flag.format(name), "w"):
            pass

    if rank < 2:

        def dump_when_told() -> None:
            await_files("dump")
            recorder.dump_file(rank)
            touch(f"dumped_{rank}")

        thread = threading.Thread(target=dump_when_told)
        thread.start()
        touch(f"entering_{rank}")
        t = torch.ones(8)
        hang.all_reduce(t, ReduceOp.SUM, False)  # waits for rank 2
        thread.join()
        assert torch.equal(t, torch.full((8,), 3.0)), t
    else:
        await_files("entering_0", "entering_1")
        time.sleep(0.5)  # let ranks 0-1 block inside all_reduce #2
        touch("dump")
        recorder.dump_file(rank)
        await_files("dumped_0", "dumped_1")
        t = torch.ones(8)
        hang.all_reduce(t, ReduceOp.SUM, False)  # release them
    mm.finalize()
    hang.finalize()


def test_report_and_trace_over_a_real_job(tmp_path: Path) -> None:
    dump_dir = tmp_path / "dumps"
    dump_dir.mkdir()
    env = {"TORCHCOMM_FR_DUMP_TEMP_FILE": str(dump_dir / "rank_")}
    run_ranks(_job, 3, timeout=120, env=env)
    trace = tmp_path / "trace.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torchcomms.tools.fr", str(dump_dir), "--trace", str(trace)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    assert out.startswith("3 dumps: ranks 0-2\n"), out
    hang = out[out.index("communicator 'tool_hang'") :]
    hang = hang[: hang.index("communicator", 5)] if "communicator" in hang[5:] else hang
    verdict = next(line for line in hang.splitlines() if "verdict:" in line)
    assert "rank 2 never entered all_reduce #2 (op_id " in verdict, out
    assert "ranks 0-1 waiting in all_reduce #2 (op_id " in verdict, out
    waited = float(verdict.split(" since ")[1].split(" s")[0])
    assert waited >= 0.5, verdict
    assert "rank 2: last entered all_reduce #1" in hang, hang
    assert "[started]" in hang, hang
    mm = out[out.index("communicator 'tool_mm'") :]
    assert "mismatch: #2: ranks 0, 2: all_reduce in=[[4]] ['Float']" in mm, mm
    assert "vs rank 1: all_reduce in=[[5]] ['Float']" in mm, mm
    assert "failed: CollectiveMismatchError: " in mm, mm
    assert "\nproblems found\n" in out and "[failed]" in mm, out

    events = json.loads(trace.read_text())["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert procs == {0: "rank 0", 1: "rank 1", 2: "rank 2"}, procs
    slices = [e for e in events if e["ph"] == "X"]
    unfinished = sorted(e["pid"] for e in slices if e["name"] == "all_reduce #2 (unfinished)")
    assert unfinished == [0, 1], slices
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices), slices
    threads = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert {"tool_hang", "tool_mm"} <= threads, threads


def test_helpers_json_dumps_and_bad_input(tmp_path: Path) -> None:
    assert frtool.rank_ranges([5, 0, 1, 2, 7, 8]) == "0-2, 5, 7-8"
    assert frtool.main([str(tmp_path / "missing")]) == 2
    assert frtool.main([str(tmp_path)]) == 2  # no dumps
    # JSON dumps (dump_json) are read too; a healthy job reports no problem.
    comm = new_comm("fake", CPU, name="tool_json")
    rec = FlightRecorderHook(isolated=True)
    rec.register_with_comm(comm)
    comm.all_reduce(torch.ones(2), ReduceOp.SUM, False)
    (tmp_path / "fr_0.json").write_text(rec.dump_json())
    (tmp_path / "notes.txt").write_text("not a dump")
    dumps = frtool.load_dir(str(tmp_path))
    assert [d.rank for d in dumps] == [0]
    text, problem = frtool.report(dumps)
    assert not problem, text
    assert "all ranks completed all_reduce #1" in text and text.endswith("no problems found")
    comm.finalize()


def test_mismatch_rules_ignore_rank_dependent_sizes() -> None:
    def entry(op: str, seq: int, size: int) -> dict[str, Any]:
        return {
            "profiling_name": f"gloo:{op}",
            "collective_seq_id": seq,
            "input_sizes": [[size]],
            "input_dtypes": ["Float"],
            "output_sizes": [[size]],
            "output_dtypes": ["Float"],
            "state": "completed",
        }

    view = frtool.CommView("c", [0, 1])
    view.entries = {
        0: [entry("all_gather_v", 1, 2), entry("broadcast", 2, 3)],
        1: [entry("all_gather_v", 1, 5), entry("broadcast", 2, 4)],
    }
    found = frtool.find_mismatches(view)
    assert len(found) == 1 and found[0].startswith("#2: rank 0: broadcast in=[[3]]"), found
