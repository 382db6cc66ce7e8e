"""One-sided windows on the CPU backend (issue 14): put, get, signal, wait_signal.

Placements, each on real processes: ``shm`` (every rank on this host: peers are mapped,
``UNIFIED``), ``tcp`` (``transport=tcp``: every peer through the window server,
``SEPARATE``) and ``mixed`` (``TORCHCOMM_HOST_ID`` simulates two hosts of two ranks: shm
to the same-host peer, TCP to the others).  Covered:

* upstream's canonical ring (put + signal + wait_signal, then read the received slice
  through ``map_remote_tensor``, ``get_tensor`` and the registered tensor itself), and
  writes through a mapped peer window;
* a parameter-server pull with ``get`` (the server is blocked in ``wait_signal`` while
  it is served), many puts to one target, async ops interleaved with collectives;
* ``get_attr``, sizes, properties, copy / deepcopy, re-registration;
* every error path (typed, with its message) with the comm and the window usable after;
* a peer SIGKILLed while others wait for its signal: ``PeerFailureError`` naming it,
  through pid liveness (same host) and the window server's lost connection (other host).
"""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import shared_jobs
from tests.harness import RankContext, RankFailure, run_ranks
from torchcomms import (
    CommStateError,
    CommTimeoutError,
    CommValidationError,
    OpName,
    ReduceOp,
    TorchComm,
    TorchCommWinAccessType,
    TorchCommWindow,
    new_comm,
)
from torchcomms._comms import NewWindowPreHookArgs
from torchcomms.transport.window import tcp as window_tcp
from torchcomms.transport.window.memory import WindowMemory
from torchcomms.transport.window.tcp import WindowServer

CPU = torch.device("cpu")
UNIFIED = TorchCommWinAccessType.WIN_ACCESS_TYPE_UNIFIED
SEPARATE = TorchCommWinAccessType.WIN_ACCESS_TYPE_SEPARATE

#: placement -> (world size, host of each rank or None, hints)
PLACEMENTS: dict[str, tuple[int, tuple[str, ...] | None, dict[str, str]]] = {
    "shm": (4, None, {}),
    "tcp": (3, None, {"transport": "tcp"}),
    "mixed": (4, ("h0", "h0", "h1", "h1"), {}),
}


def make_comm(
    ctx: RankContext,
    name: str,
    hosts: tuple[str, ...] | None,
    hints: dict[str, str],
    timeout_s: float = 60,
) -> TorchComm:
    saved = os.environ.get("TORCHCOMM_HOST_ID")
    if hosts is not None:
        os.environ["TORCHCOMM_HOST_ID"] = hosts[ctx.rank]
    try:
        return new_comm(
            "gloo",
            CPU,
            name=name,
            store=ctx.store,
            hints=hints,
            timeout=timedelta(seconds=timeout_s),
        )
    finally:
        if saved is None:
            os.environ.pop("TORCHCOMM_HOST_ID", None)
        else:
            os.environ["TORCHCOMM_HOST_ID"] = saved


def same_host(hosts: tuple[str, ...] | None, hints: dict[str, str], a: int, b: int) -> bool:
    if hints.get("transport") == "tcp":
        return a == b
    return hosts is None or hosts[a] == hosts[b]


# ------------------------------------------------------------------------------ scenarios
def _patterns(ctx: RankContext, placement: str) -> dict[str, Any]:
    n, hosts, hints = PLACEMENTS[placement]
    comm = make_comm(ctx, f"win_{placement}", hosts, hints)
    r = comm.get_rank()
    count = 5
    seen: dict[str, Any] = {"transport": comm.get_backend_impl().transport}  # type: ignore[attr-defined]

    # -- upstream's canonical ring ---------------------------------------------------------
    buf = torch.zeros(n * count + n, dtype=torch.float32)
    win = comm.new_window(buf)
    assert isinstance(win, TorchCommWindow)
    assert win.get_size() == buf.numel() * 4 and win.dtype == torch.float32
    assert win.shape == (n * count + n,) and win.device == CPU
    assert win.get_tensor() is buf
    for p in range(n):
        want = UNIFIED if same_host(hosts, hints, r, p) else SEPARATE
        assert win.get_attr(p).access_type == want, (p, win.get_attr(p))
    comm.barrier(False)
    dst, src = (r + 1) % n, (r - 1) % n
    win.put(torch.full((count,), float(r)), dst, dst * count, False)
    win.signal(dst, False)
    win.wait_signal(src, False)
    mine = win.map_remote_tensor(r)
    assert mine.shape == buf.shape and mine.dtype == buf.dtype
    expect = torch.full((count,), float(src))
    assert torch.equal(mine[r * count : (r + 1) * count], expect)
    assert torch.equal(buf[r * count : (r + 1) * count], expect)  # the tensor is the window
    assert torch.equal(win.get_tensor()[r * count : (r + 1) * count], expect)
    # Writes through a mapped same-host peer window land in the peer's tensor.
    for p in range(n):
        if p != r and win.get_attr(p).access_type == UNIFIED:
            win.map_remote_tensor(p)[n * count + r] = 100.0 + r
    comm.barrier(False)
    for p in range(n):
        if p != r and same_host(hosts, hints, r, p):
            assert buf[n * count + p].item() == 100.0 + p
        elif p != r:
            assert buf[n * count + p].item() == 0.0
    win.tensor_deregister()
    assert win.get_size() == 0 and win.get_tensor() is None and win.dtype is None
    # After deregistration the tensor is private again and keeps the final values.
    assert torch.equal(buf[r * count : (r + 1) * count], expect)

    # -- parameter-server pull with get (the server waits in wait_signal meanwhile) ---------
    params = torch.arange(1000, dtype=torch.float64) * (10 if r == 0 else 0)
    pwin = comm.new_window()
    pwin.tensor_register(params)
    comm.barrier(False)
    if r == 0:
        for p in range(1, n):
            pwin.wait_signal(p, False)  # each reader signals once it has pulled
    else:
        pulled = torch.empty(1000, dtype=torch.float64)
        work = pwin.get(pulled, 0, 0, True)
        work.wait()
        assert torch.equal(pulled, torch.arange(1000, dtype=torch.float64) * 10)
        part = torch.empty(10, dtype=torch.float64)
        pwin.get(part, 0, 990, False)
        assert torch.equal(part, torch.arange(990, 1000, dtype=torch.float64) * 10)
        pwin.signal(0, False)
    comm.barrier(False)  # every reader pulled before the puts below overwrite the params

    # -- many puts to one target, then one signal each ----------------------------------------
    k = 25
    if r != 0:
        works = [
            pwin.put(
                torch.full((2,), float(r * 1000 + i), dtype=torch.float64), 0, (r * k + i) * 2, True
            )
            for i in range(k)
        ]
        works.append(pwin.signal(0, True))
        for w in works:
            w.wait()
    else:
        for p in range(1, n):
            pwin.wait_signal(p, False)
        for p in range(1, n):
            for i in range(k):
                got = params[(p * k + i) * 2 : (p * k + i) * 2 + 2]
                assert torch.equal(got, torch.full((2,), float(p * 1000 + i), dtype=torch.float64))
    comm.barrier(False)

    # -- async ops interleaved with collectives on the same comm ----------------------------
    iwin = comm.new_window(torch.zeros(n * 3, dtype=torch.int64))
    comm.barrier(False)
    w_put = iwin.put(torch.full((3,), r + 1, dtype=torch.int64), dst, r * 3, True)
    t = torch.full((4,), r, dtype=torch.int64)
    w_ar = comm.all_reduce(t, ReduceOp.SUM, True)
    w_sig = iwin.signal(dst, True)
    w_wait = iwin.wait_signal(src, True)
    t2 = torch.ones(2, dtype=torch.int64)
    comm.all_reduce(t2, ReduceOp.SUM, False)
    for w in (w_put, w_ar, w_sig, w_wait):
        w.wait()
    assert torch.equal(t, torch.full((4,), n * (n - 1) // 2, dtype=torch.int64))
    assert torch.equal(t2, torch.full((2,), n, dtype=torch.int64))
    got = iwin.get_tensor()
    assert got is not None
    assert torch.equal(got[src * 3 : src * 3 + 3], torch.full((3,), src + 1, dtype=torch.int64))

    # -- copy / deepcopy -----------------------------------------------------------------------
    assert copy.copy(iwin) is iwin
    twin = copy.deepcopy(iwin)  # collective: a new window with a clone of the tensor
    assert twin is not iwin and twin.get_tensor() is not None
    assert torch.equal(twin.get_tensor(), got)  # type: ignore[arg-type]
    assert twin.get_tensor().data_ptr() != got.data_ptr()  # type: ignore[union-attr]
    comm.barrier(False)
    twin.put(torch.full((1,), -7, dtype=torch.int64), dst, 0, False)
    twin.signal(dst, False)
    twin.wait_signal(src, False)
    assert twin.get_tensor()[0].item() == -7 and got[0].item() != -7  # type: ignore[index]

    for w in (twin, iwin, pwin):
        w.tensor_deregister()
    # Re-registration of a deregistered window works.
    iwin.tensor_register(torch.full((2,), float(r)))
    comm.barrier(False)
    back = torch.empty(2)
    iwin.get(back, src, 0, False)
    assert torch.equal(back, torch.full((2,), float(src)))
    iwin.tensor_deregister()
    comm.finalize()
    return seen


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_window_patterns(placement: str) -> None:
    n = PLACEMENTS[placement][0]
    seen = run_ranks(_patterns, n, placement, timeout=120)
    kind = {"shm": "shm", "tcp": "tcp", "mixed": "hierarchical"}[placement]
    assert all(s["transport"].startswith(kind) for s in seen), seen


def _errors(ctx: RankContext, placement: str) -> None:
    hosts = ("h0", "h1") if placement == "hosts" else None
    comm = make_comm(ctx, f"win_err_{placement}", hosts, {})
    r, peer = ctx.rank, 1 - ctx.rank
    prefix = f"comm=win_err_{placement} rank={r}]"
    calls: list[Any] = []
    pre = comm.register_pre_hook(lambda name, op_id, args: calls.append((name, op_id, args)))
    post = comm.register_post_hook(lambda op_id, args: calls.append(("post", op_id, args)))
    win = comm.new_window()
    pre.remove()
    post.remove()
    assert [c[0] for c in calls] == [OpName.new_window, "post"] and calls[0][1] == calls[1][1]
    assert isinstance(calls[0][2], NewWindowPreHookArgs) and calls[1][2].window is win
    for call in (
        lambda: win.put(torch.ones(2), peer, 0, False),
        lambda: win.get(torch.ones(2), peer, 0, False),
        lambda: win.signal(peer, False),
        lambda: win.wait_signal(peer, False),
        lambda: win.map_remote_tensor(r),
        win.tensor_deregister,
    ):
        with pytest.raises(CommStateError, match="no tensor is registered with this window"):
            call()
    buf = torch.zeros(8, dtype=torch.float32)
    win.tensor_register(buf)
    with pytest.raises(CommStateError, match=r"already registered .*tensor_deregister\(\) first"):
        win.tensor_register(torch.zeros(3))
    with pytest.raises(
        CommValidationError,
        match=r"put: elements \[6, 9\) are out of bounds of "
        r"rank \d's window of 8 elements",
    ):
        win.put(torch.ones(3), peer, 6, False)
    with pytest.raises(CommValidationError, match=r"out of bounds"):
        win.put(torch.ones(1), peer, -1, False)
    with pytest.raises(CommValidationError, match=r"get: elements \[0, 9\) are out of bounds"):
        win.get(torch.ones(9), peer, 0, False)
    with pytest.raises(
        CommValidationError,
        match=r"tensor dtype torch.int32 does not match rank "
        r"\d's window dtype torch.float32",
    ):
        win.put(torch.ones(2, dtype=torch.int32), peer, 0, False)
    with pytest.raises(CommValidationError, match=r"dst_rank must be in range \[0, 2\), but got 5"):
        win.put(torch.ones(2), 5, 0, False)
    with pytest.raises(CommValidationError, match="must be contiguous"):
        win.put(torch.ones(4, 2).t(), peer, 0, False)
    with pytest.raises(TypeError, match="offset must be an int"):
        win.put(torch.ones(2), peer, 1.5, False)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="get_device_window is not yet supported"):
        win.get_device_window()
    if placement == "hosts":
        with pytest.raises(CommValidationError, match="access type SEPARATE"):
            win.map_remote_tensor(peer)
    # A timeout names the peer; the comm and the window stay usable.
    start = time.monotonic()
    with pytest.raises(CommTimeoutError) as info:
        win.wait_signal(peer, False, timeout=timedelta(milliseconds=300))
    assert time.monotonic() - start < 10
    assert prefix in str(info.value) and f"waiting for peer rank {peer} to signal" in str(
        info.value
    ), str(info.value)
    assert info.value.ranks == (peer,)
    t = torch.ones(3)
    comm.all_reduce(t, ReduceOp.SUM, False)
    assert torch.equal(t, torch.full((3,), 2.0))
    # Deregistration while an async op is pending is refused; fine once it finished.
    if r == 0:
        work = win.wait_signal(1, True)
        with pytest.raises(
            CommStateError,
            match=r"1 async window op\(s\) of this rank are still "
            r"pending; wait\(\) for them",
        ):
            win.tensor_deregister()
        ctx.store.set("go", "1")
        work.wait()
    else:
        ctx.store.wait(["go"], timedelta(seconds=30))
        win.signal(0, False)
    win.put(torch.full((2,), 3.0), peer, 2 * r, False)
    win.signal(peer, False)
    win.wait_signal(peer, False)
    assert torch.equal(buf[2 * peer : 2 * peer + 2], torch.full((2,), 3.0))
    win.tensor_deregister()
    comm.finalize()


@pytest.mark.parametrize("placement", ["shm", "hosts"])
def test_window_errors(placement: str) -> None:
    run_ranks(_errors, 2, placement, timeout=120)


def _peer_killed(ctx: RankContext, report_dir: str) -> None:
    """Rank 2 dies after registering; ranks 0 and 1 wait for its signal and must name it.

    Hosts h0 h1 h0: rank 0 shares a host with rank 2 (pid liveness), rank 1 does not (the
    window server sees the connection end without a goodbye).
    """
    comm = make_comm(ctx, "win_kill", ("h0", "h1", "h0"), {})
    r = ctx.rank
    win = comm.new_window(torch.zeros(4))
    comm.barrier(False)
    if r == 2:
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    seen: dict[str, Any] = {}
    try:
        win.wait_signal(2, False, timeout=timedelta(seconds=60))
    except Exception as exc:
        seen = {
            "type": type(exc).__name__,
            "text": str(exc),
            "ranks": list(getattr(exc, "dead_ranks", ())),
            "s": time.monotonic() - start,
        }
    # The window still works between the survivors.
    other = 1 - r
    win.put(torch.full((1,), 5.0 + r), other, r, False)
    win.signal(other, False)
    win.wait_signal(other, False)
    seen["after"] = win.get_tensor()[other].item()  # type: ignore[index]
    Path(report_dir, f"rank{r}.json").write_text(json.dumps(seen))
    comm.abort()  # the survivors' worker stays in the harness's pool: leave nothing running
    comm.finalize()


def test_peer_killed_during_wait_signal_is_named(tmp_path: Path) -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(_peer_killed, 3, str(tmp_path), timeout=120)
    failure = info.value
    assert 2 in failure.died and "SIGKILL" in failure.died[2], str(failure)
    assert not failure.timed_out and not failure.errors, str(failure)
    for r in (0, 1):
        seen = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert seen["type"] == "PeerFailureError", seen
        assert "peer rank 2 died (process gone)" in seen["text"], seen
        assert seen["ranks"] == [2] and seen["s"] < 10, seen
        assert seen["after"] == 5.0 + (1 - r), seen


def test_weight_sync_example_runs_under_torchrun() -> None:
    """Runs last in the shared 4-rank job (``tests/shared_jobs.py``): 1 trainer, 3 readers."""
    proc, _ = shared_jobs.torchrun_scripts_4()
    assert proc.returncode == 0, proc.stdout
    assert "window_weight_sync OK: 3 readers hold the trainer's weights after 5 steps" in (
        proc.stdout
    ), proc.stdout


def _bench_cases(ctx: RankContext) -> list[str]:
    """The bench's put/get cases: correct output -> #wrong 0; corrupted -> seen."""
    from torchcomms.bench import cases as ops

    comm = new_comm("gloo", CPU, name="win_bench_check", store=ctx.store)
    seen = []
    for spec in ops.resolve(["put", "get"]):
        for dtype in (torch.float32, torch.int64):
            case = spec.build(ops.CaseParams(ctx.rank, ctx.world_size, 33, dtype, "sum", 0, False))
            for _ in range(2):
                case.reset()
                case.ours(comm)
                assert case.wrong() == 0, (spec.name, dtype)
            if spec.checked_rank(ctx.world_size, 0) == ctx.rank:
                case.corrupt()
                assert case.wrong() == 1, (spec.name, dtype)
            seen.append(f"{spec.name} {dtype}")
    comm.barrier(False)
    comm.finalize()
    return seen


def test_bench_window_cases_check_their_output() -> None:
    results = run_ranks(_bench_cases, 3, timeout=120)
    assert results[0] == results[2] and len(results[0]) == 4


def test_window_server_keeps_frames_that_arrive_with_the_hello() -> None:
    """A peer's first frames may sit behind its hello in the socket buffer (its put can
    follow the registration before the server thread accepted): none may be lost."""
    mem = WindowMemory.create(2, 16, shared=False)
    server = WindowServer(0, "127.0.0.1", "hello_test")
    try:
        server.add(7, mem.data, mem.signals)
        payload = bytes(range(1, 17))
        hello = f"WIN {server.token} 1\n".encode()
        frames = window_tcp._HEAD.pack(window_tcp.PUT, 7, 0, 16) + payload
        frames += window_tcp._HEAD.pack(window_tcp.SIGNAL, 7, 0, 0)
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(hello + frames)  # one segment: hello and frames arrive together
            give_up = time.monotonic() + 10
            while mem.signals.count(1) < 1 and time.monotonic() < give_up:
                time.sleep(0.001)
            assert mem.signals.count(1) == 1
            assert bytes(mem.data.numpy()) == payload
            assert server.dead == frozenset()
    finally:
        server.close()
        mem.release()
