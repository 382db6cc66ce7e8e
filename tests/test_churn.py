"""Nothing grows with communicator churn (issue 41).

A job that makes and drops communicators (torchft reconfigures on every quorum change,
elastic jobs shrink and regrow, test suites make one per test) must end up holding what it
held before.  One task per placement (shm on one host, tcp, and hierarchical: three ranks on
two simulated hosts, the first holding two) runs every life-cycle path, each for ``WARMUP``
cycles and then ``cycles`` more, on the same processes:

* ``create``: ``new_comm`` without a store (``MASTER_ADDR:MASTER_PORT``: rank 0 moves the
  ranks to a private store of its own), ``all_reduce``, ``finalize``;
* ``ops``: ``new_comm(store=)``; async ``all_reduce`` (the executor thread), a send/recv
  ring, ``all_gather_object``, a window (put, signal, wait_signal, deregister; a second one
  left registered when the comm is finalized); ``finalize``;
* ``split``: a split into every rank and one into the first and last, the parent finalized
  before its children;
* ``recovery``: ``abort`` then ``finalize``; ``revoke`` on every rank, ``shrink`` to a new
  comm of everyone, an ``all_reduce`` on it, both finalized;
* ``dropped``: a comm used (an async op too) and dropped without ``finalize``, then
  ``gc.collect()``;
* ``failed``: a ``new_comm`` whose peers never arrive (0.1 s timeout);
* ``bridge``: ``init_process_group`` with ``use_torchcomms``, ``all_reduce``,
  ``destroy_process_group``;
* ``reconfigure``: one comm made with ``enable_reconfigure=True``, reconfigured over every
  member's handle and used, ``cycles`` times (torchft's pattern).

Each rank samples what it holds (``torchcomms.bench.resources``: descriptors by kind,
threads with native ones, memory maps, RSS, its ``/dev/shm`` segments) after the warm-up
and after the last cycle of each path.  The garbage collector is off while a path runs
(``dropped`` collects by itself): a communicator's objects refer to each other, so what
only a collection would release shows up as growth instead of depending on when one runs.
RSS is read after a collection and a ``malloc_trim``.  ``ALLOWANCE`` is the growth tolerated per path, whatever
the cycle count; ``/dev/shm`` must hold no segment of these processes at the end.

The default run: 4 cycles per path at each placement (a descriptor or thread per cycle
is past the allowance).  ``-m slow``: 1,000 ``create``
cycles and 1,000 reconfigures of one comm at each placement, every other path 50 times.
"""

from __future__ import annotations

import gc
import os
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore

from tests.harness import RankContext, run_ranks
from torchcomms import ReduceOp, TorchComm, new_comm, objcol
from torchcomms.bench import resources
from torchcomms.errors import CommError, CommRevokedError
from torchcomms.transport.gloo import process_group as gloo

CPU = torch.device("cpu")
WARMUP = 2
#: Growth tolerated per path from the end of its warm-up to its last cycle, whatever their
#: number.  Descriptors and threads: a couple may be in flight when a sample is taken (a
#: census or connect thread finishing, a socket in the middle of closing).  Maps: the
#: allocator's arenas settle over the first hundreds of cycles (a few maps).  RSS (read
#: after a collection and ``malloc_trim``): the flight recorder's ring fills (2,000
#: entries) and torch keeps 1.2-1.6 KB per ``ProcessGroupGloo`` made and dropped (measured
#: with raw groups and no torchcomms): 1-4 MiB per 1,000 cycles here.
ALLOWANCE = {
    "fd_total": 3,
    "tasks": 2,
    "py_threads": 1,
    "maps": 12,
    "rss_kib": 24 * 1024,
    "segments": 0,
}
#: (transport hint, simulated host of each rank; empty: one host)
PLACEMENTS = {"shm": ("auto", ()), "tcp": ("tcp", ()), "hier": ("auto", (0, 0, 1))}
TIMEOUT = timedelta(seconds=30)


class _Rank:
    """One rank's paths; each cycle ``i`` of a path is a method call."""

    def __init__(self, ctx: RankContext, hint: str) -> None:
        self.ctx = ctx
        self.rank, self.size = ctx.rank, ctx.world_size
        self.hints = {"transport": hint}
        self.handles: list[str] = []
        self.rc: TorchComm | None = None

    def comm(self, name: str, timeout: timedelta = TIMEOUT) -> TorchComm:
        return new_comm(
            "gloo", CPU, name=name, timeout=timeout, hints=self.hints, store=self.ctx.store
        )

    def check_sum(self, comm: TorchComm, members: list[int] | None = None) -> None:
        members = list(range(self.size)) if members is None else members
        t = torch.full((16,), self.rank + 1, dtype=torch.int64)
        comm.all_reduce(t, ReduceOp.SUM, False)
        want = sum(r + 1 for r in members)
        assert int(t[0]) == want and int(t[-1]) == want, (int(t[0]), want)

    # -- the paths -------------------------------------------------------------------------
    def create(self, i: int) -> None:
        comm = new_comm("gloo", CPU, name="churn", timeout=TIMEOUT, hints=self.hints)
        self.check_sum(comm)
        comm.finalize()

    def ops(self, i: int) -> None:
        comm = self.comm(f"ops{i}")
        rank, size = self.rank, self.size
        t = torch.full((64,), rank + 1, dtype=torch.float32)
        comm.all_reduce(t, ReduceOp.SUM, True).wait()
        assert float(t[0]) == size * (size + 1) / 2
        got = torch.empty(8, dtype=torch.int64)
        send = comm.send(torch.full((8,), rank, dtype=torch.int64), (rank + 1) % size, True)
        comm.recv(got, (rank - 1) % size, False)
        send.wait()
        assert int(got[0]) == (rank - 1) % size
        objs: list[Any] = [None] * size
        objcol.all_gather_object(comm, objs, {"rank": rank})
        assert [o["rank"] for o in objs] == list(range(size))
        buf = torch.zeros(size * 4, dtype=torch.float32)
        win = comm.new_window(buf)
        dst, src = (rank + 1) % size, (rank - 1) % size
        win.put(torch.full((4,), float(rank)), dst, rank * 4, False)
        win.signal(dst, False)
        win.wait_signal(src, False)
        assert float(buf[src * 4]) == float(src)
        win.tensor_deregister()
        kept = comm.new_window(torch.zeros(4))  # left registered at finalize
        comm.barrier(False)
        comm.finalize()
        del win, kept

    def split(self, i: int) -> None:
        parent = self.comm(f"split{i}")
        everyone = parent.split(list(range(self.size)), f"all{i}")
        ends = [0, self.size - 1]
        pair = parent.split(ends if self.rank in ends else [], f"ends{i}")
        parent.finalize()  # before its children: they keep its store alive
        assert everyone is not None
        self.check_sum(everyone)
        everyone.finalize()
        if self.rank in ends:
            assert pair is not None
            self.check_sum(pair, ends)
            pair.finalize()
        else:
            assert pair is None

    def recovery(self, i: int) -> None:
        aborted = self.comm(f"abort{i}")
        self.check_sum(aborted)
        aborted.abort()
        aborted.finalize()
        comm = self.comm(f"revoke{i}")
        self.check_sum(comm)
        comm.revoke()
        with pytest.raises(CommRevokedError):
            comm.all_reduce(torch.ones(4), ReduceOp.SUM, False)
        shrunk = comm.shrink(None, f"shrunk{i}")
        assert shrunk.get_size() == self.size
        self.check_sum(shrunk)
        shrunk.finalize()
        comm.finalize()

    def dropped(self, i: int) -> None:
        comm = self.comm(f"dropped{i}")
        t = torch.ones(8)
        comm.all_reduce(t, ReduceOp.SUM, True).wait()
        comm.barrier(False)
        del comm
        gc.collect()

    def failed(self, i: int) -> None:
        # Each rank alone under a name of its own: nobody else ever joins it.
        try:
            self.comm(f"alone{self.rank}-{i}", timedelta(seconds=0.1))
        except CommError as exc:
            assert "never" in str(exc), exc
        else:
            raise AssertionError("a new_comm nobody joined succeeded")

    def bridge(self, i: int) -> None:
        dist.config.use_torchcomms = True
        try:
            dist.init_process_group(
                "gloo",
                store=PrefixStore(f"bridge{i}", self.ctx.store),
                rank=self.rank,
                world_size=self.size,
            )
            t = torch.full((8,), self.rank + 1, dtype=torch.int64)
            dist.all_reduce(t)
            assert int(t[0]) == self.size * (self.size + 1) // 2
            dist.destroy_process_group()
        finally:
            dist.config.use_torchcomms = False

    def reconfigure(self, i: int) -> None:
        if self.rc is None:
            self.rc = new_comm(
                "gloo", CPU, name="rc", timeout=TIMEOUT, hints=self.hints, enable_reconfigure=True
            )
            store = self.ctx.store
            store.set(f"handle/{self.rank}", self.rc.get_init_handle())
            self.handles = [store.get(f"handle/{r}").decode() for r in range(self.size)]
        self.rc.reconfigure(uuid=i, init_handles=self.handles)
        self.check_sum(self.rc)


PATHS = ("create", "ops", "split", "recovery", "dropped", "failed", "bridge", "reconfigure")


def _sample() -> resources.Holdings:
    held = resources.sample()
    # RSS without the cycles' garbage (the rest was read before collecting) and without the
    # free heap pages glibc keeps (they grew 4-8 MiB over 150 hierarchical cycles, 0.2-0.6
    # MiB once trimmed).
    gc.collect()
    resources.trim_heap()
    held.rss_kib = resources.rss_kib()
    return held


def _churn(
    ctx: RankContext, hint: str, hosts: tuple[int, ...], cycles: dict[str, int]
) -> dict[str, Any]:
    saved = os.environ.get("TORCHCOMM_HOST_ID")
    if hosts:
        os.environ["TORCHCOMM_HOST_ID"] = f"churn-host-{hosts[ctx.rank]}"
    me = _Rank(ctx, hint)
    out: dict[str, Any] = {}
    was_enabled = gc.isenabled()
    try:
        for path, n in cycles.items():
            step: Callable[[int], None] = getattr(me, path)
            gc.disable()
            started = time.monotonic()
            for i in range(WARMUP):
                step(i)
            before = _sample()
            for i in range(WARMUP, WARMUP + n):
                step(i)
            if path == "reconfigure" and me.rc is not None:
                me.rc.finalize()
                me.rc = None
            after = _sample()
            gc.enable()
            out[path] = {
                "growth": resources.growth(before, after),
                "before": before.as_dict(),
                "after": after.as_dict(),
                "seconds": round(time.monotonic() - started, 2),
            }
            ctx.store.set(f"path/{path}/{ctx.rank}", "1")  # no rank runs ahead into the next
            ctx.store.wait([f"path/{path}/{r}" for r in range(ctx.world_size)])
        out["segments_left"] = resources.sample().segments
    finally:
        if was_enabled:
            gc.enable()
        if saved is None:
            os.environ.pop("TORCHCOMM_HOST_ID", None)
        else:
            os.environ["TORCHCOMM_HOST_ID"] = saved
    return out


def _over(results: list[dict[str, Any]], cycles: dict[str, int]) -> list[str]:
    """Every (rank, path, count) that grew past ``ALLOWANCE``, with what it held."""
    problems = []
    for rank, res in enumerate(results):
        if res["segments_left"]:
            problems.append(f"rank {rank}: {res['segments_left']} /dev/shm segment(s) left")
        for path in cycles:
            growth = res[path]["growth"]
            over = {k: growth[k] for k, limit in ALLOWANCE.items() if growth[k] > limit}
            if over:
                before, after = res[path]["before"], res[path]["after"]
                problems.append(
                    f"rank {rank} {path} ({cycles[path]} cycles after {WARMUP}): grew {over}; "
                    f"fds {before['fds']} -> {after['fds']}; threads "
                    f"{before['thread_names']} -> {after['thread_names']}"
                )
    return problems


def _run(placement: str, cycles: dict[str, int], timeout: float) -> list[dict[str, Any]]:
    hint, hosts = PLACEMENTS[placement]
    world = len(hosts) or 2
    results = run_ranks(_churn, world, hint, hosts, cycles, timeout=timeout)
    problems = _over(results, cycles)
    assert not problems, f"{placement}: " + "\n".join(problems)
    return results


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_every_path_holds_nothing_more_after_its_cycles(placement: str) -> None:
    _run(placement, dict.fromkeys(PATHS, 4), timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_a_thousand_creations_and_reconfigures(placement: str) -> None:
    cycles = dict.fromkeys(PATHS, 50)
    cycles["create"] = cycles["reconfigure"] = 1000
    _run(placement, cycles, timeout=3000)


def test_a_group_with_a_call_running_is_kept_until_the_call_ends() -> None:
    """``transport.gloo.release``: dropping a process group whose call still runs would
    block in its destructor, so it is kept aside and dropped by the first sweep after."""

    class Group:  # stands for a ProcessGroupGloo: only its lifetime matters here
        pass

    running = [True]
    group = Group()
    alive = weakref.ref(group)
    gloo.release((group, "its store"), lambda: running[0])
    del group
    assert alive() is not None and gloo.sweep() >= 1
    running[0] = False
    gloo.sweep()
    assert alive() is None
    idle = Group()
    alive = weakref.ref(idle)
    gloo.release((idle,), lambda: False)
    del idle
    assert alive() is None  # nothing runs: dropped at once
