"""Store-less bootstrap under races: back-to-back and concurrent ``new_comm``, missing ranks.

Issue 12, item 6. Covers:

* size 1 in this process: comms made back to back from fresh short-lived threads, and many
  at once from concurrent threads, none failing, ``MASTER_PORT`` free afterwards;
* 2 ranks: the same, back to back (each from a fresh thread, each leaving a caught exception
  alive that references the comm) and concurrently (several threads per rank, each its own
  comm), every comm checked with an exact ``all_reduce``;
* a rank that never joins: the others fail within their timeout with ``CommTimeoutError``
  naming it (``rank 1 never joined``, ``.ranks``), not a raw ``DistStoreError``, and the
  kept exception pins no listening socket (``MASTER_PORT`` and the private store are closed),
  so the next ``new_comm`` on the same port works;
* rank 0 failing mid-connect (after the private store is up) while a member still has store
  waits ahead: the member raises ``CommError`` naming rank 0, not c10d's raw
  "Failed to recv, got 0 bytes" from the store that left with rank 0; and, if rank 0's
  process died there, ``PeerFailureError`` naming it;
* ``MASTER_PORT`` held by the local end of a connection (a port in the ephemeral range, as
  ``mp.spawn`` scripts pick them): rank 0 waits until the connection lets go and serves
  it, instead of joining a server that is not there; held for the whole timeout, rank 0
  says so.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch

from tests import harness
from tests.harness import RankContext, RankFailure, run_ranks
from torchcomms import ReduceOp, TorchComm, new_comm
from torchcomms.backends.cpu import select
from torchcomms.errors import CommError, CommTimeoutError

CPU = torch.device("cpu")
#: Generous: these tests assert that nothing fails, not that something is fast.
OK_TIMEOUT = timedelta(seconds=60)
#: How long a rank waits for a peer that never comes.
MISSING_TIMEOUT_S = 2.0


# ----------------------------------------------------------------------------- helpers


def _listening_ports(port: int) -> list[str]:
    """Local addresses (``ip:port``) of TCP sockets listening on ``port`` (any process)."""
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                local, state = fields[1], fields[3]
                hex_ip, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port and len(hex_ip) == width:
                    found.append(f"{hex_ip}:{port}")
    return found


def _in_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on a fresh short-lived thread; return its result or raise its exception."""
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out.get("value")


def _sum_check(comm: TorchComm, scale: int) -> None:
    n = comm.get_size()
    t = torch.full((8,), (comm.get_rank() + 1) * scale, dtype=torch.int64)
    comm.all_reduce(t, ReduceOp.SUM, False)
    expected = scale * n * (n + 1) // 2
    assert t.tolist() == [expected] * 8, f"{comm.get_name()}: {t.tolist()} != {expected}"


def _make_check_finalize(name: str, scale: int, kept: list[BaseException]) -> None:
    """One comm's whole life; leaves a caught exception that references the comm in ``kept``."""
    comm = new_comm("gloo", CPU, name=name, timeout=OK_TIMEOUT)
    _sum_check(comm, scale)
    try:
        raise RuntimeError(f"kept alive with {comm.get_name()} in its frame")
    except RuntimeError as exc:
        kept.append(exc)
    comm.finalize()


def _concurrently(names: list[str]) -> dict[str, str]:
    """Create, check and finalize one comm per name, each on its own thread, all at once."""
    errors: dict[str, str] = {}
    start = threading.Barrier(len(names))

    def body(k: int, name: str) -> None:
        try:
            start.wait()
            _make_check_finalize(name, k + 1, [])
        except BaseException as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=body, args=(k, n)) for k, n in enumerate(names)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


# ----------------------------------------------------------------------------- size 1


def test_size_one_back_to_back_and_concurrent_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    port = harness.free_port()
    for var, value in {
        "TORCHCOMM_RANK": "0",
        "TORCHCOMM_SIZE": "1",
        "MASTER_ADDR": harness.MASTER_ADDR,
        "MASTER_PORT": str(port),
    }.items():
        monkeypatch.setenv(var, value)
    kept: list[BaseException] = []
    failures = []
    for i in range(30):
        try:
            _in_thread(lambda i=i: _make_check_finalize(f"solo{i}", i + 1, kept))
        except Exception as exc:
            failures.append(f"solo{i}: {type(exc).__name__}: {exc}")
    assert failures == []
    assert _concurrently([f"solo_conc{k}" for k in range(8)]) == {}
    assert _listening_ports(port) == [], "MASTER_PORT still served after finalize"


# ----------------------------------------------------------------------------- 2 ranks


def _race_cases(ctx: RankContext) -> None:
    kept: list[BaseException] = []
    for i in range(12):
        # Fresh thread per comm, nothing between two comms: the next bootstrap starts while
        # the peer may still be finishing the last one.
        _in_thread(lambda i=i: _make_check_finalize(f"b2b{i}", i + 1, kept))
    errors = _concurrently([f"conc{k}" for k in range(4)])
    assert errors == {}, errors
    # Nobody serves MASTER_PORT once every rank is past its last init.
    ctx.store.set(f"done/{ctx.rank}", "1")
    ctx.store.wait([f"done/{r}" for r in range(ctx.world_size)])
    assert _listening_ports(ctx.master_port) == [], "MASTER_PORT still served"


def test_back_to_back_and_concurrent_new_comm_on_two_ranks() -> None:
    run_ranks(_race_cases, 2, timeout=120)


def _own_listeners() -> set[int]:
    """Inodes of this process's listening TCP sockets."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[3] == "0A" and int(fields[9]) in inodes:
                    listening.add(int(fields[9]))
    return listening


def _missing_rank_cases(ctx: RankContext) -> dict[str, Any]:
    """Rank 1 skips one comm, then rank 0 skips one; both keep their exception alive."""
    store, rank = ctx.store, ctx.rank
    short = timedelta(seconds=MISSING_TIMEOUT_S)
    out: dict[str, Any] = {}
    before = _own_listeners()
    kept: list[BaseException] = []
    absent = {"no_rank1": 1, "no_rank0": 0}
    for name, missing in absent.items():
        if rank == missing:
            store.wait([f"{name}/failed"], timedelta(seconds=60))
            continue
        start = time.monotonic()
        with pytest.raises(CommTimeoutError) as info:
            new_comm("gloo", CPU, name=name, timeout=short)
        out[name] = {
            "elapsed": time.monotonic() - start,
            "message": str(info.value),
            "ranks": info.value.ranks,
        }
        kept.append(info.value)  # with its traceback: must not keep a server alive
        out[f"{name}_port_free"] = _listening_ports(ctx.master_port) == []
        out[f"{name}_leaked"] = sorted(_own_listeners() - before)
        store.set(f"{name}/failed", "1")
    # The same port works right away for the next comm, with those exceptions still alive.
    comm = new_comm("gloo", CPU, name="after", timeout=OK_TIMEOUT)
    _sum_check(comm, 3)
    comm.finalize()
    assert len(kept) == 1
    return out


def test_missing_rank_is_named_and_pins_no_port() -> None:
    results = run_ranks(_missing_rank_cases, 2, timeout=60)
    r0, r1 = results[0]["no_rank1"], results[1]["no_rank0"]
    assert "rank 1 never joined within 2 s" in r0["message"], r0["message"]
    assert r0["message"].startswith("[comm=no_rank1 rank=0] new_comm bootstrap: ")
    assert r0["ranks"] == (1,)
    assert "could not connect to the store at 127.0.0.1:" in r1["message"], r1["message"]
    assert "(rank 0) within 2 s" in r1["message"], r1["message"]
    assert r1["ranks"] == (0,)
    for result in (r0, r1):
        # Within the timeout (plus one 5 s resolver stall c10d's connect logging may hit).
        assert MISSING_TIMEOUT_S * 0.9 <= result["elapsed"] < MISSING_TIMEOUT_S + 6.0, result
    assert results[0]["no_rank1_port_free"], "MASTER_PORT still served by the failed init"
    assert results[0]["no_rank1_leaked"] == [], "the failed init left a listening socket"
    assert results[1]["no_rank0_leaked"] == []


def _rank0_leaves_mid_connect(ctx: RankContext) -> dict[str, Any]:
    """Rank 0 refuses its transport (forced shm across two host identities) while rank 1,
    held back one second before its transport step, still has the connect's store waits
    ahead of it: rank 0's private store goes away with its failed ``new_comm``."""
    os.environ["TORCHCOMM_HOST_ID"] = f"simulated-host-{ctx.rank}"
    hints = {"transport": "shm"} if ctx.rank == 0 else {}
    if ctx.rank == 1:
        opened = select.open_ops

        def late(*args: Any, **kwargs: Any) -> Any:
            time.sleep(1.0)
            return opened(*args, **kwargs)

        select.open_ops = late  # type: ignore[assignment]
    start = time.monotonic()
    try:
        with pytest.raises(Exception) as info:
            new_comm("gloo", CPU, name="leaves", store=ctx.store, timeout=OK_TIMEOUT, hints=hints)
    finally:
        if ctx.rank == 1:  # the worker runs other tests next: every connect would wait 1 s
            select.open_ops = opened  # type: ignore[assignment]
    error = info.value
    return {
        "type": type(error).__name__,
        "is_comm_error": isinstance(error, CommError),
        "message": str(error),
        "ranks": getattr(error, "ranks", None),
        "elapsed": time.monotonic() - start,
    }


def test_rank0_failing_mid_connect_is_named_by_a_member_still_connecting() -> None:
    r0, r1 = run_ranks(_rank0_leaves_mid_connect, 2, timeout=60)
    assert r0["is_comm_error"] and "shm" in r0["message"], r0
    # Not c10d's "Failed to recv, got 0 bytes ..." from the vanished store: rank 0 named.
    assert r1["is_comm_error"], r1
    assert r1["message"].startswith("[TorchCommGloo comm=leaves rank=1] new_comm: "), r1
    assert "rank 0" in r1["message"], r1
    assert r1["ranks"] == (0,), r1
    assert r1["elapsed"] < 10.0, r1  # well inside the 60 s timeout


def _rank0_dies_mid_connect(ctx: RankContext) -> None:
    """Rank 0 SIGKILLs itself where it would open its transport, once rank 1 got there
    too (so both know each other's pid), while rank 1, held back one second, still has
    store waits ahead.  (Dying earlier, while rank 1 still reads the identities, rank 0
    cannot be told dead from gone: that is the ``CommError`` case above.)"""
    opened = select.open_ops

    def step(*args: Any, **kwargs: Any) -> Any:
        if ctx.rank == 0:
            ctx.store.wait(["dies/rank1_at_transport"])  # the harness's store, not the comm's
            os.kill(os.getpid(), signal.SIGKILL)
        ctx.store.set("dies/rank1_at_transport", "1")
        time.sleep(1.0)
        return opened(*args, **kwargs)

    select.open_ops = step  # type: ignore[assignment]
    new_comm("gloo", CPU, name="dies", store=ctx.store, timeout=OK_TIMEOUT)
    raise AssertionError("new_comm returned with rank 0 dead")


def test_rank0_dying_mid_connect_is_named_dead_by_a_member_still_connecting() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_rank0_dies_mid_connect, 2, timeout=60, fresh=True)
    failure = info.value
    assert set(failure.died) == {0} and "SIGKILL" in failure.died[0], str(failure)
    assert not failure.timed_out, str(failure)
    error = failure.errors.get(1, "")
    # rank 0 served the comm's store: its death shows first as a closed store connection,
    # which the member turns into the death of rank 0 (its pid is gone), not c10d's text.
    assert "PeerFailureError: [TorchCommGloo comm=dies rank=1] new_comm: peer rank 0 died" in (
        error
    ), error
    assert "DistNetworkError" not in error.splitlines()[-1], error
    assert time.monotonic() - start < 30.0, str(failure)  # well inside the 60 s timeout


def _hold_master_port(ctx: RankContext, hold_s: float) -> socket.socket:
    """A connection whose local end is ``MASTER_PORT`` (no ``SO_REUSEADDR``, as a port
    the kernel picks for a connect), closed after ``hold_s`` seconds."""
    server = socket.create_server((harness.MASTER_ADDR, 0))
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind((harness.MASTER_ADDR, ctx.master_port))
    holder.connect(server.getsockname())
    peer, _ = server.accept()

    def release() -> None:
        # The far end closes first: a local end that closed first would keep the port in
        # TIME_WAIT for a minute (the kernel refuses to bind it over a socket made without
        # SO_REUSEADDR), longer than this test waits.
        peer.close()
        server.close()
        time.sleep(0.05)
        holder.close()

    threading.Timer(hold_s, release).start()
    return holder


def _master_port_held(ctx: RankContext, hold_s: float, timeout_s: float) -> dict[str, Any]:
    if ctx.rank == 0:
        _hold_master_port(ctx, hold_s)
    ctx.store.set(f"held/{hold_s}/{ctx.rank}", "1")
    ctx.store.wait([f"held/{hold_s}/{r}" for r in range(ctx.world_size)])
    start = time.monotonic()
    try:
        comm = new_comm("gloo", CPU, name=f"held{hold_s}", timeout=timedelta(seconds=timeout_s))
    except CommError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    _sum_check(comm, 1)
    comm.finalize()
    return {"elapsed": time.monotonic() - start}


def test_master_port_held_by_a_connection_is_served_once_free() -> None:
    results = run_ranks(_master_port_held, 2, 1.5, 30.0, timeout=60)
    assert all("elapsed" in r for r in results), results
    assert results[0]["elapsed"] >= 1.3, results  # it waited for the port, then served it


def test_master_port_held_for_the_whole_timeout_is_named() -> None:
    results = run_ranks(_master_port_held, 2, 5.0, 2.0, timeout=60)
    r0, r1 = results
    assert r0["error"] == "CommTimeoutError", r0
    assert "stayed in use for 2 s with nothing listening on it" in r0["message"], r0
    assert r1["error"] == "CommTimeoutError" and "(rank 0)" in r1["message"], r1
