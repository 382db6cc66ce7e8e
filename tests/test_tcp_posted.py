"""Two-rank tcp rooted ops: the rank that only sends returns once its bytes are out (a
broadcast's root, a reduce's other rank: ``transport/tcp/posted.py``).

Real processes over real sockets (``TORCHCOMM_TRANSPORT=tcp``), two ranks:

* That rank does not wait for the other: it finishes, and tells the store so, before the
  other enters the op (which waits for that word): small (in the header frame) and large
  (the ring).
* Broadcasts and reduces from both roots, small and large, sync and async, interleaved
  with all_reduce, all_gather, barrier and send/recv, and more broadcasts in a row than
  ``MAX_OWED`` while the receiver is late, give every rank the right values.
* A mismatch is still raised by both ranks: the receiving rank in the op, the sending one
  at its next collective (or in a receive's wait), each naming what rank 1 passed; two ranks that both think they are the root
  each keep their own tensor and both raise (in the op if the other's frame is already
  there, else at the next).  A mismatch of the last such op before ``finalize`` is logged
  there by the rank that only sent.
* The owed frame's check itself: the same op passes, another is named, a frame that is no
  header (wrong magic, too short) is refused.
"""

from __future__ import annotations

import logging
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


def _call(comm: Any, op: str, t: torch.Tensor, root: int, async_op: bool = False) -> None:
    if op == "broadcast":
        work = comm.broadcast(t, root, async_op)
    else:
        work = comm.reduce(t, root, ReduceOp.SUM, async_op)
    if async_op:
        work.wait()


def _expected(op: str, count: int, i: int, root: int, me: int) -> torch.Tensor:
    """Rank ``r`` passes ``7 + i + r``: what rank ``me`` holds after the op."""
    summed = (7 + i) + (8 + i) if me == root else 7 + i + me
    value = 7 + i + root if op == "broadcast" else summed
    return torch.full((count,), value, dtype=torch.int64)


def _poster_runs_ahead(ctx: RankContext, op: str) -> int:
    comm = _comm(ctx, f"posted_ahead_{op}")
    poster = 0 if op == "broadcast" else 1  # root 0: the rank that only sends
    done = 0
    for i, count in enumerate((SMALL, LARGE)):
        t = torch.full((count,), 7 + i + ctx.rank, dtype=torch.int64)
        if ctx.rank == poster:
            _call(comm, op, t, 0)
            ctx.store.set(f"posted/{i}", "1")  # before the other rank has entered the op
        else:
            ctx.store.wait([f"posted/{i}"], timedelta(seconds=20))
            _call(comm, op, t, 0)
        assert torch.equal(t, _expected(op, count, i, 0, ctx.rank)), (count, t[:4])
        done += 1
    comm.barrier(False)
    comm.finalize()
    return done


@pytest.mark.parametrize("op", ["broadcast", "reduce"])
def test_the_rank_that_only_sends_returns_before_the_other_enters(op: str) -> None:
    assert run_ranks(_poster_runs_ahead, 2, op, timeout=120, env=TCP) == [2, 2]


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
        r = torch.full((count,), 7 + i + me, dtype=torch.int64)
        _call(comm, "reduce", r, 1 - root, i % 4 == 1)
        assert torch.equal(r, _expected("reduce", count, i, 1 - root, me)), (i, root)
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


def _mismatch(
    ctx: RankContext, op: str, count: int, roots: tuple[int, int], then: str = "barrier"
) -> dict[str, Any]:
    comm = _comm(ctx, f"posted_mismatch_{op}_{count}_{roots[1]}_{then}")
    me = ctx.rank
    n = count + 1 if me == 1 and roots == (0, 0) else count
    t = torch.full((n,), 10 + me, dtype=torch.int64)
    seen: dict[str, Any] = {"op": None, "next": None}
    # One root: the rank that only sends goes first, so its op is sure to find nothing yet.
    poster = 0 if op == "broadcast" else 1
    if roots == (0, 0) and me != poster:
        ctx.store.wait(["posted"], timedelta(seconds=20))
    try:
        _call(comm, op, t, roots[me])
    except RuntimeError as exc:
        seen["op"] = (type(exc).__name__, str(exc))
    if me == poster:
        ctx.store.set("posted", "1")
    seen["own"] = bool(torch.equal(t, torch.full((n,), 10 + me)))
    if seen["op"] is None:
        try:
            if then == "barrier":
                comm.barrier(False)
            else:  # a wait outside the lane: it checks the owed frame between its slices
                comm.recv(torch.zeros(1, dtype=torch.int64), 1 - me, False)
        except RuntimeError as exc:
            seen["next"] = (type(exc).__name__, str(exc))
    comm.finalize()
    return seen


@pytest.mark.parametrize("op", ["broadcast", "reduce"])
@pytest.mark.parametrize("count", [SMALL, LARGE])
def test_a_size_mismatch_is_raised_by_both_the_poster_at_its_next_op(op: str, count: int) -> None:
    seen = run_ranks(_mismatch, 2, op, count, (0, 0), timeout=120, env=TCP)
    poster, other = (seen[0], seen[1]) if op == "broadcast" else (seen[1], seen[0])
    assert other["op"] is not None and other["op"][0] == "CollectiveMismatchError", other
    assert "rank 1 passed count" in other["op"][1], other
    assert poster["op"] is None and poster["own"], poster  # its bytes went out: nothing to undo
    assert poster["next"] is not None and poster["next"][0] == "CollectiveMismatchError", poster
    assert op in poster["next"][1] and "rank 1 passed count" in poster["next"][1], poster


def test_a_receive_after_a_mismatched_broadcast_raises_the_mismatch() -> None:
    root, receiver = run_ranks(_mismatch, 2, "broadcast", SMALL, (0, 0), "recv", env=TCP)
    assert receiver["op"] is not None and receiver["op"][0] == "CollectiveMismatchError"
    assert root["op"] is None and root["next"] is not None, root
    assert root["next"][0] == "CollectiveMismatchError", root
    assert "rank 1 passed count" in root["next"][1], root


def _finalize_after_mismatch(ctx: RankContext) -> list[str]:
    """The root's mismatched broadcast is its last op: finalize logs what the peer said."""
    comm = _comm(ctx, "posted_finalize")
    t = torch.zeros(SMALL + ctx.rank, dtype=torch.int64)
    warned: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warned.append(record.getMessage())

    logging.getLogger("torchcomms.backends.cpu.tcp.ops").addHandler(Keep(logging.WARNING))
    if ctx.rank == 1:
        ctx.store.wait(["posted"], timedelta(seconds=20))
        with pytest.raises(RuntimeError, match="collective mismatch"):
            comm.broadcast(t, 0, False)
        ctx.store.set("raised", "1")
    else:
        comm.broadcast(t, 0, False)  # returns: its bytes are out
        ctx.store.set("posted", "1")
        ctx.store.wait(["raised"], timedelta(seconds=20))  # rank 1's header has arrived
    comm.finalize()
    return warned


def test_finalize_logs_a_mismatch_of_the_last_op_the_rank_only_sent() -> None:
    root, receiver = run_ranks(_finalize_after_mismatch, 2, timeout=120, env=TCP)
    assert receiver == [], receiver
    assert len(root) == 1 and "collective mismatch" in root[0], root
    assert "rank 1 passed count=3" in root[0] and "at finalize" in root[0], root


def test_two_ranks_that_both_think_they_are_the_root_both_raise() -> None:
    for seen in run_ranks(_mismatch, 2, "broadcast", SMALL, (0, 1), timeout=120, env=TCP):
        assert seen["own"], seen  # each kept its own tensor
        # In the op when the peer's frame is already there as this rank posts, else next.
        error = seen["op"] or seen["next"]
        assert error is not None and error[0] == "CollectiveMismatchError", seen
        assert "passed root=" in error[1], seen


def test_the_owed_check_refuses_a_frame_that_is_no_header_and_names_a_difference() -> None:
    import struct
    from types import SimpleNamespace

    from torchcomms.backends.cpu.tcp import exchange as ex
    from torchcomms.transport.tcp.lane import LaneProtocolError

    seen: list[Any] = []

    def mismatch(what: str, mine: Any, by_rank: Any) -> RuntimeError:
        seen.append((what, mine, by_rank))
        return RuntimeError("mismatch")

    rank0 = SimpleNamespace(rank=0, _mismatch=mismatch)
    fp, seq = (11, 22, 8), 5
    check = ex.Exchange.owed_check(rank0, seq, fp, "broadcast")  # type: ignore[arg-type]

    def header(seq: int, fp: tuple[int, int, int]) -> memoryview:
        return memoryview(struct.pack("<8q", ex._MAGIC, seq, *fp, -1, 0, 0))

    check(header(seq, fp))  # the same op: nothing to say
    assert seen == []
    with pytest.raises(RuntimeError, match="mismatch"):
        check(header(seq, (11, 22, 9)))
    assert seen == [("broadcast", (fp, seq), [(fp, seq), ((11, 22, 9), seq)])]
    for not_a_header in (memoryview(bytes(64)), memoryview(struct.pack("<2q", ex._MAGIC, seq))):
        with pytest.raises(LaneProtocolError, match="rank 1 sent a frame without an op header"):
            check(not_a_header)
