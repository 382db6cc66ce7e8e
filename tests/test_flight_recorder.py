"""The flight recorder (issue 6 items 1-3, 7): ``torchcomms.hooks.FlightRecorderHook``.

Covers the reference API (§7.2: ``register_with_comm``, ``dump_json``, ``dump_file``,
``reset``, ``size``/``__len__``, ``is_enabled``, ``unregister``), PyTorch's FR v2.10 entry
fields with real ``scheduled -> started -> completed`` transitions and an ``error`` field,
self-consistent ``pg_config``/``pg_status``, split children auto-registered, the always-on
process-wide recorder (``TORCHCOMM_FR_BUFFER_SIZE``), automatic dumps on timeout / peer
failure / abort with the path in the error, the SIGUSR1 dump within 1 s, and the
**unmodified** ``python -m torch.distributed.flight_recorder.fr_trace`` naming the rank that
skipped a collective.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import io
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.flight_recorder.components.builder import build_db

import torchcomms
from tests import harness
from tests.harness import RankContext, run_ranks
from torchcomms import CommTimeoutError, PeerFailureError, ReduceOp, TorchComm, new_comm
from torchcomms.hooks import FlightRecorderHook

CPU = torch.device("cpu")
REQUIRED_FIELDS = {
    "record_id": int,
    "pg_id": int,
    "process_group": list,
    "collective_seq_id": int,
    "p2p_seq_id": int,
    "op_id": int,
    "profiling_name": str,
    "time_created_ns": int,
    "input_sizes": list,
    "input_dtypes": list,
    "output_sizes": list,
    "output_dtypes": list,
    "state": str,
    "is_p2p": bool,
    "retired": bool,
    "timeout_ms": int,
    "frames": list,
    "thread_id": str,
    "thread_name": str,
}
#: Short op timeout (seconds, before the harness scale) for the fault cases.
FAULT_TIMEOUT_S = 2
SETUP_TIMEOUT = timedelta(seconds=120)


def _scaled(seconds: float) -> float:
    return seconds * harness.timeout_scale()


def _fault_timeout() -> timedelta:
    return timedelta(seconds=_scaled(FAULT_TIMEOUT_S))


def _check_entry(entry: dict[str, Any], case: str) -> None:
    for field, kind in REQUIRED_FIELDS.items():
        assert field in entry, f"{case}: entry lacks {field}: {entry}"
        assert isinstance(entry[field], kind), f"{case}: {field}={entry[field]!r}"
    for field in ("time_discovered_started_ns", "time_discovered_completed_ns", "error"):
        assert field in entry, f"{case}: entry lacks {field}"
    assert entry["state"] in ("scheduled", "started", "completed"), case
    assert entry["timeout_ms"] > 0, case
    assert len(entry["process_group"]) == 2, case
    if entry["state"] == "completed":
        assert entry["retired"] is True and entry["duration_ms"] >= 0, (case, entry)
        created = entry["time_created_ns"]
        started = entry["time_discovered_started_ns"]
        completed = entry["time_discovered_completed_ns"]
        assert created <= started <= completed, (case, entry)


# ----------------------------------------------------------------------------- in-process API


def test_api_on_fake_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """size/len/reset/is_enabled/unregister, dump_json fields, split children, dump_file pickle."""
    comm = new_comm("fake", CPU, name="fr_api")
    rec = FlightRecorderHook(max_entries=100, isolated=True)
    assert (rec.size(), len(rec), rec.is_enabled()) == (0, 0, False)
    data = json.loads(rec.dump_json())
    assert data["version"] == "2.10" and data["entries"] == [], data
    assert "pg_config" in data and "pg_status" in data

    rec.register_with_comm(comm)
    assert rec.is_enabled()
    t = torch.ones(10, 10)
    comm.all_reduce(t, ReduceOp.SUM, False)
    comm.broadcast(t, 0, True).wait()
    child = comm.split([0], "fr_api_child")
    assert child is not None
    child.all_reduce(torch.ones(3, dtype=torch.int64), ReduceOp.MAX, False)
    assert rec.size() == len(rec) == 4, rec.dump_json()

    data = json.loads(rec.dump_json())
    entries = data["entries"]
    names = [e["profiling_name"] for e in entries]
    assert names == ["fake:all_reduce", "fake:broadcast", "fake:split", "fake:all_reduce"], names
    for e in entries:
        _check_entry(e, "fake")
        assert e["state"] == "completed" and e["error"] is None, e
    assert [e["record_id"] for e in entries] == [0, 1, 2, 3]
    assert entries[0]["input_sizes"] == [[10, 10]] and entries[0]["input_dtypes"] == ["Float"]
    assert entries[3]["output_dtypes"] == ["Long"] and entries[3]["input_sizes"] == [[3]]
    # The split is the child's first collective; parent and child count separately.
    assert [(e["process_group"][0], e["collective_seq_id"]) for e in entries] == [
        ("fr_api", 1),
        ("fr_api", 2),
        ("fr_api_child", 1),
        ("fr_api_child", 2),
    ]
    assert entries[0]["op_id"] < entries[1]["op_id"] < entries[2]["op_id"] < entries[3]["op_id"]
    assert data["pg_config"]["fr_api"] == {"name": "fr_api", "desc": "default_pg", "ranks": "[0]"}
    assert data["pg_config"]["fr_api_child"]["desc"] == "split:fr_api"
    assert set(data["pg_status"]) == set(data["pg_config"])
    assert data["pg_status"]["fr_api"] == {
        "last_enqueued_collective": 2,
        "last_started_collective": 2,
        "last_completed_collective": 2,
    }
    # include_completed=False: only ops still in flight.
    assert json.loads(rec.dump_json(False))["entries"] == []

    # dump_file: a pickle at <TORCHCOMM_FR_DUMP_TEMP_FILE><rank>, read at each write.
    prefix = str(tmp_path / "trace_")
    monkeypatch.setenv("TORCHCOMM_FR_DUMP_TEMP_FILE", prefix)
    path = rec.dump_file(5)
    assert path == f"{prefix}5"
    with open(path, "rb") as f:
        dumped = pickle.load(f)
    assert dumped["version"] == "2.10" and len(dumped["entries"]) == 4
    assert dumped["torchcomms"]["rank"] == 5

    # reset: empty, ids restart; later ops are recorded again.
    rec.reset()
    assert rec.size() == 0 and json.loads(rec.dump_json())["entries"] == []
    comm.barrier(False)
    data = json.loads(rec.dump_json())
    assert [e["record_id"] for e in data["entries"]] == [0]
    assert data["entries"][0]["input_sizes"] == [] and data["entries"][0]["collective_seq_id"] == 3

    # unregister: no more entries from this hook's comms (or their split children).
    rec.unregister()
    assert not rec.is_enabled()
    comm.barrier(False)
    child.barrier(False)
    assert rec.size() == 1
    child.finalize()
    comm.finalize()


def test_ring_wraps_and_recorders_share_or_isolate() -> None:
    comm = new_comm("fake", CPU, name="fr_ring")
    small = FlightRecorderHook(max_entries=3, isolated=True)
    small.register_with_comm(comm)
    other = FlightRecorderHook(max_entries=50, isolated=True)
    other.register_with_comm(comm)
    shared_a, shared_b = FlightRecorderHook(), FlightRecorderHook()
    shared_a.register_with_comm(comm)
    shared_a.reset()
    t = torch.ones(2)
    for _ in range(5):
        comm.all_reduce(t, ReduceOp.SUM, False)
    entries = json.loads(small.dump_json())["entries"]
    assert [e["collective_seq_id"] for e in entries] == [3, 4, 5], entries
    assert [e["record_id"] for e in entries] == [2, 3, 4]
    assert other.size() == 5
    # Non-isolated recorders share the process-wide buffer (the always-on recorder's).
    assert shared_b.size() == shared_a.size() == 5
    # A comm created while TORCHCOMM_FR_BUFFER_SIZE=0 gets no always-on recorder.
    os.environ["TORCHCOMM_FR_BUFFER_SIZE"] = "0"
    try:
        off = new_comm("fake", CPU, name="fr_off")
    finally:
        del os.environ["TORCHCOMM_FR_BUFFER_SIZE"]
    assert off._observers == (), off._observers
    on = new_comm("fake", CPU, name="fr_on")
    assert len(on._observers) == 1
    shared_a.reset()
    on.barrier(False)
    assert json.loads(shared_b.dump_json())["entries"][0]["process_group"][0] == "fr_on"
    for c in (off, on, comm):
        c.finalize()


# ----------------------------------------------------------------------------- gloo, 2 ranks


def _states_and_fields(ctx: RankContext) -> dict[str, Any]:
    """Real state transitions, sizes, seq ids, p2p names, split ranks; build_db parses it."""
    rank, store = ctx.rank, ctx.store
    comm = new_comm("gloo", CPU, name="fr_states", store=store)
    rec = FlightRecorderHook(max_entries=200, isolated=True)
    rec.register_with_comm(comm)
    comm.barrier(False)

    # scheduled -> started -> completed, observed live: rank 1 joins only when told.
    if rank == 0:
        a, b = torch.ones(4), torch.ones(4)
        w1 = comm.all_reduce(a, ReduceOp.SUM, True)
        w2 = comm.all_reduce(b, ReduceOp.SUM, True)
        deadline = time.monotonic() + _scaled(30)
        states: list[str] = []
        while time.monotonic() < deadline:
            states = [e["state"] for e in json.loads(rec.dump_json())["entries"][-2:]]
            if states == ["started", "scheduled"]:
                break
            time.sleep(0.01)
        assert states == ["started", "scheduled"], states
        active = json.loads(rec.dump_json(False))["entries"]
        assert [e["state"] for e in active] == ["started", "scheduled"], active
        store.set("join", "1")
        w1.wait()
        w2.wait()
        assert torch.equal(a, torch.full((4,), 2.0)) and torch.equal(b, torch.full((4,), 2.0))
    else:
        store.wait(["join"], timedelta(seconds=_scaled(60)))
        for _ in range(2):
            t = torch.ones(4)
            comm.all_reduce(t, ReduceOp.SUM, False)
    entries = json.loads(rec.dump_json())["entries"]
    assert [e["state"] for e in entries[-2:]] == ["completed", "completed"], entries[-2:]

    # Sizes/dtypes of list collectives, p2p names and seq ids.
    out = [torch.zeros(2, 4, dtype=torch.int64) for _ in range(2)]
    comm.all_gather(out, torch.full((2, 4), rank, dtype=torch.int64), False)
    inp = [torch.ones(3) for _ in range(2)]
    res = torch.zeros(3)
    comm.reduce_scatter(res, inp, ReduceOp.SUM, False)
    peer = 1 - rank
    x = torch.arange(5, dtype=torch.float64)
    if rank == 0:
        comm.send(x, peer, False)
        comm.recv(x, peer, False)
    else:
        comm.recv(x, peer, False)
        comm.send(x, peer, False)
    child = comm.split([1, 0], "fr_states_rev")
    assert child is not None
    child.all_reduce(torch.ones(1), ReduceOp.SUM, False)
    data = json.loads(rec.dump_json())
    for e in data["entries"]:
        _check_entry(e, f"rank {rank}")
    by_name = {e["profiling_name"]: e for e in data["entries"]}
    ag = by_name["gloo:all_gather"]
    assert ag["input_sizes"] == [[2, 4]] and ag["output_sizes"] == [[2, 2, 4]], ag
    assert ag["input_dtypes"] == ["Long"] and ag["output_dtypes"] == ["Long"], ag
    rs = by_name["gloo:reduce_scatter"]
    assert rs["input_sizes"] == [[2, 3]] and rs["output_sizes"] == [[3]], rs
    sends = [e for e in data["entries"] if e["is_p2p"]]
    if rank == 0:
        names = ["gloo:send 0->1", "gloo:recv 0<-1"]
    else:
        names = ["gloo:recv 1<-0", "gloo:send 1->0"]
    assert [e["profiling_name"] for e in sends] == names, sends
    assert [e["p2p_seq_id"] for e in sends] == [1, 2], sends
    assert {e["collective_seq_id"] for e in sends} == {5}, sends  # p2p does not count
    assert [e["input_dtypes"] for e in sends] == [["Double"], ["Double"]]
    assert data["pg_config"]["fr_states_rev"]["ranks"] == "[1, 0]", data["pg_config"]
    split_entry = by_name["gloo:split"]
    assert split_entry["process_group"][0] == "fr_states_rev", split_entry
    assert data["pg_status"]["fr_states"]["last_completed_collective"] == 5, data["pg_status"]
    assert data["pg_status"]["fr_states_rev"]["last_completed_collective"] == 2
    child.finalize()
    comm.finalize()
    return data


def test_states_fields_and_build_db_on_gloo() -> None:
    dumps = run_ranks(_states_and_fields, 2, timeout=120)
    details = {
        f"rank_{r}": {
            "rank": r,
            "host_name": f"h{r}",
            "entries": d["entries"],
            "version": d["version"],
            "pg_config": d["pg_config"],
        }
        for r, d in enumerate(dumps)
    }
    args = argparse.Namespace(
        verbose=False, just_print_entries=False, allow_incomplete_ranks=False, mismatch_cap=10
    )
    db = build_db(details, args, "2.10")
    names = [c.collective_name for c in db.collectives]
    assert all(c.pass_check for c in db.collectives), db.collectives
    assert names.count("gloo:all_reduce") == 3 and "gloo:all_gather" in names, names
    assert "gloo:split" in names and "gloo:reduce_scatter" in names, names
    assert {g.size for g in db.groups} == {2}, db.groups


# ----------------------------------------------------------------------------- automatic dumps


def _auto_dumps(ctx: RankContext) -> dict[str, Any]:
    """Timeout (sync and async), peer failure and abort dump to <prefix><rank>, path in error."""
    rank, store = ctx.rank, ctx.store
    out: dict[str, Any] = {}
    opts: dict[str, Any] = {"store": store, "abort_process_on_timeout_or_error": False}
    sync = new_comm("gloo", CPU, name="fr_to_sync", timeout=_fault_timeout(), **opts)
    asyn = new_comm("gloo", CPU, name="fr_to_async", timeout=_fault_timeout(), **opts)
    peer = new_comm("gloo", CPU, name="fr_peer", timeout=timedelta(seconds=300), **opts)
    for comm in (sync, asyn, peer):
        comm.all_reduce(torch.ones(2), ReduceOp.SUM, False, timeout=SETUP_TIMEOUT)
    prefix = os.environ["TORCHCOMM_FR_DUMP_TEMP_FILE"]
    path = f"{prefix}{rank}"
    if rank == 0:
        with pytest.raises(CommTimeoutError) as info:
            sync.all_reduce(torch.ones(8), ReduceOp.SUM, False)
        caught = time.time()
        out["sync_error"] = str(info.value)
        out["sync_mtime_lag"] = os.stat(path).st_mtime - caught
        with open(path, "rb") as f:
            out["sync_dump"] = pickle.load(f)
        os.remove(path)
        work = asyn.all_reduce(torch.ones(8), ReduceOp.SUM, True)
        with pytest.raises(CommTimeoutError) as info:
            work.wait()
        out["async_error"] = str(info.value)
        out["async_dumped"] = os.path.exists(path)
        os.remove(path)
        store.set("timeouts_done", "1")
        # Peer failure: rank 1 finalizes its end while rank 0 waits in a collective.
        with pytest.raises((PeerFailureError, CommTimeoutError)) as pinfo:
            peer.all_reduce(torch.ones(8), ReduceOp.SUM, False, timeout=_fault_timeout())
        out["peer_error"] = f"{type(pinfo.value).__name__}: {pinfo.value}"
        out["peer_dumped"] = os.path.exists(path)
        os.remove(path)
    else:
        store.wait(["timeouts_done"], timedelta(seconds=_scaled(90)))
        time.sleep(0.2)
        peer.finalize()
    # abort(): abort hooks (the recorder's dump) run before the backend's abort.
    sync.abort()
    out["abort_dumped"] = os.path.exists(path)
    store.set(f"abort_checked_{rank}", "1")
    store.wait([f"abort_checked_{r}" for r in range(2)], timedelta(seconds=_scaled(60)))
    sync.finalize()
    asyn.finalize()
    if rank == 0:
        peer.finalize()
    return out


def test_automatic_dumps_on_timeout_peer_failure_and_abort(tmp_path: Path) -> None:
    prefix = str(tmp_path / "auto_")
    env = {"TORCHCOMM_FR_DUMP_TEMP_FILE": prefix}
    r0, r1 = run_ranks(_auto_dumps, 2, timeout=120, env=env)
    path = f"{prefix}0"
    err = r0["sync_error"]
    assert "timed out" in err and f"[flight recorder dump: {path}]" in err, err
    assert r0["sync_mtime_lag"] <= 0.05, r0["sync_mtime_lag"]  # written before the raise
    dump = r0["sync_dump"]
    failed = [e for e in dump["entries"] if e["process_group"][0] == "fr_to_sync"][-1]
    assert failed["state"] == "completed" and failed["profiling_name"] == "gloo:all_reduce"
    assert failed["error"].startswith("CommTimeoutError: ") and "timed out" in failed["error"]
    assert dump["pg_status"]["fr_to_sync"]["last_enqueued_collective"] == 2, dump["pg_status"]
    assert f"[flight recorder dump: {path}]" in r0["async_error"], r0["async_error"]
    assert r0["async_dumped"]
    assert f"[flight recorder dump: {path}]" in r0["peer_error"], r0["peer_error"]
    assert r0["peer_error"].startswith("PeerFailureError: "), r0["peer_error"]
    assert r0["peer_dumped"]
    assert r0["abort_dumped"] and r1["abort_dumped"], (r0, r1)


# ----------------------------------------------------------------------------- torch's analyzer


def _skip_one(ctx: RankContext) -> dict[str, Any]:
    """Rank 2 skips the third all_reduce; 0 and 1 time out (auto-dump); 2 dumps on SIGUSR1."""
    rank, store = ctx.rank, ctx.store
    prefix = os.environ["TORCHCOMM_FR_DUMP_TEMP_FILE"]
    comm = new_comm(
        "gloo",
        CPU,
        name="job",
        store=store,
        timeout=timedelta(seconds=300),
        abort_process_on_timeout_or_error=False,
    )
    out: dict[str, Any] = {}
    for _ in range(2):
        t = torch.full((4,), rank + 1, dtype=torch.int64)
        comm.all_reduce(t, ReduceOp.SUM, False)
        assert torch.equal(t, torch.full((4,), 6, dtype=torch.int64)), t
    if rank < 2:
        with pytest.raises(CommTimeoutError) as info:
            comm.all_reduce(torch.ones(4), ReduceOp.SUM, False, timeout=_fault_timeout())
        out["error"] = str(info.value)
        store.set(f"timed_out_{rank}", "1")
    else:
        # SIGUSR1 while the main thread is blocked in C++ (a store wait): dumped within 1 s.
        sent: list[float] = []

        def poke() -> None:
            time.sleep(0.3)
            sent.append(time.time())
            os.kill(os.getpid(), signal.SIGUSR1)

        thread = threading.Thread(target=poke)
        thread.start()
        store.wait(["timed_out_0", "timed_out_1"], timedelta(seconds=_scaled(60)))
        thread.join()
        path = f"{prefix}{rank}"
        deadline = time.time() + 5
        while not os.path.exists(path) and time.time() < deadline:
            time.sleep(0.01)
        out["signal_lag"] = os.stat(path).st_mtime - sent[0]
    store.set(f"done_{rank}", "1")
    store.wait([f"done_{r}" for r in range(3)], timedelta(seconds=_scaled(60)))
    comm.finalize()
    return out


def test_unmodified_fr_trace_names_the_rank_that_skipped(tmp_path: Path) -> None:
    dump_dir = tmp_path / "dumps"
    dump_dir.mkdir()
    env = {
        "TORCHCOMM_FR_DUMP_TEMP_FILE": str(dump_dir / "rank_"),
        "TORCHCOMM_FR_DUMP_ON_SIGUSR1": "1",
    }
    results = run_ranks(_skip_one, 3, timeout=120, env=env, fresh=True)
    for r in (0, 1):
        assert f"[flight recorder dump: {dump_dir / f'rank_{r}'}]" in results[r]["error"]
    # The kernel stamps mtime from its coarse clock, up to a tick (4-10 ms) behind
    # time.time(): a dump written within that tick of the signal can look "earlier".
    assert -0.02 <= results[2]["signal_lag"] < 1.0, results[2]
    assert sorted(os.listdir(dump_dir)) == ["rank_0", "rank_1", "rank_2"]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(dump_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    assert "Not all ranks joining collective" in text, text
    assert "missing ranks: {2}" in text, text
    assert "collective: gloo:all_reduce" in text, text
    # Our own report over the same directory (its command line runs in test_fr_tool.py).
    from torchcomms.tools import fr as fr_tool

    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        code = fr_tool.main([str(dump_dir)])
    assert code == 1, report.getvalue()
    assert "rank 2 never entered all_reduce #3" in report.getvalue(), report.getvalue()
    assert "ranks 0-1 failed in all_reduce #3" in report.getvalue(), report.getvalue()


def test_recorder_is_on_by_default_in_every_comm() -> None:
    comm: TorchComm = new_comm("fake", CPU, name="fr_default")
    assert any(type(o).__name__ == "_Ring" for o in comm._observers), comm._observers
    assert torchcomms.hooks.FlightRecorderHook is FlightRecorderHook
    comm.finalize()


def test_python_stack_frames_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    comm = new_comm("fake", CPU, name="fr_frames")
    plain = FlightRecorderHook(isolated=True)
    monkeypatch.setenv("TORCHCOMM_FR_STACK", "1")
    with_stack = FlightRecorderHook(isolated=True)  # the variable is read at construction
    plain.register_with_comm(comm)
    with_stack.register_with_comm(comm)
    comm.barrier(False)
    assert json.loads(plain.dump_json())["entries"][0]["frames"] == []
    frames = json.loads(with_stack.dump_json())["entries"][0]["frames"]
    assert frames[0] == {
        "name": "test_python_stack_frames_opt_in",
        "filename": __file__,
        "line": frames[0]["line"],
    }, frames[:2]
    comm.finalize()


def _sigusr1_auto(ctx: RankContext, setup: str) -> tuple[str, float]:
    """One rank on a fresh worker: does the comm's recorder take SIGUSR1 (auto mode)?

    The harness registers ``faulthandler`` for SIGUSR1 in every worker: ``"faulthandler"``
    keeps it (the signal is taken), ``"plain"`` unregisters it first (nothing handles it)."""
    if setup == "plain":
        faulthandler.unregister(signal.SIGUSR1)
    comm = new_comm("gloo", CPU, name="sig", store=ctx.store)
    comm.all_reduce(torch.ones(4), ReduceOp.SUM, False)
    sent = time.time()
    os.kill(os.getpid(), signal.SIGUSR1)
    path = os.environ["TORCHCOMM_FR_DUMP_TEMP_FILE"] + "0"
    while not os.path.exists(path) and time.time() < sent + 1.5:  # the claim: within 1 s
        time.sleep(0.01)
    verdict = "dumped" if os.path.exists(path) else "not dumped"
    comm.finalize()
    return verdict, time.time() - sent


@pytest.mark.parametrize(
    ("setup", "expected"), [("plain", "dumped"), ("faulthandler", "not dumped")]
)
def test_sigusr1_dump_is_on_by_default_unless_the_signal_is_taken(
    tmp_path: Path, setup: str, expected: str
) -> None:
    """Unset TORCHCOMM_FR_DUMP_ON_SIGUSR1 means auto: take SIGUSR1 only if nothing handles it.

    On a fresh worker (``fresh=True``): the handler it installs must not outlive the test."""
    env = {
        "TORCHCOMM_FR_DUMP_ON_SIGUSR1": None,
        "TORCHCOMM_FR_DUMP_TEMP_FILE": str(tmp_path / "rank_"),
    }
    ((verdict, lag),) = run_ranks(_sigusr1_auto, 1, setup, timeout=60, env=env, fresh=True)
    assert verdict == expected, (verdict, lag)
    if expected == "dumped":
        assert lag < 1.0, lag  # "within 1 s"
