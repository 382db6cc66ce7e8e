"""clog, NanCheckHook, the JSON-lines event log and the collective check (issue 6 items 5-6).

* ``torchcomms.hooks.clog``: upstream's pipe-delimited format (version header, ``new_comm``
  lines, one deduplicated ``sig`` line per signature, ``Q``/``S``/``E`` events, ``split``).
* ``torchcomms.hooks.NanCheckHook``: NaN in an input (or, with ``check_outputs``, an output)
  stops the op with ``"NaN detected in ... tensor for '<op>' on comm '<name>'"``; Inf and
  integer tensors pass; ``unregister``/``is_enabled``.
* ``TORCHCOMM_LOG_JSON``: one JSON line per op with comm, rank, op, op_id, seq, bytes,
  duration and error.
* ``TORCHCOMM_CHECK_COLLECTIVES=1``: matching collectives run normally (and use no op_id and
  fire no hooks for the check); any difference in op, dtype, shape, root or reduce op raises
  ``CollectiveMismatchError`` on every rank, naming both fingerprints; the comm stays usable.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness import RankContext, run_ranks
from torchcomms import CollectiveMismatchError, OpName, ReduceOp, TorchComm, new_comm
from torchcomms.hooks import NanCheckHook, clog

CPU = torch.device("cpu")


def _lines(path: str) -> list[str]:
    with open(path) as f:
        return [line.rstrip("\n") for line in f if line.strip()]


# ----------------------------------------------------------------------------- clog + NaN


def _clog_and_nan(ctx: RankContext) -> dict[str, Any]:
    rank = ctx.rank
    path = os.path.join(ctx.tmpdir, f"clog_{rank}.log")
    log = clog(output=path, events=["ALL"])
    comm = new_comm("gloo", CPU, name="obs_clog", store=ctx.store)
    log.register_with_comm(comm)
    t = torch.ones(1024)
    comm.all_reduce(t, ReduceOp.SUM, False)
    comm.all_reduce(t, ReduceOp.SUM, False)
    assert torch.equal(t, torch.full((1024,), 4.0)), t[:4]
    comm.broadcast(torch.ones(256), 0, False)
    comm.barrier(True).wait()
    comm.all_reduce(torch.ones(128, dtype=torch.float16), ReduceOp.MAX, False)
    child = comm.split([0, 1], "obs_clog_child")
    assert child is not None
    child.all_reduce(torch.ones(8), ReduceOp.SUM, False)

    # NaN check, on every rank (a NaN stops the op before any peer communication).
    nan = NanCheckHook()
    assert not nan.is_enabled()
    nan.register_with_comm(comm)
    assert nan.is_enabled()
    errors: dict[str, str] = {}
    with pytest.raises(RuntimeError) as info:
        comm.all_reduce(torch.tensor([1.0, float("nan")]), ReduceOp.SUM, False)
    errors["all_reduce"] = str(info.value)
    with pytest.raises(RuntimeError) as info:
        comm.broadcast(torch.tensor([float("nan")]), 0, False)
    errors["broadcast"] = str(info.value)
    with pytest.raises(RuntimeError) as info:
        comm.all_gather_single(torch.zeros(4), torch.tensor([float("nan"), 1.0]), False)
    errors["all_gather_single input"] = str(info.value)
    # Inf and integer tensors are not flagged; the op runs.
    inf = torch.tensor([1.0, float("inf")])
    comm.all_reduce(inf, ReduceOp.SUM, False)
    assert inf[0].item() == 2.0 and inf[1].item() == float("inf"), inf
    ints = torch.tensor([1, 2], dtype=torch.int32)
    comm.all_reduce(ints, ReduceOp.SUM, False)
    assert torch.equal(ints, torch.tensor([2, 4], dtype=torch.int32))
    nan.unregister()
    assert not nan.is_enabled()
    after = torch.tensor([float("nan")])
    comm.all_reduce(after, ReduceOp.SUM, False)  # unregistered: runs
    assert torch.isnan(after).all()
    out_check = NanCheckHook(check_inputs=False, check_outputs=True)
    out_check.register_with_comm(comm)
    with pytest.raises(RuntimeError) as info:
        comm.all_gather_single(torch.full((4,), float("nan")), torch.ones(2), False)
    errors["all_gather_single output"] = str(info.value)
    ok = torch.full((4,), float("nan"))
    # In-place ops check their tensor whichever flag is set; a clean one runs.
    comm.all_reduce(torch.ones(2), ReduceOp.SUM, False)
    out_check.unregister()
    comm.all_gather_single(ok, torch.ones(2), False)
    assert torch.equal(ok, torch.ones(4))

    log.close()
    child.finalize()
    comm.finalize()
    return {"log": _lines(path), "errors": errors}


def test_clog_and_nan_check_on_gloo() -> None:
    results = run_ranks(_clog_and_nan, 2, timeout=120)
    for rank, res in enumerate(results):
        lines = res["log"]
        assert lines[0].startswith("V|1|base_timestamp="), lines[:2]
        assert f"new_comm|comm=obs_clog|rank={rank}|world_size=2" in lines, lines
        sig = "sig|all_reduce|in_count=1024|out_count=1024|dtype=f32|red_op=sum|async_op=f"
        sig_lines = [ln for ln in lines if sig in ln]
        assert len(sig_lines) == 1, lines  # deduplicated
        corr = sig_lines[0].split("|", 1)[0]
        assert sig_lines[0] == f"{corr}|{sig}|comm=obs_clog", sig_lines
        queued = [ln for ln in lines if ln.startswith(f"{corr}|Q|work_id=")]
        assert len(queued) == 2, lines
        assert len([ln for ln in lines if ln.startswith(f"{corr}|S|+")]) == 2, lines
        assert len([ln for ln in lines if ln.startswith(f"{corr}|E|+")]) == 2, lines
        assert any(
            "sig|broadcast|in_count=256|out_count=256|dtype=f32|root=0|async_op=f" in ln
            for ln in lines
        ), lines
        assert any(ln.endswith("|sig|barrier|async_op=t|comm=obs_clog") for ln in lines), lines
        assert any("dtype=f16|red_op=max" in ln for ln in lines), lines
        assert "split|parent=obs_clog|child=obs_clog_child|ranks=0,1" in lines, lines
        assert f"new_comm|comm=obs_clog_child|rank={rank}|world_size=2" in lines, lines
        assert any(ln.endswith("|comm=obs_clog_child") and "|sig|all_reduce|" in ln for ln in lines)
        work_ids = [int(ln.split("work_id=")[1].split("|")[0]) for ln in lines if "|Q|" in ln]
        assert work_ids == list(range(1, len(work_ids) + 1)), work_ids

        errors = res["errors"]
        assert errors["all_reduce"].startswith(
            "NaN detected in input tensor for 'all_reduce' on comm 'obs_clog': "
        ), errors
        assert "'broadcast'" in errors["broadcast"], errors
        assert "input tensor for 'all_gather_single'" in errors["all_gather_single input"]
        assert errors["all_gather_single output"].startswith(
            "NaN detected in output tensor for 'all_gather_single' on comm 'obs_clog'"
        ), errors


def test_clog_and_nan_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown event 'BOGUS'"):
        clog(output=str(tmp_path / "x.log"), events=["BOGUS"])
    with pytest.raises(ValueError, match="unknown verbose option 'ptrs'"):
        clog(output=str(tmp_path / "x.log"), events=["ALL"], verbose=["ptrs"])
    # events=[] logs signatures and Q only; verbose buffers adds addresses.
    path = str(tmp_path / "q.log")
    log = clog(output=path, events=[], verbose=["buffers"])
    comm = new_comm("fake", CPU, name="obs_q")
    log.register_with_comm(comm)
    t = torch.ones(4)
    comm.all_reduce(t, ReduceOp.SUM, False)
    lines = _lines(path)
    assert any(f"buf={hex(t.data_ptr())}" in ln for ln in lines), lines
    assert not any("|S|" in ln or "|E|" in ln for ln in lines), lines
    log.unregister()
    comm.all_reduce(t, ReduceOp.SUM, False)
    assert len(_lines(path)) == len(lines)
    log.close()
    with pytest.raises(TypeError, match="expects a TorchComm"):
        NanCheckHook().register_with_comm("comm")  # type: ignore[arg-type]
    comm.finalize()


# ----------------------------------------------------------------------------- JSON log + check


def _check_mode(ctx: RankContext) -> dict[str, Any]:
    rank = ctx.rank
    log_path = os.path.join(ctx.tmpdir, f"ops_{rank}.jsonl")
    os.environ["TORCHCOMM_LOG_JSON"] = log_path
    os.environ["TORCHCOMM_CHECK_COLLECTIVES"] = "1"
    try:
        comm = new_comm("gloo", CPU, name="obs_check", store=ctx.store)
    finally:
        del os.environ["TORCHCOMM_LOG_JSON"]
        del os.environ["TORCHCOMM_CHECK_COLLECTIVES"]
    seen: list[tuple[OpName, int]] = []
    comm.register_pre_hook(lambda name, op_id, args: seen.append((name, op_id)))

    # Matching collectives run normally, with rank-dependent sizes where allowed.
    t = torch.full((4,), rank + 1, dtype=torch.int64)
    comm.all_reduce(t, ReduceOp.SUM, False)
    assert torch.equal(t, torch.full((4,), 3, dtype=torch.int64)), t
    b = torch.full((2, 3), float(rank))
    comm.broadcast(b, 1, True).wait()
    assert torch.equal(b, torch.ones(2, 3)), b
    outs = [torch.zeros(r + 1) for r in range(2)]
    comm.all_gather_v(outs, torch.full((rank + 1,), float(rank)), False)
    assert torch.equal(outs[0], torch.zeros(1)) and torch.equal(outs[1], torch.ones(2)), outs
    x = torch.tensor([7.0])
    if rank == 0:
        comm.send(x, 1, False)  # p2p is not checked
    else:
        got = torch.zeros(1)
        comm.recv(got, 0, False)
        assert torch.equal(got, x)

    # Mismatches: every rank raises, naming its own and the other rank's fingerprint.
    errors: dict[str, str] = {}
    cases: list[tuple[str, Any]] = [
        (
            "op",
            lambda: (
                comm.all_reduce(torch.ones(4), ReduceOp.SUM, False)
                if rank == 0
                else comm.broadcast(torch.ones(4), 0, False)
            ),
        ),
        (
            "dtype",
            lambda: comm.all_reduce(
                torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float64),
                ReduceOp.SUM,
                False,
            ),
        ),
        ("numel", lambda: comm.all_reduce(torch.ones(4 + rank), ReduceOp.SUM, False)),
        (
            "shape",
            lambda: comm.all_reduce(torch.ones((2, 3) if rank else (3, 2)), ReduceOp.SUM, False),
        ),
        ("root", lambda: comm.broadcast(torch.ones(4), rank, False)),
        (
            "red_op",
            lambda: comm.all_reduce(torch.ones(4), ReduceOp.SUM if rank else ReduceOp.MAX, True),
        ),
    ]
    for case, call in cases:
        with pytest.raises(CollectiveMismatchError) as info:
            call()
        errors[case] = str(info.value)
    # Still usable after a caught mismatch.
    t = torch.full((4,), rank + 1, dtype=torch.int64)
    comm.all_reduce(t, ReduceOp.SUM, False)
    assert torch.equal(t, torch.full((4,), 3, dtype=torch.int64)), t
    op_ids = [op_id for _, op_id in seen]
    comm.finalize()
    with open(log_path) as f:
        log = [json.loads(line) for line in f]
    return {"errors": errors, "op_ids": op_ids, "ops": [n.name for n, _ in seen], "log": log}


def test_json_log_and_collective_check_on_gloo() -> None:
    results = run_ranks(_check_mode, 2, timeout=120)
    for rank, res in enumerate(results):
        other = 1 - rank
        errors = res["errors"]
        for case, text in errors.items():
            assert f"[comm=obs_check rank={rank}]" in text, (case, text)
            assert "collective mismatch across ranks" in text, (case, text)
            assert f"rank {rank}: " in text and f"rank {other}: " in text, (case, text)
        assert (
            "rank 0: all_reduce(seq=4" in errors["op"] and "rank 1: broadcast(seq=4" in errors["op"]
        ), errors["op"]
        assert "dtype=float32" in errors["dtype"] and "dtype=float64" in errors["dtype"]
        assert "numel=4, shape=[4]" in errors["numel"] and "numel=5, shape=[5]" in errors["numel"]
        assert "shape=[3, 2]" in errors["shape"] and "shape=[2, 3]" in errors["shape"]
        assert "root=0" in errors["root"] and "root=1" in errors["root"], errors["root"]
        assert "red_op=MAX" in errors["red_op"] and "red_op=SUM" in errors["red_op"]
        # The check itself used no op_id and fired no hook: ids are consecutive, one per op.
        op_ids = res["op_ids"]
        assert op_ids == list(range(op_ids[0], op_ids[0] + len(op_ids))), op_ids
        assert len(op_ids) == 4 + 6 + 1, res["ops"]

        log = res["log"]
        assert log[0]["event"] == "new_comm" and log[0]["comm"] == "obs_check", log[0]
        assert log[0]["rank"] == rank and log[0]["size"] == 2
        ops = [e for e in log if e["event"] == "op"]
        assert [e["op_id"] for e in ops] == op_ids, ops
        first = ops[0]
        assert first["op"] == "all_reduce" and first["bytes"] == 32 and first["seq"] == 1, first
        assert first["error"] is None and first["state"] == "completed", first
        assert first["duration_ms"] >= 0 and first["comm"] == "obs_check", first
        assert ops[1]["op"] == "broadcast" and ops[1]["async_op"] is True and ops[1]["bytes"] == 24
        assert ops[2]["op"] == "all_gather_v" and ops[2]["bytes"] == 4 * (rank + 1), ops[2]
        assert ops[3]["op"] == ("send" if rank == 0 else "recv") and ops[3]["seq"] == 1, ops[3]
        failed = ops[4:10]
        assert all(e["state"] == "failed" for e in failed), failed
        assert all(e["error"].startswith("CollectiveMismatchError: ") for e in failed), failed
        assert [e["seq"] for e in ops if e["op"] != ops[3]["op"]] == list(range(1, 11)), ops
        assert ops[-1]["error"] is None


def test_check_mode_off_by_default_and_fake_comm_unchecked() -> None:
    comm: TorchComm = new_comm("fake", CPU, name="obs_unchecked")
    assert [type(o).__name__ for o in comm._observers] == ["_Ring"], comm._observers
    os.environ["TORCHCOMM_CHECK_COLLECTIVES"] = "1"
    try:
        checked = new_comm("fake", CPU, name="obs_checked_fake")
    finally:
        del os.environ["TORCHCOMM_CHECK_COLLECTIVES"]
    assert "CollectiveChecker" in [type(o).__name__ for o in checked._observers]
    checked.all_reduce(torch.ones(2), ReduceOp.SUM, False)  # size 1: nothing to compare
    os.environ["TORCHCOMM_CHECK_COLLECTIVES"] = "maybe"
    try:
        with pytest.raises(RuntimeError, match="TORCHCOMM_CHECK_COLLECTIVES"):
            new_comm("fake", CPU, name="obs_bad_env")
    finally:
        del os.environ["TORCHCOMM_CHECK_COLLECTIVES"]
    comm.finalize()
    checked.finalize()


# -- what the observers read off each op: pinned to what they read before the op table ---------
def _observed_cases() -> tuple[list[tuple[OpName, Any, tuple[Any, ...]]], list[torch.Tensor]]:
    from torchcomms.optable import hook_args as H

    t4, t8 = torch.zeros(4), torch.zeros(8, dtype=torch.int64)
    l2 = [torch.zeros(2), torch.zeros(3)]
    S = ReduceOp.SUM
    cases = [
        (OpName.send, H.SendPreHookArgs(t4, 1, False), (t4, 1, False)),
        (OpName.recv, H.RecvPreHookArgs(t8, 0, True), (t8, 0, True)),
        (OpName.broadcast, H.BroadcastPreHookArgs(t4, 1, False), (t4, 1, False)),
        (OpName.all_reduce, H.AllReducePreHookArgs(t4, False), (t4, S, False)),
        (OpName.reduce, H.ReducePreHookArgs(t8, 0, True), (t8, 0, ReduceOp.MAX, True)),
        (OpName.all_gather, H.AllGatherPreHookArgs(t4, l2, False), (l2, t4, False)),
        (OpName.all_gather_v, H.AllGatherVPreHookArgs(t4, l2, False), (l2, t4, False)),
        (OpName.all_gather_single, H.AllGatherSinglePreHookArgs(t4, t8, False), (t8, t4, False)),
        (OpName.reduce_scatter, H.ReduceScatterPreHookArgs(l2, t4, False), (t4, l2, S, False)),
        (OpName.reduce_scatter_v, H.ReduceScatterVPreHookArgs(l2, t4, True), (t4, l2, S, True)),
        (
            OpName.reduce_scatter_single,
            H.ReduceScatterSinglePreHookArgs(t8, t4, False),
            (t4, t8, S, False),
        ),
        (OpName.all_to_all_single, H.AllToAllSinglePreHookArgs(t4, t4, False), (t4, t4, False)),
        (
            OpName.all_to_all_v_single,
            H.AllToAllVSinglePreHookArgs(t4, t8, [1, 3], [2, 2], False),
            (t8, t4, [2, 2], [1, 3], False),
        ),
        (OpName.all_to_all, H.AllToAllPreHookArgs(l2, [t4, t4], False), ([t4, t4], l2, False)),
        (OpName.all_to_all, H.AllToAllPreHookArgs([], [], False), ([], [], False)),
        (OpName.barrier, H.BarrierPreHookArgs(True), (True,)),
        (OpName.scatter, H.ScatterPreHookArgs(t4, l2, 1, False), (t4, l2, 1, False)),
        (OpName.gather, H.GatherPreHookArgs(t4, l2, 0, False), (l2, t4, 0, False)),
        (OpName.gather_single, H.GatherSinglePreHookArgs(t4, t8, 1, False), (t8, t4, 1, False)),
        (OpName.batch_op_issue, H.BatchOpIssuePreHookArgs(3, False), ()),
    ]
    return cases, [t4, t8, *l2]


#: Per case: clog's line without and with buffers (@i: the i-th of t4, t8, l2[0], l2[1]),
#: the collective check's key tensor and whether its shape must agree.
_OBSERVED = [
    (
        "send|in_count=4|out_count=0|dtype=f32|peer=1|async_op=f",
        "send|in_count=4|out_count=0|dtype=f32|peer=1|async_op=f",
        None,
        False,
    ),
    (
        "recv|in_count=0|out_count=8|dtype=i64|peer=0|async_op=t",
        "recv|in_count=0|out_count=8|dtype=i64|peer=0|async_op=t",
        None,
        False,
    ),
    (
        "broadcast|in_count=4|out_count=4|dtype=f32|root=1|async_op=f",
        "broadcast|in_count=4|out_count=4|dtype=f32|buf=@0|root=1|async_op=f",
        "@0",
        True,
    ),
    (
        "all_reduce|in_count=4|out_count=4|dtype=f32|red_op=sum|async_op=f",
        "all_reduce|in_count=4|out_count=4|dtype=f32|buf=@0|red_op=sum|async_op=f",
        "@0",
        True,
    ),
    (
        "reduce|in_count=8|out_count=8|dtype=i64|red_op=max|root=0|async_op=t",
        "reduce|in_count=8|out_count=8|dtype=i64|buf=@1|red_op=max|root=0|async_op=t",
        "@1",
        True,
    ),
    (
        "all_gather|in_count=4|out_counts=2,3|dtype=f32|async_op=f",
        "all_gather|in_count=4|out_counts=2,3|dtype=f32|in=@0|out=@2,@3|async_op=f",
        "@0",
        True,
    ),
    (
        "all_gather_v|in_count=4|out_counts=2,3|dtype=f32|async_op=f",
        "all_gather_v|in_count=4|out_counts=2,3|dtype=f32|in=@0|out=@2,@3|async_op=f",
        "@0",
        False,
    ),
    (
        "all_gather_single|in_count=4|out_count=8|dtype=f32|async_op=f",
        "all_gather_single|in_count=4|out_count=8|dtype=f32|in=@0|out=@1|async_op=f",
        "@0",
        True,
    ),
    (
        "reduce_scatter|in_counts=2,3|out_count=4|dtype=f32|red_op=sum|async_op=f",
        "reduce_scatter|in_counts=2,3|out_count=4|dtype=f32|in=@2,@3|out=@0|red_op=sum|async_op=f",
        "@0",
        True,
    ),
    (
        "reduce_scatter_v|in_counts=2,3|out_count=4|dtype=f32|red_op=sum|async_op=t",
        "reduce_scatter_v|in_counts=2,3|out_count=4|dtype=f32|in=@2,@3|out=@0|red_op=sum|async_op=t",
        "@0",
        False,
    ),
    (
        "reduce_scatter_single|in_count=8|out_count=4|dtype=i64|red_op=sum|async_op=f",
        "reduce_scatter_single|in_count=8|out_count=4|dtype=i64|in=@1|out=@0|red_op=sum|async_op=f",
        "@0",
        True,
    ),
    (
        "all_to_all_single|in_count=4|out_count=4|dtype=f32|async_op=f",
        "all_to_all_single|in_count=4|out_count=4|dtype=f32|in=@0|out=@0|async_op=f",
        "@0",
        True,
    ),
    (
        "all_to_all_v_single|in_splits=1,3|out_splits=2,2|dtype=f32|async_op=f",
        "all_to_all_v_single|in_splits=1,3|out_splits=2,2|dtype=f32|async_op=f",
        "@0",
        False,
    ),
    (
        "all_to_all|in_counts=2,3|out_counts=4,4|dtype=f32|async_op=f",
        "all_to_all|in_counts=2,3|out_counts=4,4|dtype=f32|async_op=f",
        "@2",
        False,
    ),
    (
        "all_to_all|in_counts=|out_counts=|dtype=other|async_op=f",
        "all_to_all|in_counts=|out_counts=|dtype=other|async_op=f",
        None,
        False,
    ),
    ("barrier|async_op=t", "barrier|async_op=t", None, False),
    (
        "scatter|in_counts=2,3|out_count=4|dtype=f32|root=1|async_op=f",
        "scatter|in_counts=2,3|out_count=4|dtype=f32|in=@2,@3|out=@0|root=1|async_op=f",
        "@0",
        True,
    ),
    (
        "gather|in_count=4|out_counts=2,3|dtype=f32|root=0|async_op=f",
        "gather|in_count=4|out_counts=2,3|dtype=f32|in=@0|out=@2,@3|root=0|async_op=f",
        "@0",
        True,
    ),
    (
        "gather_single|in_count=4|out_count=8|dtype=f32|root=1|async_op=f",
        "gather_single|in_count=4|out_count=8|dtype=f32|in=@0|out=@1|root=1|async_op=f",
        "@0",
        True,
    ),
    ("batch_op_issue|num_ops=3|async_op=f", "batch_op_issue|num_ops=3|async_op=f", None, False),
]


def test_observers_read_each_op_as_before_the_op_table() -> None:
    """clog's line and the collective check's key tensor for every op, derived from the op
    table, equal what the per-op code before it produced (captured from commit e217720)."""
    import importlib

    from torchcomms.runtime import opinfo

    signature = importlib.import_module("torchcomms.hooks.clog").signature
    cases, tensors = _observed_cases()
    labels = {hex(t.data_ptr()): f"@{i}" for i, t in enumerate(tensors)}
    assert len(cases) == len(_OBSERVED)
    for (name, args, call), (plain, with_buffers, key, agree) in zip(cases, _OBSERVED, strict=True):
        assert signature(name, args, call, False) == plain, name
        line = signature(name, args, call, True)
        for address, label in labels.items():
            line = line.replace(address, label)
        assert line == with_buffers, name
        got, must_agree = opinfo.key_tensor(name, args)
        got_label = next((f"@{i}" for i, t in enumerate(tensors) if t is got), None)
        assert (got_label, must_agree) == (key, agree), name
