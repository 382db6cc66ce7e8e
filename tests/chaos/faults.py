"""Fault trials run on real ranks: each records what every rank saw, for the tests to judge.

A trial returns (or writes, when a rank is killed) one ``Outcome`` per call: the error
type and text, how long it took, and whether the data came back right.  Integer-valued
data with a bit-exact oracle: an op that "succeeded" with a wrong value is recorded as
``wrong``, never as a pass.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from tests.harness import RankContext
from torchcomms import ReduceOp, TorchComm, new_comm

CPU = torch.device("cpu")


def comm_for(ctx: RankContext, name: str, transport: str, timeout_s: float = 30.0) -> TorchComm:
    return new_comm(
        "gloo",
        CPU,
        name=name,
        store=ctx.store,
        timeout=timedelta(seconds=timeout_s),
        hints={"transport": transport},
    )


def outcome(call: Callable[[], object], check: Callable[[], bool] | None = None) -> dict[str, Any]:
    """Run ``call``; record the error (type, text, seconds) or whether the result is right."""
    start = time.monotonic()
    try:
        call()
    except Exception as exc:
        return {"type": type(exc).__name__, "text": str(exc), "s": time.monotonic() - start}
    right = True if check is None else bool(check())
    return {"type": None, "text": "returned", "s": time.monotonic() - start, "wrong": not right}


# -- mismatched arguments and skipped ops --------------------------------------------------
def _mismatch_cases(me: int, world: int) -> dict[str, Callable[[TorchComm], dict[str, Any]]]:
    """Rank 1 differs in one field; the other ranks agree."""
    odd = me == 1

    def all_reduce_numel(c: TorchComm) -> dict[str, Any]:
        t = torch.full((8 if odd else 4,), me + 1, dtype=torch.int64)
        before = t.clone()
        o = outcome(lambda: c.all_reduce(t, ReduceOp.SUM, False))
        o["unchanged"] = torch.equal(t, before)
        return o

    def all_reduce_large_numel(c: TorchComm) -> dict[str, Any]:
        # 256 KiB vs 128 KiB: past the tcp path's inline limit on both sides (gloo's call).
        t = torch.full((32768 if odd else 16384,), me + 1, dtype=torch.int64)
        return outcome(lambda: c.all_reduce(t, ReduceOp.SUM, False))

    def inline_vs_not(c: TorchComm) -> dict[str, Any]:
        # 128 KiB vs 16 KiB: one side's data would ride in the tcp header, the other's not.
        t = torch.full((16384 if odd else 2048,), me + 1, dtype=torch.int64)
        return outcome(lambda: c.all_reduce(t, ReduceOp.SUM, False))

    def dtype(c: TorchComm) -> dict[str, Any]:
        t = torch.ones(4, dtype=torch.int32 if odd else torch.int64)
        return outcome(lambda: c.all_reduce(t, ReduceOp.SUM, False))

    def reduce_op(c: TorchComm) -> dict[str, Any]:
        t = torch.full((4,), me + 1, dtype=torch.int64)
        before = t.clone()
        o = outcome(lambda: c.all_reduce(t, ReduceOp.MAX if odd else ReduceOp.SUM, False))
        o["unchanged"] = torch.equal(t, before)
        return o

    def root(c: TorchComm) -> dict[str, Any]:
        t = torch.full((4,), me, dtype=torch.int64)
        return outcome(lambda: c.broadcast(t, 1 if odd else 0, False))

    def ring_vs_inline(c: TorchComm) -> dict[str, Any]:
        # 1 MiB (a ring op, its frame larger than a header row) against 16 KiB (inline).
        t = torch.full((131072 if odd else 2048,), me + 1, dtype=torch.int64)
        before = t.clone()
        o = outcome(lambda: c.all_reduce(t, ReduceOp.SUM, False))
        o["unchanged"] = torch.equal(t, before)
        return o

    def large_root(c: TorchComm) -> dict[str, Any]:
        # 1 MiB: the tcp path's broadcast chain (``cpu.tcp.ring_ops``); rank 1 says it is root.
        t = torch.full((131072,), me, dtype=torch.int64)
        return outcome(lambda: c.broadcast(t, 1 if odd else 0, False))

    def large_op_kind(c: TorchComm) -> dict[str, Any]:
        # 1 MiB ring all_reduce against a ring all_gather: frames of another shape.
        t = torch.ones(131072, dtype=torch.int64)
        if odd:
            out = torch.zeros(131072 * world, dtype=torch.int64)
            return outcome(lambda: c.all_gather_single(out, t, False))
        before = t.clone()
        o = outcome(lambda: c.all_reduce(t, ReduceOp.SUM, False))
        o["unchanged"] = torch.equal(t, before)
        return o

    def op_kind(c: TorchComm) -> dict[str, Any]:
        t = torch.ones(4, dtype=torch.int64)
        if odd:
            out = torch.zeros(4 * world, dtype=torch.int64)
            return outcome(lambda: c.all_gather_single(out, t, False))
        return outcome(lambda: c.all_reduce(t, ReduceOp.SUM, False))

    def skipped(c: TorchComm) -> dict[str, Any]:
        """Rank 1 skips an all_reduce and goes on to the broadcast the others do next."""
        t = torch.ones(4, dtype=torch.int64)
        if not odd:
            o = outcome(lambda: c.all_reduce(t, ReduceOp.SUM, False))
            if o["type"] is not None:
                return o
        return outcome(lambda: c.broadcast(t, 0, False))

    def empty_vs_full(c: TorchComm) -> dict[str, Any]:
        t = torch.ones(0 if odd else 4, dtype=torch.int64)
        return outcome(lambda: c.all_reduce(t, ReduceOp.SUM, False))

    return {
        "all_reduce_numel": all_reduce_numel,
        "all_reduce_large_numel": all_reduce_large_numel,
        "inline_vs_not": inline_vs_not,
        "dtype": dtype,
        "reduce_op": reduce_op,
        "root": root,
        "op_kind": op_kind,
        "ring_vs_inline": ring_vs_inline,
        "large_root": large_root,
        "large_op_kind": large_op_kind,
        "skipped": skipped,
        "empty_vs_full": empty_vs_full,
    }


#: The field each mismatch case must name.
MISMATCH_FIELDS = {
    "all_reduce_numel": "count=",
    "all_reduce_large_numel": "count=",
    "inline_vs_not": "count=",
    "dtype": "dtype=",
    "reduce_op": "reduce_op=",
    "root": "root=",
    "op_kind": "op=",
    "ring_vs_inline": "count=",
    "large_root": "root=",
    "large_op_kind": "op=",
    "skipped": "op=",
    "empty_vs_full": "count=",
}


def mismatches(ctx: RankContext, transport: str) -> dict[str, Any]:
    """Every mismatch case on a fresh comm; then the comm is poisoned (fails fast)."""
    seen: dict[str, Any] = {}
    for key, case in _mismatch_cases(ctx.rank, ctx.world_size).items():
        comm = comm_for(ctx, f"mm_{key}_{transport}", transport)
        seen[key] = case(comm)
        seen[key]["poisoned"] = outcome(lambda comm=comm: comm.barrier(False))
        ctx.store.set(f"{key}/{ctx.rank}", "1")
        ctx.store.wait([f"{key}/{r}" for r in range(ctx.world_size)])
        comm.finalize()
    return seen


# -- killed and stopped peers --------------------------------------------------------------
def killed(
    ctx: RankContext,
    transport: str,
    position: str,
    report_dir: str,
    hosts: tuple[int, ...] = (),
    numel: int = 16,
) -> None:
    """Rank 1 is SIGKILLed before or during an all_reduce; the survivors then run two ops.

    ``hosts[r]`` simulates rank r's host (``TORCHCOMM_HOST_ID``); empty: one host.
    ``numel``: the all_reduce's size (past 8192 int64s: the tcp path's ring).
    Survivors write what they saw to ``report_dir`` (the dead rank fails the task).
    """
    me, world = ctx.rank, ctx.world_size
    if hosts:
        os.environ["TORCHCOMM_HOST_ID"] = f"chaos-host-{hosts[me]}"
    comm = comm_for(ctx, f"kill_{transport}_{position}", transport)
    t = torch.full((16,), me, dtype=torch.int64)
    comm.all_reduce(t, ReduceOp.SUM, False)  # connected and working
    assert int(t[0]) == world * (world - 1) // 2
    comm.barrier(False)
    if me == 1:
        if position == "during":
            time.sleep(0.3)  # the others are inside the all_reduce by now
        os.kill(os.getpid(), signal.SIGKILL)
    if position == "before":
        time.sleep(0.5)  # rank 1 is gone before the op starts
    seen: dict[str, Any] = {}
    x = torch.full((numel,), me, dtype=torch.int64)
    seen["all_reduce"] = outcome(lambda: comm.all_reduce(x, ReduceOp.SUM, False))
    seen["barrier"] = outcome(lambda: comm.barrier(False))
    Path(report_dir, f"rank{me}.json").write_text(json.dumps(seen))
    comm.finalize()


def stopped(ctx: RankContext, transport: str, timeout_s: float) -> dict[str, Any]:
    """Rank 2 is SIGSTOPped (alive, silent); ranks 0 and 1 time out naming it."""
    me = ctx.rank
    comm = comm_for(ctx, f"stop_{transport}", transport, timeout_s)
    comm.barrier(False)
    ctx.store.set(f"pid/{me}", str(os.getpid()))
    seen: dict[str, Any] = {}
    if me == 2:
        ctx.store.wait(["released"], timedelta(seconds=60))
        comm.abort()  # stopped, then continued: its peers gave up on it
        comm.finalize()  # (the harness keeps this worker for later tasks)
        return seen
    victim = int(ctx.store.get("pid/2").decode())
    if me == 0:
        os.kill(victim, signal.SIGSTOP)
    ctx.store.set(f"stopped_seen/{me}", "1")
    ctx.store.wait([f"stopped_seen/{r}" for r in (0, 1)])
    x = torch.ones(4, dtype=torch.int64)
    seen["all_reduce"] = outcome(lambda: comm.all_reduce(x, ReduceOp.SUM, False))
    ctx.store.set(f"timed_out/{me}", "1")
    ctx.store.wait([f"timed_out/{r}" for r in (0, 1)])
    if me == 0:
        os.kill(victim, signal.SIGCONT)
        ctx.store.set("released", "1")
    comm.abort()
    comm.finalize()
    return seen


# -- multi-host trials in network namespaces (see test_netns) ------------------------------
def env_store(rank: int, size: int, prefix: str) -> torch.distributed.TCPStore:
    """The trial's store, at ``{prefix}_STORE_ADDR:{prefix}_STORE_PORT`` (rank 0 serves it)."""
    return torch.distributed.TCPStore(
        os.environ[f"{prefix}_STORE_ADDR"],
        int(os.environ[f"{prefix}_STORE_PORT"]),
        size,
        is_master=rank == 0,
        timeout=timedelta(seconds=60),
        wait_for_workers=False,
    )


def netns_rank_main() -> None:
    """One rank of a netns trial, run as ``ip netns exec NS python -c ...``.

    With ``CHAOS_HIER_CHECKS=1``, first runs the hierarchical checks of
    ``tests/test_shm_hier.py`` (``hier{rank}.json``).  Connects, checks an all_reduce, says
    ``ready`` (a file), waits for ``go`` (the parent has applied the fault), then runs one
    all_reduce and writes what it saw.
    """
    rank = int(os.environ["TORCHCOMM_RANK"])
    size = int(os.environ["TORCHCOMM_SIZE"])
    out = Path(os.environ["CHAOS_OUT"])
    store = env_store(rank, size, "CHAOS")
    if os.environ.get("CHAOS_HIER_CHECKS") == "1":  # the healthy multi-host checks first
        from tests.test_shm_hier import netns_hier_checks

        (out / f"hier{rank}.json").write_text(json.dumps(netns_hier_checks(store, rank, size)))
    comm = new_comm(
        "gloo",
        CPU,
        name="netns_chaos",
        store=store,
        timeout=timedelta(seconds=float(os.environ["CHAOS_TIMEOUT_S"])),
        hints={"transport": os.environ["CHAOS_TRANSPORT"]},
    )
    t = torch.full((64,), rank, dtype=torch.int64)
    comm.all_reduce(t, ReduceOp.SUM, False)
    assert int(t[0]) == size * (size - 1) // 2, t
    comm.barrier(False)
    (out / f"ready{rank}").write_text(str(os.getpid()))
    give_up = time.monotonic() + 60
    while not (out / "go").exists() and time.monotonic() < give_up:
        time.sleep(0.01)
    x = torch.full((64,), rank, dtype=torch.int64)
    seen = {"all_reduce": outcome(lambda: comm.all_reduce(x, ReduceOp.SUM, False))}
    seen["transport"] = {"type": None, "text": str(comm.get_backend_impl().transport)}  # type: ignore[attr-defined]
    if os.environ.get("CHAOS_SHRINK") == "1":  # the survivors go on without the dead rank
        start = time.monotonic()
        small = comm.shrink()
        y = torch.full((64,), rank, dtype=torch.int64)
        small.all_reduce(y, ReduceOp.SUM, False)
        seen["shrink"] = {
            "rank_size": [small.get_rank(), small.get_size()],
            "sum": int(y[0]),
            "s": time.monotonic() - start,
            "transport": str(small.get_backend_impl().transport),  # type: ignore[attr-defined]
        }
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    give_up = time.monotonic() + 60  # stay alive until every survivor reported: an exited
    while not (out / "done").exists() and time.monotonic() < give_up:  # rank is a dead one
        time.sleep(0.01)
    os._exit(0)  # the comm is broken; the trial is over


class Tripwire(torch.distributed.Store):
    """A store that SIGKILLs its process right after it writes (or adds to) a key
    containing ``trigger``: a rank that dies at an exact point of ``new_comm``."""

    def __init__(self, inner: Any, trigger: str) -> None:
        super().__init__()
        self.inner = inner
        self.trigger = trigger

    def set(self, key: str, value: Any) -> None:
        self.inner.set(key, value)
        if self.trigger in key:
            os.kill(os.getpid(), signal.SIGKILL)

    def get(self, key: str) -> Any:
        return self.inner.get(key)

    def add(self, key: str, value: int) -> int:
        got = int(self.inner.add(key, value))
        if value and self.trigger in key:
            os.kill(os.getpid(), signal.SIGKILL)
        return got

    def check(self, keys: list[str]) -> bool:
        return bool(self.inner.check(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return bool(self.inner.delete_key(key))

    def compare_set(self, key: str, expected: Any, desired: Any) -> Any:
        return self.inner.compare_set(key, expected, desired)

    def num_keys(self) -> int:
        return int(self.inner.num_keys())


def killed_in_new_comm(ctx: RankContext, transport: str, trigger: str, report_dir: str) -> None:
    """Rank 1 is SIGKILLed inside ``new_comm`` right after it writes a ``trigger`` key."""
    me = ctx.rank
    store = Tripwire(ctx.store, trigger) if me == 1 else ctx.store
    start = time.monotonic()
    try:
        comm = new_comm(
            "gloo",
            CPU,
            name=f"born_{transport}",
            store=store,
            timeout=timedelta(seconds=3),
            # The comm keeps this store (no private one), so the tripwire sees every key.
            hints={"transport": transport, "persistent_store": "1"},
        )
    except Exception as exc:
        seen = {"type": type(exc).__name__, "text": str(exc), "s": time.monotonic() - start}
    else:
        seen = {"type": None, "text": "returned", "s": time.monotonic() - start}
        comm.finalize()
    Path(report_dir, f"rank{me}.json").write_text(json.dumps({"new_comm": seen}))
