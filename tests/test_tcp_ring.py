"""The tcp path's large collectives on the lane's ring (``backends/cpu/tcp/ring_ops.py``).

Real processes over real sockets (``TORCHCOMM_TRANSPORT=tcp``), past the inline limit:

* all_reduce, reduce (to every root; also past ``TREE_MAX`` ranks, on the ring),
  reduce_scatter, all_gather, broadcast and all_to_all at worlds 2-4, with element counts
  that do not split evenly, every reduce op and several dtypes, compared bit for bit with
  a locally computed oracle (integer-valued data, so float sums are exact); broadcast
  from every root, through segments when there are ranks in the middle;
  all_gather whose input is its own slot of the output; all_to_all (one exchange on the
  lane at two ranks) in place on one rank only.
* The result is the same bits on every rank (float data with rounding).
* Two ranks whose all_reduce sizes put them on different two-rank paths both name the
  mismatch.
* A rank SIGKILLed inside a ring all_reduce is named by every survivor.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.chaos import faults
from tests.harness import RankContext, RankFailure, run_ranks
from torchcomms import ReduceOp, new_comm
from torchcomms.backends.cpu.tcp.ops import TREE_MAX
from torchcomms.backends.cpu.tcp.ring_ops import FOLD_BYTES, PAIR_RING_BYTES

TCP = {"TORCHCOMM_TRANSPORT": "tcp"}
#: Past the inline limit (64 KiB per rank) and not a multiple of any world size.
COUNT = 40_000 + 7

_REDUCE = {
    "SUM": (ReduceOp.SUM, lambda rows: rows.sum(0)),
    "MAX": (ReduceOp.MAX, lambda rows: rows.amax(0)),
    "MIN": (ReduceOp.MIN, lambda rows: rows.amin(0)),
    "PRODUCT": (ReduceOp.PRODUCT, lambda rows: rows.prod(0)),
    "AVG": (ReduceOp.AVG, lambda rows: rows.sum(0) / rows.shape[0]),
}


def _data(rank: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """Small integers (exact in every dtype here, also as products of 4 ranks)."""
    base = (torch.arange(count, dtype=torch.int64) * (rank + 3) + rank) % 5 + 1
    return base.to(dtype)


def _ring_ops(ctx: RankContext) -> dict[str, int]:
    comm = new_comm("gloo", torch.device("cpu"), name="ring", store=ctx.store)
    n, r = comm.get_size(), comm.get_rank()
    transport = comm.get_backend_impl().transport  # type: ignore[attr-defined]
    assert transport.startswith("tcp"), transport
    checked = 0
    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        rows = torch.stack([_data(q, COUNT, dtype) for q in range(n)])
        for name, (op, oracle) in _REDUCE.items():
            if name == "AVG" and not dtype.is_floating_point:
                continue
            t = _data(r, COUNT, dtype)
            comm.all_reduce(t, op, False)
            want = oracle(rows.double()).to(dtype)
            assert torch.equal(t, want), (name, dtype, (t - want).abs().max())
            checked += 1
    # bool: SUM is logical or, MIN is and
    bits = torch.stack([_data(q, COUNT, torch.int64) > 2 for q in range(n)])
    for op, want in ((ReduceOp.SUM, bits.any(0)), (ReduceOp.MIN, bits.all(0))):
        t = bits[r].clone()
        comm.all_reduce(t, op, False)
        assert torch.equal(t, want), op
        checked += 1
    # reduce to every root: the root gets the oracle, the other ranks' tensors are only read
    for root in range(n):
        for dtype, name in ((torch.float32, "SUM"), (torch.int64, "MAX"), (torch.float32, "AVG")):
            op, oracle = _REDUCE[name]
            rows = torch.stack([_data(q, COUNT, dtype) for q in range(n)])
            t = _data(r, COUNT, dtype)
            comm.reduce(t, root, op, False)
            want = oracle(rows.double()).to(dtype) if r == root else _data(r, COUNT, dtype)
            assert torch.equal(t, want), (root, name, dtype)
            checked += 1
    # two ranks: below ``PAIR_RING_BYTES`` several pieces of one exchange combined as they
    # arrive (``FOLD_BYTES``), the tensor both sent and written; within it the ring's two
    # steps (and at more ranks the ring at both sizes)
    for count in (PAIR_RING_BYTES[0] // 4 - FOLD_BYTES // 8 + 3, PAIR_RING_BYTES[0] // 4 + 3):
        for name in ("SUM", "AVG"):
            op, oracle = _REDUCE[name]
            rows = torch.stack([_data(q, count, torch.float32) for q in range(n)])
            t = _data(r, count, torch.float32)
            comm.all_reduce(t, op, False)
            assert torch.equal(t, oracle(rows.double()).float()), (count, name)
            checked += 1
    # a reduce of several pieces: the root's tensor only written
    big = 5 * FOLD_BYTES // 4 + 3
    rows = torch.stack([_data(q, big, torch.float32) for q in range(n)])
    t = _data(r, big, torch.float32)
    comm.reduce(t, n - 1, ReduceOp.MAX, False)
    assert torch.equal(t, rows.amax(0) if r == n - 1 else rows[r])
    checked += 1
    # reduce_scatter: each rank's COUNT-element slice of the sum of n*COUNT inputs
    full = torch.stack([_data(q, n * COUNT, torch.int64) for q in range(n)]).sum(0)
    out = torch.empty(COUNT, dtype=torch.int64)
    comm.reduce_scatter_single(out, _data(r, n * COUNT, torch.int64), ReduceOp.SUM, False)
    assert torch.equal(out, full[r * COUNT : (r + 1) * COUNT])
    parts = list(_data(r, n * COUNT, torch.int64).chunk(n))
    out.zero_()
    comm.reduce_scatter(out, parts, ReduceOp.MAX, False)
    want = torch.stack([_data(q, n * COUNT, torch.int64) for q in range(n)]).amax(0)
    assert torch.equal(out, want[r * COUNT : (r + 1) * COUNT])
    checked += 2
    # all_gather, also with the input a view of its own slot of the output
    gathered = torch.zeros(n * COUNT, dtype=torch.float32)
    comm.all_gather_single(gathered, _data(r, COUNT, torch.float32), False)
    assert torch.equal(gathered, torch.cat([_data(q, COUNT, torch.float32) for q in range(n)]))
    gathered.zero_()
    slot = gathered[r * COUNT : (r + 1) * COUNT]
    slot.copy_(_data(r, COUNT, torch.float32))
    comm.all_gather_single(gathered, slot, False)
    assert torch.equal(gathered, torch.cat([_data(q, COUNT, torch.float32) for q in range(n)]))
    checked += 2
    # broadcast from every root; 1 MiB, so the chain cuts it into segments
    for root in range(n):
        big = _data(r, 1 << 18, torch.float32) if r == root else torch.zeros(1 << 18)
        comm.broadcast(big, root, False)
        assert torch.equal(big, _data(root, 1 << 18, torch.float32)), root
        checked += 1
    # all_to_all (two ranks: one exchange on the lane), out of place, then in place on rank
    # 0 only (the ranks must still take one path)
    src = torch.cat([_data(r * n + d, COUNT, torch.int64) for d in range(n)])
    want = torch.cat([_data(q * n + r, COUNT, torch.int64) for q in range(n)])
    out = torch.zeros_like(src)
    comm.all_to_all_single(out, src, False)
    assert torch.equal(out, want)
    buf = src.clone()
    comm.all_to_all_single(buf if r == 0 else out.zero_(), buf, False)
    assert torch.equal(buf if r == 0 else out, want)
    checked += 2
    # async, several in flight
    works, tensors = [], []
    for i in range(3):
        t = torch.full((COUNT,), float(r + i))
        tensors.append(t)
        works.append(comm.all_reduce(t, ReduceOp.SUM, True))
    for i, (w, t) in enumerate(zip(works, tensors, strict=True)):
        w.wait()
        assert torch.equal(t, torch.full((COUNT,), float(sum(q + i for q in range(n)))))
        checked += 1
    comm.finalize()
    return {"checked": checked}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_ops_match_the_oracle(world: int) -> None:
    results = run_ranks(_ring_ops, world, timeout=180, env=TCP)
    assert len({r["checked"] for r in results}) == 1 and results[0]["checked"] > 20, results


def _ring_reduce(ctx: RankContext) -> int:
    """Past ``TREE_MAX`` ranks a large reduce runs on the ring: every root, sum and max."""
    comm = new_comm("gloo", torch.device("cpu"), name="ring_reduce", store=ctx.store)
    n, r = comm.get_size(), comm.get_rank()
    checked = 0
    for root in range(n):
        for dtype, name in ((torch.float32, "SUM"), (torch.int64, "MAX")):
            op, oracle = _REDUCE[name]
            rows = torch.stack([_data(q, COUNT, dtype) for q in range(n)])
            t = _data(r, COUNT, dtype)
            comm.reduce(t, root, op, False)
            assert torch.equal(t, oracle(rows.double()).to(dtype) if r == root else rows[r])
            checked += 1
    comm.finalize()
    return checked


def test_a_reduce_of_more_ranks_than_the_tree_takes_runs_on_the_ring() -> None:
    world = TREE_MAX + 1
    assert run_ranks(_ring_reduce, world, timeout=180, env=TCP) == [2 * world] * world


def _same_bits(ctx: RankContext) -> str:
    comm = new_comm("gloo", torch.device("cpu"), name="ring_bits", store=ctx.store)
    g = torch.Generator().manual_seed(comm.get_rank())
    t = torch.randn(COUNT, generator=g) * 1e3
    comm.all_reduce(t, ReduceOp.SUM, False)
    comm.finalize()
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def test_every_rank_gets_the_same_bits() -> None:
    """Rounding differs with summation order; the ring sums each chunk once, in one order."""
    for world in (2, 3):
        results = run_ranks(_same_bits, world, timeout=120, env=TCP)
        assert len(set(results)) == 1, world


def _guarded_all_reduce(ctx: RankContext, name: str, counts: tuple[int, int]) -> dict[str, Any]:
    """An all_reduce of ``counts[rank]`` elements, 16 guard elements past the tensor: what
    it raised (or ``returned``), and whether the guard is intact."""
    comm = new_comm("gloo", torch.device("cpu"), name=name, store=ctx.store,
                    abort_process_on_timeout_or_error=False)  # fmt: skip
    n = counts[ctx.rank]
    t = torch.full((n + 16,), 7.0)
    try:
        comm.all_reduce(t[:n], ReduceOp.SUM, False)
        got = "returned"
    except Exception as exc:
        got = f"{type(exc).__name__}: {exc}"
    guard = bool(torch.equal(t[n:], torch.full((16,), 7.0)))  # bytes past the tensor
    comm.finalize()
    return {"got": got, "guard": guard}


def test_with_the_check_off_a_size_mismatch_fails_without_overrunning() -> None:
    """Both ranks fail the op: one at least names the block size; the other may instead
    find its peer gone (the first closed its connections while this one was still
    sending: the reset can come before the peer's frame is read)."""
    env = {**TCP, "TORCHCOMM_MISMATCH_CHECK": "0"}
    counts = (COUNT, COUNT + 8)
    seen = run_ranks(_guarded_all_reduce, 2, "ring_unchecked", counts, timeout=120, env=env)
    sized = [" B block" in s["got"] and "expected" in s["got"] for s in seen]
    assert any(sized), seen
    for rank, got in enumerate(seen):
        gone = got["got"].startswith("PeerFailureError") and f"peer rank {1 - rank} " in got["got"]
        assert sized[rank] or gone, (rank, got)
        assert got["guard"], (rank, "wrote past the tensor")


def test_a_size_mismatch_across_the_two_rank_switch_is_named_by_both() -> None:
    """Sizes on either side of ``PAIR_RING_BYTES[0]``: one rank takes the ring, the other
    the exchange; both name the mismatch, neither overruns."""
    counts = (PAIR_RING_BYTES[0] // 4 + 3, PAIR_RING_BYTES[0] // 4 - 5)
    seen = run_ranks(_guarded_all_reduce, 2, "ring_switch", counts, timeout=120, env=TCP)
    for rank, got in enumerate(seen):
        assert got["got"].startswith("CollectiveMismatchError"), (rank, got)
        assert "count" in got["got"], (rank, got)
        assert got["guard"], (rank, "wrote past the tensor")


@pytest.mark.parametrize("hosts", [(), (0, 1, 2, 3)], ids=["one-host", "4-hosts"])
def test_a_rank_killed_inside_a_ring_all_reduce_is_named(
    hosts: tuple[int, ...], tmp_path: Path
) -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(
            faults.killed, 4, "tcp", "during", str(tmp_path), hosts, 1 << 17,
            timeout=120,
        )  # fmt: skip
    assert set(info.value.died) == {1}, str(info.value)
    for rank in (0, 2, 3):
        seen: dict[str, Any] = json.loads((tmp_path / f"rank{rank}.json").read_text())
        got = seen["all_reduce"]
        assert got["type"] == "PeerFailureError", (rank, got)
        assert "peer rank 1 died" in got["text"], (rank, got)
        assert got["s"] < 3.0, (rank, got)


def _peer_cores(ctx: RankContext) -> list[list[int]]:
    """What this rank's lane heard of its peer's core and kernel: after a small op (the
    exchange's rows) and after a ring op (the ring's header), each time from the peer."""
    from torchcomms.transport import contention

    comm = new_comm("gloo", torch.device("cpu"), name="peer_cores", store=ctx.store)
    lane = comm.get_backend_impl()._ops.lane  # type: ignore[attr-defined]
    peer = 1 - comm.get_rank()
    seen = []
    for count in (4, COUNT):  # the exchange, then the ring
        lane._cores[peer] = -7  # overwritten only by what the peer sends
        comm.all_reduce(torch.ones(count), ReduceOp.SUM, False)
        seen.append([int(lane._cores[peer]), int(lane._kernels[peer] == contention.KERNEL_ID)])
    comm.finalize()
    return seen


def test_headers_carry_the_senders_core_and_kernel() -> None:
    """``Lane.shares_core``'s inputs come from the peer's headers, on both paths."""
    for seen in run_ranks(_peer_cores, 2, timeout=120, env=TCP):
        assert [kernel for _, kernel in seen] == [1, 1], seen
        assert all(0 <= core < os.cpu_count() for core, _ in seen), seen  # type: ignore[operator]
