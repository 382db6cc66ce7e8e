"""Split semantics, point-to-point, issue order / async semantics, many comms, per-op options.

Covers §3.1 (``split``: list order is rank order, ``[]`` gives ``None``, nested splits, repeated
and same-name splits, children and parents used side by side and finalized in any order), §3
``send``/``recv`` and §3.2 ``BatchSendRecv`` (dtypes, sizes from 0 elements to 1 MiB, rings in
both directions, in-order matching, many outstanding async receives, mutually dependent
irecv-then-send pairs), §2.3 work semantics (issue order of async ops, a sync op after async
ones, ``wait()`` twice, ``wait_blocking()``), several communicators alive at once (with and
without a store), and upstream's OptionsTest (``hints``/``timeout`` accepted by every op).

Every rank function is module-level (the harness pickles it by reference) and returns a short
summary so the test can also assert on what each rank saw.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import pytest
import torch

from tests.harness import RankContext, run_ranks
from torchcomms import (
    BatchP2POptions,
    P2POpType,
    ReduceOp,
    TorchComm,
    TorchWork,
    new_comm,
)

CPU = torch.device("cpu")
TIMEOUT = 120.0
HINTS = {"hint_key": "hint_value"}
OP_TIMEOUT = timedelta(seconds=600)


def _comm(ctx: RankContext, name: str, **kwargs: Any) -> TorchComm:
    return new_comm("gloo", CPU, name=name, store=ctx.store, **kwargs)


def _pattern(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Integer-valued data (exact in every dtype, even bf16) that depends on ``seed``."""
    base = (torch.arange(numel, dtype=torch.int64) * 7 + seed * 13) % 61
    if dtype is torch.bool:
        return (base % 2 == seed % 2).contiguous()
    return base.to(dtype)


def _blank(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A receive buffer whose content no correct transfer in these tests produces."""
    if dtype is torch.bool:
        return torch.zeros(numel, dtype=dtype)
    return torch.full((numel,), 99, dtype=dtype)


# ------------------------------------------------------------------------------------ split


def _group_of(groups: Sequence[Sequence[int]], rank: int) -> list[int]:
    for group in groups:
        if rank in group:
            return list(group)
    return []


def _check_member(
    comm: TorchComm | None, members: list[int], world_rank: int, name: str, case: str
) -> None:
    """``comm`` is this rank's view of the group ``members`` (world ranks, in child-rank order)."""
    assert comm is not None, f"{case}: rank {world_rank} in {members} got None"
    assert comm.get_rank() == members.index(world_rank), (
        f"{case}: rank {comm.get_rank()}, expected {members.index(world_rank)}"
    )
    assert comm.get_size() == len(members), f"{case}: size {comm.get_size()}"
    assert comm.get_name() == name, f"{case}: name {comm.get_name()!r}"
    # Each member contributes its own bit: the sum names exactly the member set.
    bits = torch.tensor([1 << world_rank], dtype=torch.int64)
    comm.all_reduce(bits, ReduceOp.SUM, False)
    assert bits.item() == sum(1 << m for m in members), f"{case}: member bits {bits.item()}"
    # The gather is rank-major, so it lists the members in child-rank order.
    order = torch.full((len(members),), -1, dtype=torch.int64)
    comm.all_gather_single(order, torch.tensor([world_rank], dtype=torch.int64), False)
    assert order.tolist() == members, f"{case}: all_gather_single order {order.tolist()}"


def _split_case(
    parent: TorchComm,
    groups: Sequence[Sequence[int]],
    name: str,
    to_world: Sequence[int],
    world_rank: int,
    case: str,
) -> tuple[TorchComm | None, list[int]]:
    """Split ``parent`` (groups in parent ranks) and check the child; return it and its world ranks."""
    mine = _group_of(groups, parent.get_rank())
    child = parent.split(mine, name)
    if not mine:
        assert child is None, f"{case}: rank {world_rank} passed [] but got {child!r}"
        return None, []
    members = [to_world[r] for r in mine]
    _check_member(child, members, world_rank, name, case)
    return child, members


def _split_semantics(ctx: RankContext) -> dict[str, Any]:
    r = ctx.rank
    world = _comm(ctx, "world")
    ident = list(range(4))
    live: list[tuple[str, TorchComm, list[int]]] = []
    seen: dict[str, Any] = {}

    def case(groups: Sequence[Sequence[int]], name: str, label: str) -> TorchComm | None:
        child, members = _split_case(world, groups, name, ident, r, label)
        seen[label] = None if child is None else (child.get_rank(), child.get_size())
        if child is not None:
            live.append((label, child, members))
        return child

    contig = case([[0, 1], [2, 3]], "contig", "contiguous")
    case([[0, 2], [1, 3]], "rr", "round-robin")
    case([[3, 1], [2, 0]], "order", "list order")
    case([[1, 2, 3]], "partial", "rank 0 passes []")
    case([[2]], "single", "one member, others pass []")
    full = case([[0, 1, 2, 3]], "full", "size equals parent")
    case([[2, 0, 3, 1]], "full_perm", "size equals parent, permuted")
    case([[0, 1], [2, 3]], "shared", "same name, first lists")
    case([[0, 3], [1, 2]], "shared", "same name, second lists")
    case([[3, 2, 1, 0]], "shared", "same name, third list")
    twice_a = case([[1, 0], [3, 2]], "twice", "repeated split, first")
    twice_b = case([[1, 0], [3, 2]], "twice", "repeated split, second")
    assert twice_a is not None and twice_b is not None and twice_a is not twice_b

    # Nested: world -> reversed -> halves (reversed again) -> pairs -> singletons.
    rev, rev_world = _split_case(world, [[3, 2, 1, 0]], "rev", ident, r, "nested level 1")
    assert rev is not None
    half, half_world = _split_case(rev, [[1, 0], [2, 3]], "half", rev_world, r, "nested level 2")
    assert half is not None
    leaf, leaf_world = _split_case(half, [[1, 0]], "leaf", half_world, r, "nested level 3")
    assert leaf is not None
    solo, _ = _split_case(leaf, [[0], [1]], "solo", leaf_world, r, "nested level 4")
    assert solo is not None
    # A split of a split where one member opts out.
    opt, _ = _split_case(half, [[0]], "opt", half_world, r, "nested, member passes []")
    if half.get_rank() == 0:
        assert opt is not None
        live.append(("nested opt-out", opt, [r]))
    else:
        assert opt is None
    live += [("nested 1", rev, rev_world), ("nested 2", half, half_world)]
    live += [("nested 3", leaf, leaf_world), ("nested 4", solo, [r])]
    seen["rev"] = rev.get_rank()
    seen["half_world"] = half_world

    # The two identical splits are independent: different data in flight at once.
    a = torch.tensor([r + 1], dtype=torch.int64)
    b = torch.tensor([10 * (r + 1)], dtype=torch.int64)
    wa = twice_a.all_reduce(a, ReduceOp.SUM, True)
    wb = twice_b.all_reduce(b, ReduceOp.SUM, True)
    wb.wait()
    wa.wait()
    pair_sum = 3 if r < 2 else 7  # ranks {0,1} -> 1+2, ranks {2,3} -> 3+4
    assert (a.item(), b.item()) == (pair_sum, 10 * pair_sum), "repeated split independence"

    # Parent and children interleaved: async on all of them, then sync ops alternating.
    works: list[tuple[str, TorchWork, torch.Tensor, int]] = []
    wt = torch.tensor([1 << r], dtype=torch.int64)
    works.append(("world", world.all_reduce(wt, ReduceOp.SUM, True), wt, 15))
    for label, comm, members in live:
        t = torch.tensor([1 << r], dtype=torch.int64)
        works.append(
            (label, comm.all_reduce(t, ReduceOp.SUM, True), t, sum(1 << m for m in members))
        )
    wt2 = torch.tensor([r], dtype=torch.int64)
    works.append(("world again", world.all_reduce(wt2, ReduceOp.MAX, True), wt2, 3))
    for label, work, t, expected in works:
        work.wait()
        assert t.item() == expected, f"interleaved async on {label}: {t.item()} != {expected}"
    assert contig is not None and full is not None
    for step in range(3):
        t = torch.tensor([r + step], dtype=torch.int64)
        world.all_reduce(t, ReduceOp.SUM, False)
        assert t.item() == 6 + 4 * step
        t = torch.tensor([r + step], dtype=torch.int64)
        contig.all_reduce(t, ReduceOp.SUM, False)
        assert t.item() == (1 if r < 2 else 5) + 2 * step
        t = torch.tensor([r * step], dtype=torch.int64)
        full.broadcast(t, 3, False)
        assert t.item() == 3 * step

    # Finalize in mixed orders: the parent first while its children still work, then
    # children in an order that is neither creation order nor its reverse.
    world.finalize()
    rev.finalize()  # parent of half/leaf/solo
    for label, comm, members in live:
        if comm is rev:
            continue
        _check_member(comm, members, r, comm.get_name(), f"{label} after parents finalized")
    leaf.finalize()  # before its child solo and after its parent half is still alive
    _check_member(solo, [r], r, "solo", "solo after leaf finalized")
    half.finalize()
    order = [c for _, c, _ in live if c not in (rev, leaf, half)]
    for comm in order[1::2] + order[0::2]:
        comm.finalize()
    return seen


def test_split_semantics() -> None:
    """Groups, rank order, None for [], nested/repeated/same-name splits, mixed finalize order."""
    seen = run_ranks(_split_semantics, 4, timeout=TIMEOUT)
    assert [s["contiguous"] for s in seen] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert [s["round-robin"] for s in seen] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    # [3, 1] and [2, 0]: parent rank 3 is child rank 0, parent rank 1 is child rank 1.
    assert [s["list order"] for s in seen] == [(1, 2), (1, 2), (0, 2), (0, 2)]
    assert [s["rank 0 passes []"] for s in seen] == [None, (0, 3), (1, 3), (2, 3)]
    assert [s["one member, others pass []"] for s in seen] == [None, None, (0, 1), None]
    assert [s["size equals parent, permuted"] for s in seen] == [(1, 4), (3, 4), (0, 4), (2, 4)]
    assert [s["rev"] for s in seen] == [3, 2, 1, 0]
    assert [s["half_world"] for s in seen] == [[1, 0], [1, 0], [2, 3], [2, 3]]


# ------------------------------------------------------------------------------ send / recv

P2P_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
)


def _p2p_sizes(dtype: torch.dtype) -> list[int]:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return [0, 1, 1000, (1 << 20) // itemsize]  # the last one is exactly 1 MiB


def _send_recv_dtypes(ctx: RankContext) -> int:
    r = ctx.rank
    peer = r ^ 1  # pairs (0, 1) and (2, 3)
    comm = _comm(ctx, "p2p")
    checked = 0
    for d, dtype in enumerate(P2P_DTYPES):
        for numel in _p2p_sizes(dtype):
            for async_op in (False, True):
                case = f"{dtype} numel={numel} async={async_op}"
                seed = d * 10 + numel % 7 + (5 if async_op else 0)
                mine = _pattern(numel, dtype, seed + 100 * r)
                got = _blank(numel, dtype)
                if async_op:
                    w_recv = comm.recv(got, peer, True)
                    w_send = comm.send(mine, peer, True)
                    w_send.wait()
                    w_recv.wait()
                    assert w_recv.is_completed() and w_send.is_completed(), case
                elif r % 2 == 0:
                    comm.send(mine, peer, False)
                    comm.recv(got, peer, False)
                else:
                    comm.recv(got, peer, False)
                    comm.send(mine, peer, False)
                expected = _pattern(numel, dtype, seed + 100 * peer)
                assert got.dtype == dtype and torch.equal(got, expected), case
                assert torch.equal(mine, _pattern(numel, dtype, seed + 100 * r)), f"{case}: send"
                checked += 1
    # A multi-dimensional tensor keeps its shape on the receiving side.
    mine2 = _pattern(15, torch.float32, r).view(3, 5)
    got2 = torch.zeros(3, 5)
    w = comm.recv(got2, peer, True)
    comm.send(mine2, peer, False)
    w.wait()
    torch.testing.assert_close(got2, _pattern(15, torch.float32, peer).view(3, 5), rtol=0, atol=0)
    comm.finalize()
    return checked


#: The default placement (shm on this host) and the tcp path (``transport/tcp/p2p.py``).
P2P_TRANSPORTS = [
    pytest.param({}, id="auto"),
    pytest.param({"TORCHCOMM_TRANSPORT": "tcp"}, id="tcp"),
]


@pytest.mark.parametrize("env", P2P_TRANSPORTS)
def test_send_recv_dtypes_and_sizes(env: dict[str, str]) -> None:
    """Sync and async send/recv for every gloo dtype, 0 elements up to 1 MiB."""
    checked = run_ranks(_send_recv_dtypes, 4, timeout=TIMEOUT, env=env)
    assert checked == [len(P2P_DTYPES) * 4 * 2] * 4


def _batch_ring(ctx: RankContext) -> list[str]:
    r, n = ctx.rank, ctx.world_size
    comm = _comm(ctx, "ring")
    done: list[str] = []
    for direction in (+1, -1):
        for async_op in (False, True):
            case = f"ring direction={direction:+d} async={async_op}"
            dst, src = (r + direction) % n, (r - direction) % n
            out = _pattern(64, torch.int32, r)
            got = _blank(64, torch.int32)
            batch = comm.batch_op_create()
            batch.send(out, dst)
            batch.recv(got, src)
            assert [(op.type, op.peer) for op in batch.ops] == [
                (P2POpType.SEND, dst),
                (P2POpType.RECV, src),
            ], case
            work = batch.issue(async_op)
            work.wait()
            assert torch.equal(got, _pattern(64, torch.int32, src)), case
            done.append(case)

    # Both directions in one batch (recv listed first on odd ranks: order within a batch is free).
    for async_op in (False, True):
        case = f"bidirectional async={async_op}"
        nxt, prv = (r + 1) % n, (r - 1) % n
        from_prv = _blank(8, torch.float64)
        from_nxt = _blank(8, torch.float64)
        batch = comm.batch_op_create()
        if r % 2:
            batch.recv(from_prv, prv)
            batch.recv(from_nxt, nxt)
        batch.send(_pattern(8, torch.float64, 10 * r + 1), nxt)
        batch.send(_pattern(8, torch.float64, 10 * r + 2), prv)
        if not r % 2:
            batch.recv(from_prv, prv)
            batch.recv(from_nxt, nxt)
        batch.issue(async_op).wait()
        assert torch.equal(from_prv, _pattern(8, torch.float64, 10 * prv + 1)), case
        assert torch.equal(from_nxt, _pattern(8, torch.float64, 10 * nxt + 2)), case
        done.append(case)

    # Several sends to one peer in one batch match that peer's receives in order.
    for async_op in (False, True):
        case = f"same-peer ordering async={async_op}"
        dst, src = (r + 1) % n, (r - 1) % n
        outs = [torch.full((5,), 1000 * r + k, dtype=torch.int64) for k in range(4)]
        ins = [torch.full((5,), -1, dtype=torch.int64) for _ in range(4)]
        batch = comm.batch_op_create()
        for k in range(4):
            batch.recv(ins[k], src)
            batch.send(outs[k], dst)
        work = batch.issue(async_op)
        work.wait()
        for k in range(4):
            assert ins[k].tolist() == [1000 * src + k] * 5, f"{case}: message {k}"
        done.append(case)

    # Sends and batches on one comm keep matching in order across separate issues too.
    first = comm.batch_op_create()
    second = comm.batch_op_create()
    a, b = torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
    first.send(torch.full((3,), r * 10 + 1, dtype=torch.int64), (r + 1) % n)
    first.recv(a, (r - 1) % n)
    second.send(torch.full((3,), r * 10 + 2, dtype=torch.int64), (r + 1) % n)
    second.recv(b, (r - 1) % n)
    w1 = first.issue(True)
    w2 = second.issue(True)
    w2.wait()
    w1.wait()
    prv = (r - 1) % n
    assert a.tolist() == [prv * 10 + 1] * 3 and b.tolist() == [prv * 10 + 2] * 3
    done.append("two async batches")
    comm.finalize()
    return done


@pytest.mark.parametrize("env", P2P_TRANSPORTS)
def test_batch_ring_and_ordering(env: dict[str, str]) -> None:
    """batch_op_create rings in both directions, sync and async; same-peer sends match in order."""
    done = run_ranks(_batch_ring, 4, timeout=TIMEOUT, env=env)
    assert all(d == done[0] for d in done) and len(done[0]) == 9


def _async_p2p_patterns(ctx: RankContext) -> None:
    r = ctx.rank
    peer = r ^ 1
    comm = _comm(ctx, "p2p_async")
    count = 16
    # Upstream SendRecvTest: the receiver posts many irecvs before the sender sends anything.
    for receiver in (0, 1):
        bufs = [torch.full((i + 1,), -1.0) for i in range(count)]
        if r % 2 == receiver:
            works = [comm.recv(bufs[i], peer, True) for i in range(count)]
            comm.barrier(False)
            for w in works:
                w.wait()
            for i, buf in enumerate(bufs):
                expected = torch.full((i + 1,), float(100 * peer + i))
                torch.testing.assert_close(buf, expected, rtol=0, atol=0)
        else:
            comm.barrier(False)
            works = [
                comm.send(torch.full((i + 1,), float(100 * r + i)), peer, True)
                for i in range(count)
            ]
            for w in reversed(works):  # waiting in any order is fine
                w.wait()

    # Mutually dependent pairs: both ranks irecv, then send, then wait the recv. The async recv
    # is posted immediately, so the (sync or async) sends cannot deadlock.
    for send_async in (False, True):
        got = torch.zeros(4, dtype=torch.int64)
        w_recv = comm.recv(got, peer, True)
        w_send = comm.send(torch.arange(4, dtype=torch.int64) + 10 * r, peer, send_async)
        w_send.wait()
        w_recv.wait()
        assert got.tolist() == [10 * peer + i for i in range(4)], f"send_async={send_async}"

    # Many outstanding async exchanges in both directions at once, waited at the end.
    sends, recvs = [], []
    bufs = [torch.zeros(2, dtype=torch.int32) for _ in range(count)]
    for i in range(count):
        recvs.append(comm.recv(bufs[i], peer, True))
        sends.append(comm.send(torch.tensor([r, i], dtype=torch.int32), peer, True))
    for w in sends + recvs:
        w.wait()
    assert [b.tolist() for b in bufs] == [[peer, i] for i in range(count)]
    comm.finalize()


@pytest.mark.parametrize("env", P2P_TRANSPORTS)
def test_async_p2p_patterns(env: dict[str, str]) -> None:
    """Many outstanding irecvs, and irecv-then-send on both sides of a pair."""
    run_ranks(_async_p2p_patterns, 4, timeout=TIMEOUT, env=env)


# ------------------------------------------------------------------ issue order / async work


def _issue_order(ctx: RankContext) -> None:
    r, n = ctx.rank, ctx.world_size
    total = n * (n + 1) // 2
    comm = _comm(ctx, "order")
    for _ in range(2):  # twice: results must not depend on timing
        a = torch.tensor([r + 1], dtype=torch.int64)
        g = torch.full((n,), -1, dtype=torch.int64)
        h = torch.full((n,), -1, dtype=torch.int64)
        o = torch.full((1,), -1, dtype=torch.int64)
        s = torch.full((1,), -1, dtype=torch.int64)
        gl = [torch.full((1,), -1, dtype=torch.int64) for _ in range(n)] if r == 0 else []
        al = [torch.full((1,), -1, dtype=torch.int64) for _ in range(n)]
        works = [
            comm.all_gather_single(g, a, True),  # g = [1..n] (reads a before the next op)
            comm.all_reduce(a, ReduceOp.SUM, True),  # a = total (must not leak into g)
            comm.all_to_all_single(h, g, True),  # h = [r+1]*n (reads g)
            comm.broadcast(h, 2, True),  # h = [3]*n
            comm.reduce_scatter_single(o, h, ReduceOp.SUM, True),  # o = [3n]
            comm.barrier(True),
            # Root 3 scatters views of g: they are read when the op runs, after g was written.
            comm.scatter(s, [g[i : i + 1] for i in range(n)] if r == 3 else [], 3, True),
            comm.gather(gl, s, 0, True),  # root 0: [[1], ..., [n]]
            comm.all_gather(al, o, True),  # each [3n]
        ]
        # A sync op right after reads what the last async ops wrote.
        # s was written by the async scatter; the sync op must see that value.
        comm.all_reduce(s, ReduceOp.SUM, False)
        assert s.item() == total, f"sync after async saw {s.item()}"
        for w in works:
            w.wait()
            w.wait()  # a second wait is a no-op
            assert w.is_completed()
        assert g.tolist() == list(range(1, n + 1)), f"g={g.tolist()}"
        assert a.item() == total
        assert h.tolist() == [3] * n
        assert o.item() == 3 * n
        if r == 0:
            assert [t.item() for t in gl] == list(range(1, n + 1))
        assert [t.item() for t in al] == [3 * n] * n

    # wait_blocking: a no-op on a sync op's (completed) work, unsupported on async works,
    # before and after wait().
    t = torch.ones(3)
    sync_work = comm.all_reduce(t, ReduceOp.SUM, False)
    assert sync_work.is_completed()
    sync_work.wait_blocking()
    sync_work.wait()
    torch.testing.assert_close(t, torch.full((3,), float(n)), rtol=0, atol=0)
    async_work = comm.all_reduce(t, ReduceOp.SUM, True)
    with pytest.raises(RuntimeError, match="waitBlocking not implemented"):
        async_work.wait_blocking()
    async_work.wait()
    with pytest.raises(RuntimeError, match="waitBlocking not implemented"):
        async_work.wait_blocking()
    torch.testing.assert_close(t, torch.full((3,), float(n * n)), rtol=0, atol=0)
    comm.finalize()


def test_async_issue_order_and_work_semantics() -> None:
    """Async ops run in issue order; a later sync op sees them; wait twice; wait_blocking."""
    run_ranks(_issue_order, 4, timeout=TIMEOUT)


def _many_comms(ctx: RankContext) -> None:
    r, n = ctx.rank, ctx.world_size
    total = n * (n + 1) // 2
    comms = [
        _comm(ctx, "mc_a"),
        new_comm("gloo", CPU, name="mc_b"),  # store-less: MASTER_ADDR / MASTER_PORT
        new_comm("gloo", CPU, name="mc_c", store=None),  # back to back on the same port
        _comm(ctx, "mc_d"),
    ]
    assert [c.get_name() for c in comms] == ["mc_a", "mc_b", "mc_c", "mc_d"]
    assert all(c.get_rank() == r and c.get_size() == n for c in comms)
    pending: list[tuple[str, TorchWork, torch.Tensor, list[int]]] = []
    for rnd in range(3):
        # Each rank walks the comms in its own order: async ops of different comms are
        # independent, so no cross-rank agreement on that order is needed.
        order = list(range(len(comms)))
        order = order[r % len(order) :] + order[: r % len(order)]
        if r % 2:
            order.reverse()
        for k in order:
            scale = (k + 1) * (rnd + 1)
            t = torch.tensor([(r + 1) * scale], dtype=torch.int64)
            pending.append(
                (
                    f"comm {k} round {rnd} all_reduce",
                    comms[k].all_reduce(t, ReduceOp.SUM, True),
                    t,
                    [total * scale],
                )
            )
            out = torch.full((n,), -1, dtype=torch.int64)
            inp = torch.tensor([r * 10 + k], dtype=torch.int64)
            pending.append(
                (
                    f"comm {k} round {rnd} all_gather_single",
                    comms[k].all_gather_single(out, inp, True),
                    out,
                    [i * 10 + k for i in range(n)],
                )
            )
    for label, work, t, expected in pending:
        work.wait()
        assert t.tolist() == expected, f"{label}: {t.tolist()} != {expected}"
    # Sync ops on every comm afterwards still agree.
    for k, c in enumerate(comms):
        t = torch.tensor([r + k], dtype=torch.int64)
        c.all_reduce(t, ReduceOp.MAX, False)
        assert t.item() == n - 1 + k
    for c in reversed(comms):
        c.finalize()


def test_many_comms_interleaved() -> None:
    """Four comms on three ranks (with and without a store), async ops interleaved across them."""
    run_ranks(_many_comms, 3, timeout=TIMEOUT)


# ------------------------------------------------------------------------------ options


def _every_op_with_options(ctx: RankContext) -> list[str]:
    r, n = ctx.rank, ctx.world_size
    total = n * (n + 1) // 2
    comm = _comm(ctx, "opts", hints=dict(HINTS), timeout=OP_TIMEOUT)
    kw: dict[str, Any] = {"hints": dict(HINTS), "timeout": OP_TIMEOUT}
    i64 = torch.int64
    done: list[str] = []
    for async_op in (False, True):

        def finish(work: TorchWork, op: str, _a: bool = async_op) -> None:
            assert isinstance(work, TorchWork), op
            work.wait()
            done.append(f"{op} async={_a}")

        t = torch.tensor([r + 1], dtype=i64)
        finish(comm.all_reduce(t, ReduceOp.SUM, async_op, **kw), "all_reduce")
        assert t.item() == total

        t = torch.tensor([r], dtype=i64)
        finish(comm.broadcast(t, 1, async_op, **kw), "broadcast")
        assert t.item() == 1

        t = torch.tensor([r + 1], dtype=i64)
        finish(comm.reduce(t, 0, ReduceOp.SUM, async_op, **kw), "reduce")
        if r == 0:
            assert t.item() == total

        outs = [torch.full((2,), -1, dtype=i64) for _ in range(n)]
        finish(comm.all_gather(outs, torch.full((2,), r, dtype=i64), async_op, **kw), "all_gather")
        assert [o.tolist() for o in outs] == [[i, i] for i in range(n)]

        outs = [torch.full((i + 1,), -1, dtype=i64) for i in range(n)]
        inp = torch.full((r + 1,), r, dtype=i64)
        finish(comm.all_gather_v(outs, inp, async_op, **kw), "all_gather_v")
        assert [o.tolist() for o in outs] == [[i] * (i + 1) for i in range(n)]

        out = torch.full((n,), -1, dtype=i64)
        finish(
            comm.all_gather_single(out, torch.tensor([r], dtype=i64), async_op, **kw),
            "all_gather_single",
        )
        assert out.tolist() == list(range(n))

        out = torch.full((1,), -1, dtype=i64)
        ins = [torch.tensor([(r + 1) * (i + 1)], dtype=i64) for i in range(n)]
        finish(comm.reduce_scatter(out, ins, ReduceOp.SUM, async_op, **kw), "reduce_scatter")
        assert out.item() == (r + 1) * total

        out = torch.full((r + 1,), -1, dtype=i64)
        ins = [torch.full((i + 1,), r + 1, dtype=i64) for i in range(n)]
        finish(comm.reduce_scatter_v(out, ins, ReduceOp.SUM, async_op, **kw), "reduce_scatter_v")
        assert out.tolist() == [total] * (r + 1)

        out = torch.full((1,), -1, dtype=i64)
        inp = torch.tensor([(r + 1) * (i + 1) for i in range(n)], dtype=i64)
        finish(
            comm.reduce_scatter_single(out, inp, ReduceOp.SUM, async_op, **kw),
            "reduce_scatter_single",
        )
        assert out.item() == (r + 1) * total

        out = torch.full((n,), -1, dtype=i64)
        inp = torch.tensor([r * n + i for i in range(n)], dtype=i64)
        finish(comm.all_to_all_single(out, inp, async_op, **kw), "all_to_all_single")
        assert out.tolist() == [j * n + r for j in range(n)]

        in_splits = [j + 1 for j in range(n)]  # rank r sends j+1 rows to rank j
        out_splits = [r + 1] * n  # and receives r+1 rows from everyone
        inp = torch.cat([torch.full((j + 1, 2), 100 * r + j, dtype=i64) for j in range(n)])
        out = torch.full(((r + 1) * n, 2), -1, dtype=i64)
        finish(
            comm.all_to_all_v_single(out, inp, out_splits, in_splits, async_op, **kw),
            "all_to_all_v_single",
        )
        expected = torch.cat([torch.full((r + 1, 2), 100 * j + r, dtype=i64) for j in range(n)])
        assert torch.equal(out, expected)

        outs = [torch.full((1,), -1, dtype=i64) for _ in range(n)]
        ins = [torch.tensor([r * n + j], dtype=i64) for j in range(n)]
        finish(comm.all_to_all(outs, ins, async_op, **kw), "all_to_all")
        assert [o.item() for o in outs] == [j * n + r for j in range(n)]

        finish(comm.barrier(async_op, **kw), "barrier")

        out = torch.full((1,), -1, dtype=i64)
        ins = [torch.tensor([7 * i], dtype=i64) for i in range(n)] if r == 2 else []
        finish(comm.scatter(out, ins, 2, async_op, **kw), "scatter")
        assert out.item() == 7 * r

        outs = [torch.full((1,), -1, dtype=i64) for _ in range(n)] if r == 3 else []
        finish(comm.gather(outs, torch.tensor([r], dtype=i64), 3, async_op, **kw), "gather")
        if r == 3:
            assert [o.item() for o in outs] == list(range(n))

        out = torch.full((n,), -1, dtype=i64) if r == 0 else torch.empty(0, dtype=i64)
        finish(
            comm.gather_single(out, torch.tensor([r], dtype=i64), 0, async_op, **kw),
            "gather_single",
        )
        if r == 0:
            assert out.tolist() == list(range(n))

        peer = r ^ 1
        got = torch.full((2,), -1, dtype=i64)
        w_recv = comm.recv(got, peer, True, **kw) if async_op else None
        mine = torch.tensor([r, 1], dtype=i64)
        if async_op:
            finish(comm.send(mine, peer, True, **kw), "send")
            assert w_recv is not None
            finish(w_recv, "recv")
        elif r % 2 == 0:
            finish(comm.send(mine, peer, False, **kw), "send")
            finish(comm.recv(got, peer, False, **kw), "recv")
        else:
            finish(comm.recv(got, peer, False, **kw), "recv")
            finish(comm.send(mine, peer, False, **kw), "send")
        assert got.tolist() == [peer, 1]

        options = BatchP2POptions()
        options.hints = dict(HINTS)
        options.timeout = OP_TIMEOUT
        got = torch.full((1,), -1, dtype=i64)
        batch = comm.batch_op_create()
        batch.send(torch.tensor([r], dtype=i64), (r + 1) % n)
        batch.recv(got, (r - 1) % n)
        finish(batch.issue(async_op, options), "batch_op_issue")
        assert got.item() == (r - 1) % n

    child = comm.split([r ^ 1, r] if r % 2 else [r, r ^ 1], "opts_child", **kw)
    assert child is not None and child.get_size() == 2 and child.get_rank() == r % 2
    t = torch.tensor([r], dtype=i64)
    child.all_reduce(t, ReduceOp.SUM, False, **kw)
    assert t.item() == 2 * (r - r % 2) + 1
    done.append("split")
    child.finalize()
    # Rank 0 serves the comm's store: the other pair may still be creating its split.
    comm.barrier(False)
    comm.finalize()
    return done


def test_hints_and_timeout_accepted_by_every_op() -> None:
    """Upstream OptionsTest: unknown hints and a 600 s timeout are accepted by every op."""
    done = [sorted(d) for d in run_ranks(_every_op_with_options, 4, timeout=TIMEOUT)]
    assert all(d == done[0] for d in done)
    assert len(done[0]) == 2 * 19 + 1


def _tag_hints(ctx: RankContext) -> list[float]:
    """The gloo ``tag`` hint: tagged messages match by tag; a bad tag is refused up front."""
    from torchcomms import CommValidationError

    comm = new_comm("gloo", torch.device("cpu"), name="tags", store=ctx.store)
    peer = 1 - ctx.rank
    for bad, message in (("x", "must be an integer, got 'x'"), ("-1", "must be >= 0, got -1")):
        with pytest.raises(CommValidationError, match=message):
            comm.send(torch.ones(1), peer, False, hints={"tag": bad})
    got = []
    if ctx.rank == 0:
        works = [
            comm.send(torch.tensor([float(v)]), 1, True, hints={"tag": str(v)}) for v in (1, 2)
        ]
        for w in works:
            w.wait()
    else:
        second, first = torch.zeros(1), torch.zeros(1)
        w2 = comm.recv(second, 0, True, hints={"tag": "2"})  # posted first, matches tag 2
        w1 = comm.recv(first, 0, True, hints={"tag": "1"})
        w2.wait()
        w1.wait()
        got = [first.item(), second.item()]
    comm.finalize()
    return got


@pytest.mark.parametrize("env", P2P_TRANSPORTS)
def test_tag_hint_matches_by_tag_and_rejects_bad_tags(env: dict[str, str]) -> None:
    assert run_ranks(_tag_hints, 2, timeout=60.0, env=env)[1] == [1.0, 2.0]
