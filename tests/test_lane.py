"""The small-message latency path (issue 15): the sync lane and the numpy one-round path.

* The lane (``CommCore._sync``): a sync op with the comm's timeout, no hints and no user
  hook records one ``SyncRecord`` in the flight recorder instead of an ``OpRecord``.  The
  dumped entries are the same as the general path's (forced with ``hints={}``) in every
  field but times and ids; a failure on the lane is recorded with its error; a hook closes
  the lane and sees the op, its removal reopens it, and a handle does not keep its
  communicator alive; a plug-in's sync op that finishes only in ``wait()`` (or fails
  there) completes its record then.
* The one-round collectives with numpy (``cpu.shm.oneshot``, ``host_arrays``): all_reduce,
  reduce and broadcast on every dtype numpy takes and SUM/MAX/MIN, all_gather and all_to_all
  as bytes on any dtype, and reduce_scatter (mismatched sizes raising on every rank), on both sides of the numpy size
  limit, on 2 and 3 ranks: exact results, the same bits on every rank, the
  autograd version bumped like an in-place torch op, inputs that are slices of a larger
  tensor, and a tensor freed and another allocated (likely at the same address).
"""

from __future__ import annotations

import gc
import warnings
import weakref
from datetime import timedelta
from typing import Any

import pytest
import torch

from tests.harness import RankContext, run_ranks
from tests.reference import rank_data, reduce_ref
from tests.test_api import DummyPyBackend, _Waitable
from torchcomms import CollectiveMismatchError, ReduceOp, TorchComm, new_comm, register_backend
from torchcomms.backends.cpu import host_arrays
from torchcomms.hooks import fr
from torchcomms.runtime import fingerprint as F
from torchcomms.runtime.oprecord import OpRecord, SyncRecord

CPU = torch.device("cpu")
TIMEOUT = timedelta(seconds=30)
_VOLATILE = (
    "record_id",
    "op_id",
    "time_created_ns",
    "time_discovered_started_ns",
    "time_discovered_completed_ns",
    "duration_ms",
    "thread_id",
    "frames",
)


def _comm(ctx: RankContext, name: str, transport: str = "shm") -> TorchComm:
    return new_comm(
        "gloo", CPU, name=name, store=ctx.store, timeout=TIMEOUT, hints={"transport": transport}
    )


def _mark() -> int:
    """The record id the flight recorder gives next (a rank process runs many tests: the
    ring may be full, so its length says nothing)."""
    buf = fr.global_ring().buf
    return buf[-1][1] + 1 if buf else 0


def _entries(comm: TorchComm, since: int) -> list[tuple[Any, dict[str, Any]]]:
    """(record, dumped dict) of this comm's flight-recorder entries from record id ``since``."""
    name = comm.get_name()
    out = []
    for entry in list(fr.global_ring().buf):
        if entry[1] < since:
            continue
        d = fr.entry_to_dict(entry)
        if d["process_group"][0] == name:
            out.append((entry[0], d))
    return out


def _ops(comm: TorchComm, hints: dict[str, str] | None) -> None:
    """The nine lane ops once each; ``hints={}`` sends them down the general path."""
    rank, peer = comm.get_rank(), 1 - comm.get_rank()
    t = torch.arange(4, dtype=torch.float32) + rank
    comm.all_reduce(t, ReduceOp.SUM, False, hints=hints)
    comm.broadcast(t, 1, False, hints=hints)
    comm.reduce(t, 0, ReduceOp.MAX, False, hints=hints)
    comm.barrier(False, hints=hints)
    src = torch.arange(4, dtype=torch.float32) + rank
    gathered = torch.empty(8, dtype=torch.float32)
    comm.all_gather_single(gathered, src, False, hints=hints)
    assert gathered.tolist() == [0.0, 1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 4.0]
    part = torch.empty(2, dtype=torch.float64)
    comm.reduce_scatter_single(part, src.double(), ReduceOp.SUM, False, hints=hints)
    assert part.tolist() == [1.0 + 4 * rank, 3.0 + 4 * rank]
    swapped = torch.empty(4, dtype=torch.int32)
    comm.all_to_all_single(swapped, src.int(), False, hints=hints)
    assert swapped.tolist() == [2 * rank, 2 * rank + 1, 2 * rank + 1, 2 * rank + 2]
    if rank == 0:
        comm.send(t, peer, False, hints=hints)
        comm.recv(t, peer, False, hints=hints)
    else:
        comm.recv(t, peer, False, hints=hints)
        comm.send(t, peer, False, hints=hints)


def _lane_matches_general_path(ctx: RankContext, transport: str) -> None:
    comm = _comm(ctx, f"lane-{transport}", transport)
    assert comm._lane is not None, "the flight recorder alone must leave the lane open"
    start = _mark()
    _ops(comm, None)
    lane = _entries(comm, start)
    start = _mark()
    _ops(comm, {})
    general = _entries(comm, start)
    assert [type(r) for r, _ in lane] == [SyncRecord] * 9
    assert [type(r) for r, _ in general] == [OpRecord] * 9
    for (_, a), (_, b) in zip(lane, general, strict=True):
        assert a["state"] == "completed" and a["error"] is None
        assert a["time_created_ns"] <= a["time_discovered_started_ns"]
        assert a["time_discovered_started_ns"] <= a["time_discovered_completed_ns"]
        same_a = {k: v for k, v in a.items() if k not in _VOLATILE}
        same_b = {k: v for k, v in b.items() if k not in _VOLATILE}
        # Sequence numbers advance across both halves: compare them as offsets.
        same_b["collective_seq_id"] -= 7
        same_b["p2p_seq_id"] -= 2
        assert same_a == same_b, {k: (v, same_b.get(k)) for k, v in same_a.items()}
    comm.finalize()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_lane_records_what_the_general_path_records(transport: str) -> None:
    run_ranks(_lane_matches_general_path, 2, transport, timeout=60)


def _lane_failure_and_hooks(ctx: RankContext) -> None:
    comm = _comm(ctx, "lane-hooks")
    rank = comm.get_rank()
    start = _mark()
    t = torch.ones(3)
    op = ReduceOp.SUM if rank == 0 else ReduceOp.MAX  # a mismatch, raised on every rank
    with pytest.raises(CollectiveMismatchError):
        comm.all_reduce(t, op, False)
    [(record, d)] = _entries(comm, start)
    assert type(record) is SyncRecord
    assert d["state"] == "completed" and d["error"].startswith("CollectiveMismatchError")
    assert record.comm is None  # a kept record does not keep its communicator alive
    comm.finalize()

    comm = _comm(ctx, "lane-hooks-2")
    seen: list[int] = []
    handle = comm.register_pre_hook(lambda name, op_id, args: seen.append(op_id))
    assert comm._lane is None
    comm.all_reduce(torch.ones(2), ReduceOp.SUM, False)
    assert len(seen) == 1
    handle.remove()
    assert comm._lane is not None
    comm.all_reduce(torch.ones(2), ReduceOp.SUM, False)
    assert len(seen) == 1
    post = comm.register_post_hook(lambda op_id, args: seen.append(op_id))
    assert comm._lane is None
    comm.barrier(False)
    assert len(seen) == 2
    comm.finalize()
    other = _comm(ctx, "lane-hooks-3")
    other.barrier(False)  # the recorder's last-comm shortcut now points at this one
    ref = weakref.ref(comm)
    del comm
    gc.collect()
    assert ref() is None, "a hook handle kept its communicator alive"
    post.remove()  # after the comm is gone: nothing to update, no error
    other.finalize()


def test_lane_records_failures_and_closes_for_hooks() -> None:
    run_ranks(_lane_failure_and_hooks, 2, timeout=60)


# ------------------------------------------------------------------ the numpy one-round path
_NUMPY_DTYPES = (torch.float32, torch.float64, torch.int64, torch.int32, torch.int8, torch.uint8)


def _sizes(dtype: torch.dtype) -> list[int]:
    limit = host_arrays.MAX_BYTES // dtype.itemsize
    return [1, 7, 256, limit, limit + 1]


def _one_round_values(ctx: RankContext) -> None:
    comm = _comm(ctx, "oneshot-np")
    rank, size = comm.get_rank(), comm.get_size()
    for dtype in _NUMPY_DTYPES:
        for n in _sizes(dtype):
            for red in ("SUM", "MAX", "MIN"):
                inputs = [rank_data(r, n, dtype, red) for r in range(size)]
                want = reduce_ref(inputs, red, dtype)
                t = inputs[rank].clone()
                version = t._version
                comm.all_reduce(t, getattr(ReduceOp, red), False)
                assert torch.equal(t, want), (dtype, n, red)
                assert t._version > version, "an in-place write must bump the version"
                # Every rank holds the same bits.
                gathered = [torch.empty_like(t) for _ in range(size)]
                comm.all_gather(gathered, t, False)
                assert all(torch.equal(g, t) for g in gathered)
                r = inputs[rank].clone()
                comm.reduce(r, size - 1, getattr(ReduceOp, red), False)
                assert torch.equal(r, want if rank == size - 1 else inputs[rank]), (dtype, n, red)
            b = rank_data(rank, n, dtype)
            comm.broadcast(b, 1, False)
            assert torch.equal(b, rank_data(1, n, dtype)), (dtype, n)
    # A slice of a larger tensor is reduced in place and nothing around it changes.
    big = torch.full((64,), 5.0)
    comm.all_reduce(big[8:16], ReduceOp.SUM, False)
    assert torch.equal(big[8:16], torch.full((8,), 5.0 * size))
    assert torch.equal(big[:8], torch.full((8,), 5.0))
    assert torch.equal(big[16:], torch.full((48,), 5.0))
    # Freed and reallocated tensors of one shape: each call sees its own tensor's memory.
    for i in range(20):
        t = torch.full((16,), float(i + rank))
        comm.all_reduce(t, ReduceOp.SUM, False)
        assert torch.equal(t, torch.full((16,), float(size * i + sum(range(size)))))
        del t
    # Overflow to inf and NaN are silent, as with torch kernels (no numpy RuntimeWarning,
    # which -W error would turn into an exception).
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for dtype in (torch.float32, torch.float64):
            big = torch.full((3,), torch.finfo(dtype).max, dtype=dtype)
            big[2] = float("nan")
            comm.all_reduce(big, ReduceOp.SUM, False)
            assert torch.isinf(big[:2]).all() and torch.isnan(big[2])
            m = torch.tensor([float("nan"), 1.0], dtype=dtype)
            comm.all_reduce(m, ReduceOp.MAX, False)
            assert torch.isnan(m[0]) and m[1] == 1.0
        wrap = torch.full((2,), 100, dtype=torch.int8)
        comm.all_reduce(wrap, ReduceOp.SUM, False)  # wraps, as torch's int8 add does
        assert torch.equal(wrap, torch.full((2,), 100, dtype=torch.int8) * size)
    # A leaf that requires grad is written outside autograd, as with torch kernels.
    leaf = torch.ones(4, requires_grad=True)
    comm.all_reduce(leaf, ReduceOp.SUM, False)
    assert torch.equal(leaf.detach(), torch.full((4,), float(size)))
    comm.finalize()


@pytest.mark.parametrize("world", [2, 3])
def test_one_round_collectives_with_numpy_are_exact(world: int) -> None:
    run_ranks(_one_round_values, world, timeout=120)


def _one_round_gathers(ctx: RankContext) -> None:
    comm = _comm(ctx, "oneshot-copies")
    rank, size = comm.get_rank(), comm.get_size()
    oneshot = comm.get_backend_impl()._ops.coll.oneshot  # type: ignore[attr-defined]
    for dtype in (torch.float32, torch.bfloat16, torch.bool, torch.float64, torch.int8):
        limit = host_arrays.MAX_BYTES // dtype.itemsize
        for n in (1, 7, limit, limit + 1):
            want = torch.cat([rank_data(r, n, dtype) for r in range(size)])
            out = torch.zeros(size * n, dtype=dtype)
            version = out._version
            comm.all_gather_single(out, rank_data(rank, n, dtype), False)
            assert torch.equal(out, want), (dtype, n)
            assert out._version > version, "a write through numpy must bump the version"
            in_place = torch.zeros(size * n, dtype=dtype)
            mine = in_place[rank * n : (rank + 1) * n]
            mine.copy_(rank_data(rank, n, dtype))
            comm.all_gather_single(in_place, mine, False)
            assert torch.equal(in_place, want), (dtype, n)
            parts = [torch.zeros(n, dtype=dtype) for _ in range(size)]
            comm.all_gather(parts, rank_data(rank, n, dtype), False)
            assert torch.equal(torch.cat(parts), want), (dtype, n)
            one_round = oneshot.copy_plans[(F.ALL_GATHER, dtype, n)] is not None
            assert one_round == (n <= limit), (dtype, n)
            # all_to_all: rank r's part p (of n // size elements) goes to rank p's row r.
            m = max(n // size, 1)
            sent = [rank_data(r, size * m, dtype).view(size, m) for r in range(size)]
            want = torch.cat([sent[r][rank] for r in range(size)])
            out = torch.zeros(size * m, dtype=dtype)
            comm.all_to_all_single(out, sent[rank].flatten(), False)
            assert torch.equal(out, want), (dtype, m)
            in_place = sent[rank].flatten().clone()
            version = in_place._version
            comm.all_to_all_single(in_place, in_place, False)
            assert torch.equal(in_place, want), (dtype, m)
            assert in_place._version > version
            one_round = oneshot.copy_plans[(F.ALL_TO_ALL, dtype, m)] is not None
            assert one_round == (size * m <= limit), (dtype, m)
    # reduce_scatter: rank r gets the reduction of every rank's row r; one round while the
    # whole input fits the numpy limit (numpy reduces where exact, torch otherwise).
    for dtype in (torch.int32, torch.float32, torch.bfloat16, torch.uint8, torch.bool):
        limit = host_arrays.MAX_BYTES // (size * dtype.itemsize)
        for n in (1, 5, limit, limit + 1):
            for red in ("SUM", "MAX", "MIN", "PRODUCT") if dtype is not torch.bool else ("MAX",):
                inputs = [rank_data(r, size * n, dtype, red) for r in range(size)]
                want = reduce_ref(inputs, red, dtype)[rank * n : (rank + 1) * n]
                out = torch.zeros(n, dtype=dtype)
                version = out._version
                comm.reduce_scatter_single(out, inputs[rank], getattr(ReduceOp, red), False)
                assert torch.equal(out, want), (dtype, n, red)
                assert out._version > version
                key = (dtype, n, getattr(ReduceOp, red).type._value_)
                assert (oneshot.rs_plans[key] is not None) == (n <= limit), (dtype, n, red)
    # Ranks that pass different sizes raise on every rank, on either path.
    for n in (3, host_arrays.MAX_BYTES):
        mine = torch.ones(n + rank)
        with pytest.raises(CollectiveMismatchError, match="all_gather"):
            comm.all_gather_single(torch.empty(size * (n + rank)), mine, False)
        mine = torch.ones(size * (n + rank))
        with pytest.raises(CollectiveMismatchError, match="all_to_all"):
            comm.all_to_all_single(torch.empty_like(mine), mine, False)
        with pytest.raises(CollectiveMismatchError, match="reduce_scatter"):
            comm.reduce_scatter_single(torch.empty(n + rank), mine, ReduceOp.SUM, False)
    comm.finalize()


@pytest.mark.parametrize("world", [2, 3])
def test_small_gathers_all_to_alls_and_reduce_scatters_take_one_round(world: int) -> None:
    run_ranks(_one_round_gathers, world, timeout=120)


def test_numpy_is_used_only_where_it_is_exact() -> None:
    assert host_arrays.ufunc_for(torch.int32, ReduceOp.SUM.type, 8) is not None
    assert host_arrays.ufunc_for(torch.int32, ReduceOp.SUM.type, host_arrays.MAX_BYTES + 4) is None
    # Floats: numpy copies them but torch reduces them (numpy warns on overflow).
    assert host_arrays.numpy_dtype(torch.float32) is not None
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.bool):
        assert host_arrays.ufunc_for(dtype, ReduceOp.SUM.type, 8) is None
    for red in ("PRODUCT", "AVG", "BAND", "BOR", "BXOR"):
        assert host_arrays.ufunc_for(torch.int32, getattr(ReduceOp, red).type, 8) is None
    views = host_arrays.UserArrays(torch.int32, 4)
    t = torch.arange(4, dtype=torch.int32)
    views.of(t)[2] = 40
    assert t.tolist() == [0, 1, 40, 3]
    assert views.of(t) is views.of(t)
    with pytest.raises(ValueError, match=r"numpy has no dtype for torch\.bfloat16"):
        host_arrays.UserArrays(torch.bfloat16, 4)


def test_lane_follows_a_sync_op_that_finishes_in_wait() -> None:
    """A plug-in may return an unfinished work from a sync op: the record completes with it."""
    register_backend("dummy_lane", DummyPyBackend)
    comm = new_comm("dummy_lane", CPU, name="lane-late")
    impl = comm.get_backend_impl()
    assert isinstance(impl, DummyPyBackend)
    assert comm._lane is not None
    t = torch.ones(2)

    start = _mark()
    impl.next_result = _Waitable()
    work = comm.all_reduce(t, ReduceOp.SUM, False)
    [(record, d)] = _entries(comm, start)
    assert type(record) is SyncRecord
    assert not work.is_completed() and d["state"] == "started"
    work.wait()
    [(record, d)] = _entries(comm, start)
    assert d["state"] == "completed" and d["error"] is None and record.work is None

    class _Failing:
        def wait(self) -> None:
            raise RuntimeError("the plug-in's op failed")

    start = _mark()
    impl.next_result = _Failing()
    work = comm.all_reduce(t, ReduceOp.SUM, False)
    with pytest.raises(RuntimeError, match="the plug-in's op failed"):
        work.wait()
    [(record, d)] = _entries(comm, start)
    assert d["state"] == "completed" and "the plug-in's op failed" in d["error"]
    assert record.comm is None
    comm.finalize()
