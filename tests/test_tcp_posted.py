"""A two-rank tcp broadcast's root returns once its bytes are out (``transport/tcp/posted.py``).

Real processes over real sockets (``TORCHCOMM_TRANSPORT=tcp``), two ranks:

* The root does not wait for the receiver: it finishes, and tells the store so, before
  the receiver enters the op (which waits for that word): small (in the header frame) and
  large (the ring).
* Broadcasts from both roots, small and large, sync and async, interleaved with
  all_reduce, all_gather, barrier and send/recv, and more in a row than ``MAX_OWED``
  while the receiver is late, give every rank the root's values.
* A mismatch is still raised by both ranks: the receiver in the op, the root at its next
  collective, each naming what rank 1 passed; two ranks that both think they are the root
  each keep their own tensor and both raise (in the op if the other's frame is already
  there, else at the next).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch

from tests.harness import RankContext, run_ranks
from torchcomms import ReduceOp, new_comm
from torchcomms.transport.tcp.posted import MAX_OWED

TCP = {"TORCHCOMM_TRANSPORT": "tcp"}
#: In the header frame (8 B), and past the inline limit (64 KiB): the ring.
SMALL, LARGE = 2, 40_000 + 7


def _comm(ctx: RankContext, name: str) -> Any:
    comm = new_comm(
        "gloo", torch.device("cpu"), name=name, store=ctx.store, timeout=timedelta(seconds=30)
    )
    assert comm.get_backend_impl().transport.startswith("tcp")
    return comm


def _root_runs_ahead(ctx: RankContext) -> int:
    comm = _comm(ctx, "posted_ahead")
    done = 0
    for i, count in enumerate((SMALL, LARGE)):
        t = torch.full((count,), 7 + i if ctx.rank == 0 else -1, dtype=torch.int64)
        if ctx.rank == 0:
            comm.broadcast(t, 0, False)
            ctx.store.set(f"root_done/{i}", "1")  # before rank 1 has entered the op
        else:
            ctx.store.wait([f"root_done/{i}"], timedelta(seconds=20))
            comm.broadcast(t, 0, False)
        assert torch.equal(t, torch.full((count,), 7 + i)), (count, t[:4])
        done += 1
    comm.barrier(False)
    comm.finalize()
    return done


def test_the_root_returns_before_the_receiver_enters() -> None:
    assert run_ranks(_root_runs_ahead, 2, timeout=120, env=TCP) == [2, 2]


def _mixed(ctx: RankContext) -> int:
    comm = _comm(ctx, "posted_mixed")
    me, checked = ctx.rank, 0
    for i in range(40):
        root, count = i % 2 if i % 3 else 0, (SMALL, LARGE, 300)[i % 3]
        t = (
            torch.arange(count, dtype=torch.int64) * (i + 1)
            if me == root
            else torch.zeros(count, dtype=torch.int64)
        )
        if i % 4 == 3:
            comm.broadcast(t, root, True).wait()
        else:
            comm.broadcast(t, root, False)
        assert torch.equal(t, torch.arange(count, dtype=torch.int64) * (i + 1)), (i, root)
        if i % 5 == 4:
            s = torch.full((count,), me + 1, dtype=torch.int64)
            comm.all_reduce(s, ReduceOp.SUM, False)
            assert torch.equal(s, torch.full((count,), 3)), i
        if i % 7 == 6:
            out = torch.zeros(2 * count, dtype=torch.int64)
            comm.all_gather_single(out, torch.full((count,), me, dtype=torch.int64), False)
            assert torch.equal(out[count:], torch.ones(count, dtype=torch.int64)), i
        if i % 11 == 10:
            p = torch.full((5,), i, dtype=torch.int64)
            if me == 0:
                comm.send(p, 1, False)
            else:
                got = torch.zeros(5, dtype=torch.int64)
                comm.recv(got, 0, False)
                assert torch.equal(got, p), i
        checked += 1
    # More in a row than may be owed, with the receiver late: the root waits for the oldest.
    if me == 1:
        ctx.store.wait(["root_far_ahead"], timedelta(seconds=20))
    for i in range(MAX_OWED + 20):
        t = torch.full((SMALL,), i if me == 0 else -1, dtype=torch.int64)
        comm.broadcast(t, 0, False)
        if me == 0 and i == MAX_OWED - 1:  # the next one waits for the oldest owed
            ctx.store.set("root_far_ahead", "1")
        assert torch.equal(t, torch.full((SMALL,), i)), i
        checked += 1
    comm.barrier(False)
    comm.finalize()
    return checked


def test_broadcasts_mixed_with_other_ops_give_the_roots_values() -> None:
    assert run_ranks(_mixed, 2, timeout=180, env=TCP) == [40 + MAX_OWED + 20] * 2


def _mismatch(ctx: RankContext, count: int, roots: tuple[int, int]) -> dict[str, Any]:
    comm = _comm(ctx, f"posted_mismatch_{count}_{roots[1]}")
    me = ctx.rank
    n = count + 1 if me == 1 and roots == (0, 0) else count
    t = torch.full((n,), 10 + me, dtype=torch.int64)
    seen: dict[str, Any] = {"op": None, "next": None}
    try:
        comm.broadcast(t, roots[me], False)
    except RuntimeError as exc:
        seen["op"] = (type(exc).__name__, str(exc))
    seen["own"] = bool(torch.equal(t, torch.full((n,), 10 + me)))
    if seen["op"] is None:
        try:
            comm.barrier(False)
        except RuntimeError as exc:
            seen["next"] = (type(exc).__name__, str(exc))
    comm.finalize()
    return seen


@pytest.mark.parametrize("count", [SMALL, LARGE])
def test_a_size_mismatch_is_raised_by_the_receiver_now_and_the_root_at_its_next_op(
    count: int,
) -> None:
    root, receiver = run_ranks(_mismatch, 2, count, (0, 0), timeout=120, env=TCP)
    assert receiver["op"] is not None and receiver["op"][0] == "CollectiveMismatchError"
    assert "rank 1 passed count" in receiver["op"][1], receiver
    assert root["op"] is None and root["own"], root  # its bytes went out: nothing to undo
    assert root["next"] is not None and root["next"][0] == "CollectiveMismatchError", root
    assert "broadcast" in root["next"][1] and "rank 1 passed count" in root["next"][1], root


def test_two_ranks_that_both_think_they_are_the_root_both_raise() -> None:
    for seen in run_ranks(_mismatch, 2, SMALL, (0, 1), timeout=120, env=TCP):
        assert seen["own"], seen  # each kept its own tensor
        # In the op when the peer's frame is already there as this rank posts, else next.
        error = seen["op"] or seen["next"]
        assert error is not None and error[0] == "CollectiveMismatchError", seen
        assert "passed root=" in error[1], seen
