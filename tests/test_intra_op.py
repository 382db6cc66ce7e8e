"""``runtime.intra_op``: a comm op's torch kernels run on one OpenMP thread, and only its own.

Why it matters is measured, not tested here: ``benchmarks/diagnostics/intra_op_threads.py``.
Here: the setting is the calling thread's alone and comes back after the op, sync and async,
over both transports, with every value right.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from tests.harness import RankContext, run_ranks
from torchcomms import ReduceOp, new_comm
from torchcomms.runtime import intra_op


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _threads_elsewhere() -> int:
    seen: list[int] = []
    other = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    other.start()
    other.join()
    return seen[0]


def test_one_thread_is_this_threads_alone_and_comes_back(two_threads: None) -> None:
    if intra_op._set is None:
        pytest.skip("torch here uses no OpenMP runtime")
    before = intra_op.one_thread()
    try:
        assert before == 2
        assert torch.get_num_threads() == 1
        assert _threads_elsewhere() == 2  # another thread (the program's) keeps torch's
    finally:
        intra_op.restore(before)
    assert torch.get_num_threads() == 2
    # Already one thread: nothing to change, nothing to restore.
    torch.set_num_threads(1)
    assert intra_op.one_thread() == 1 and torch.get_num_threads() == 1


def test_without_an_openmp_runtime_nothing_changes(
    two_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(intra_op, "_set", None)
    assert intra_op.one_thread() == 1 and torch.get_num_threads() == 2
    intra_op.restore(2)
    intra_op.for_this_thread()
    assert torch.get_num_threads() == 2


def test_a_comm_thread_keeps_one_for_good(two_threads: None) -> None:
    if intra_op._set is None:
        pytest.skip("torch here uses no OpenMP runtime")
    seen: list[int] = []

    def comm_thread() -> None:
        intra_op.for_this_thread()
        torch.ones(1 << 16).add_(1)  # torch's first use on this thread keeps it at 1
        seen.append(torch.get_num_threads())

    worker = threading.Thread(target=comm_thread)
    worker.start()
    worker.join()
    assert seen == [1] and torch.get_num_threads() == 2


def _ops_leave_the_threads(ctx: RankContext) -> dict[str, object]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        comm = new_comm("gloo", torch.device("cpu"), name="intra_op", store=ctx.store)
        n, r = comm.get_size(), comm.get_rank()
        count = (1 << 18) + 3  # past torch's 32768-element grain: a parallel region
        t = torch.full((count,), float(r + 1))
        comm.all_reduce(t, ReduceOp.SUM, False)
        after_sync = torch.get_num_threads()
        u = torch.full((count,), float(r + 1))
        comm.all_reduce(u, ReduceOp.MAX, True).wait()
        after_async = torch.get_num_threads()
        out = [torch.empty(count) for _ in range(n)]
        comm.all_gather(out, t, False)
        comm.finalize()
        total = n * (n + 1) / 2
        right = bool((t == total).all() and (u == n).all())
        right = right and all(bool((o == total).all()) for o in out)
        return {"sync": after_sync, "async": after_async, "right": right}
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_ops_give_the_callers_threads_back(transport: str) -> None:
    env = {"TORCHCOMM_TRANSPORT": transport}
    for rank, got in enumerate(run_ranks(_ops_leave_the_threads, 2, timeout=120, env=env)):
        assert got == {"sync": 2, "async": 2, "right": True}, (rank, got)
