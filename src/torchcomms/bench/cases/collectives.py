"""The collectives' and send/recv's cases: inputs, expected outputs and the three calls
(ours, raw gloo, MPI) on the same buffers, one builder per op."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch._C._distributed_c10d as c10d

from torchcomms import ReduceOp, TorchComm
from torchcomms.bench import mpi as mpib
from torchcomms.bench.cases.case import _P2P_TAG, REDOPS, Case, CaseParams


# -- patterns ------------------------------------------------------------------------------------
def _modulus(redop: str) -> int:
    return 2 if redop == "prod" else 5


def _periodic(values: list[int], count: int, dtype: torch.dtype) -> torch.Tensor:
    base = torch.tensor(values, dtype=torch.int64).to(dtype)
    reps = -(-count // len(values)) if count else 0
    return base.repeat(reps)[:count].clone()


def _rank_values(rank: int, m: int) -> list[int]:
    return [(j + rank) % m + 1 for j in range(m)]


def _pattern(rank: int, m: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's reduction input: ``(i + rank) % m + 1``."""
    return _periodic(_rank_values(rank, m), count, dtype)


def _reduced(p: CaseParams, count: int) -> torch.Tensor:
    """The reduction of every rank's ``_pattern`` over ``count`` elements."""
    m = _modulus(p.redop)
    combine = REDOPS[p.redop][2]
    acc = _rank_values(0, m)
    for r in range(1, p.nranks):
        acc = [combine(a, b) for a, b in zip(acc, _rank_values(r, m), strict=True)]
    return _periodic(acc, count, p.dtype)


def _payload(tag: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """A non-reduced payload that says where it came from: values 1..80, ``tag`` mod 16."""
    return _periodic([j + 1 + 5 * (tag % 16) for j in range(5)], count, dtype)


def _mismatches(got: torch.Tensor, expected: torch.Tensor) -> int:
    return int((got.reshape(-1) != expected.reshape(-1)).sum().item())


def _bump(t: torch.Tensor) -> Callable[[], None]:
    def corrupt() -> None:
        flat = t.view(-1)
        flat[0] = flat[0] + 1

    return corrupt


def _compared(
    ours: Callable[[TorchComm], None],
    gloo: Callable[[Any], None],
    reset: Callable[[], None],
    out: torch.Tensor,
    expected: torch.Tensor,
    mpi: Callable[[Any], None] | None = None,
) -> Case:
    """A case checked by comparing ``out`` with ``expected`` (its test switch damages ``out``)."""
    return Case(
        ours=ours,
        gloo=gloo,
        reset=reset,
        wrong=lambda: _mismatches(out, expected),
        corrupt=_bump(out),
        mpi=mpi,
    )


def _mpi_buffer(p: CaseParams, t: torch.Tensor, reduce: bool) -> Any | None:
    """MPI's view of ``t`` under ``--vs mpi``; None otherwise (then no MPI call ever runs)."""
    return mpib.buffer(t, reduce) if p.vs_mpi else None


def _mpi_in_place(p: CaseParams) -> Any | None:
    return mpib.in_place() if p.vs_mpi else None


def _ours_op(p: CaseParams) -> ReduceOp:
    return REDOPS[p.redop][0]


def _gloo_op(p: CaseParams) -> Any:
    return REDOPS[p.redop][1]


# -- builders ------------------------------------------------------------------------------------
def _in_place_reduction(
    p: CaseParams,
    rooted: bool,
    ours_on: Callable[[TorchComm, torch.Tensor], None],
    gloo_on: Callable[[Any, torch.Tensor], None],
    mpi_on: Callable[[Any, Any], None],
) -> Case:
    """Shared by all_reduce and reduce: the API is in place; out-of-place copies in first,
    then runs the op on the buffer (``ours_on(comm, buf)``, ``gloo_on(pg, buf)``)."""
    src = _pattern(p.rank, _modulus(p.redop), p.count, p.dtype)
    expected = _reduced(p, p.count)
    buf = torch.empty_like(src)
    checks = not rooted or p.rank == p.root

    def reset() -> None:
        if p.in_place:
            buf.copy_(src)
        else:
            buf.zero_()

    def wrong() -> int:
        return _mismatches(buf, expected) if checks else 0

    def ours(comm: TorchComm) -> None:
        if not p.in_place:
            buf.copy_(src)
        ours_on(comm, buf)

    def gloo(pg: Any) -> None:
        if not p.in_place:
            buf.copy_(src)
        gloo_on(pg, buf)

    view = _mpi_buffer(p, buf, True)

    def mpi(world: Any) -> None:
        if not p.in_place:
            buf.copy_(src)
        mpi_on(world, view)

    return Case(
        ours=ours,
        gloo=gloo,
        reset=reset,
        wrong=wrong,
        corrupt=_bump(buf),
        mpi=mpi if view is not None else None,
    )


def _noop_comm(_: Any) -> None:
    return None


def _build_all_reduce(p: CaseParams) -> Case:
    op, gop = _ours_op(p), _gloo_op(p)

    def ours(comm: TorchComm, buf: torch.Tensor) -> None:
        comm.all_reduce(buf, op, False)

    def gloo(pg: Any, buf: torch.Tensor) -> None:
        o = c10d.AllreduceOptions()
        o.reduceOp = gop
        pg.allreduce([buf], o).wait()

    def mpi(world: Any, view: Any) -> None:
        world.Allreduce(mpib.in_place(), view, mpib.op(p.redop))

    return _in_place_reduction(p, False, ours, gloo, mpi)


def _build_reduce(p: CaseParams) -> Case:
    op, gop = _ours_op(p), _gloo_op(p)

    def ours(comm: TorchComm, buf: torch.Tensor) -> None:
        comm.reduce(buf, p.root, op, False)

    def gloo(pg: Any, buf: torch.Tensor) -> None:
        o = c10d.ReduceOptions()
        o.reduceOp = gop
        o.rootRank = p.root
        pg.reduce([buf], o).wait()

    def mpi(world: Any, view: Any) -> None:
        if p.rank == p.root:
            world.Reduce(mpib.in_place(), view, mpib.op(p.redop), p.root)
        else:
            world.Reduce(view, None, mpib.op(p.redop), p.root)

    return _in_place_reduction(p, True, ours, gloo, mpi)


def _build_broadcast(p: CaseParams) -> Case:
    expected = _payload(p.root, p.count, p.dtype)
    is_root = p.rank == p.root
    src = expected if is_root else torch.zeros_like(expected)
    buf = torch.empty_like(expected)

    def reset() -> None:
        if p.in_place:
            buf.copy_(src)
        else:
            buf.zero_()

    def ours(comm: TorchComm) -> None:
        if not p.in_place and is_root:
            buf.copy_(src)
        comm.broadcast(buf, p.root, False)

    def gloo(pg: Any) -> None:
        if not p.in_place and is_root:
            buf.copy_(src)
        o = c10d.BroadcastOptions()
        o.rootRank = p.root
        pg.broadcast([buf], o).wait()

    view = _mpi_buffer(p, buf, False)

    def mpi(world: Any) -> None:
        if not p.in_place and is_root:
            buf.copy_(src)
        world.Bcast(view, p.root)

    return _compared(ours, gloo, reset, buf, expected, mpi)


def _build_all_gather(p: CaseParams) -> Case:
    chunk = p.count // p.nranks
    expected = torch.cat([_payload(r, chunk, p.dtype) for r in range(p.nranks)])
    mine = _payload(p.rank, chunk, p.dtype)
    out = torch.empty_like(expected)
    inp = out[p.rank * chunk : (p.rank + 1) * chunk] if p.in_place else mine.clone()

    def reset() -> None:
        out.zero_()
        inp.copy_(mine)

    def ours(comm: TorchComm) -> None:
        comm.all_gather_single(out, inp, False)

    def gloo(pg: Any) -> None:
        pg._allgather_base(out, inp, c10d.AllgatherOptions()).wait()

    out_view = _mpi_buffer(p, out, False)
    in_view = _mpi_in_place(p) if p.in_place else _mpi_buffer(p, inp, False)

    def mpi(world: Any) -> None:
        world.Allgather(in_view, out_view)

    return _compared(ours, gloo, reset, out, expected, mpi)


def _build_reduce_scatter(p: CaseParams) -> Case:
    chunk = p.count // p.nranks
    lo, hi = p.rank * chunk, (p.rank + 1) * chunk
    src = _pattern(p.rank, _modulus(p.redop), p.count, p.dtype)
    expected = _reduced(p, p.count)[lo:hi].clone()
    inp = torch.empty_like(src)
    out = inp[lo:hi] if p.in_place else torch.empty(chunk, dtype=p.dtype)
    op, gop = _ours_op(p), _gloo_op(p)

    def reset() -> None:
        inp.copy_(src)
        if not p.in_place:
            out.zero_()

    def ours(comm: TorchComm) -> None:
        comm.reduce_scatter_single(out, inp, op, False)

    def gloo(pg: Any) -> None:
        o = c10d.ReduceScatterOptions()
        o.reduceOp = gop
        pg._reduce_scatter_base(out, inp, o).wait()

    # MPI's in-place form puts the result at the buffer's start, not at this rank's chunk:
    # only the out-of-place form compares like for like.
    in_view, out_view = _mpi_buffer(p, inp, True), _mpi_buffer(p, out, True)

    def mpi(world: Any) -> None:
        world.Reduce_scatter_block(in_view, out_view, mpib.op(p.redop))

    fits = not p.in_place and in_view is not None
    return _compared(ours, gloo, reset, out, expected, mpi if fits else None)


def _build_all_to_all(p: CaseParams) -> Case:
    n, chunk = p.nranks, p.count // p.nranks
    # Chunk d of rank r is tagged r*n + d; rank r receives chunk r of every rank s.
    src = torch.cat([_payload(p.rank * n + d, chunk, p.dtype) for d in range(n)])
    expected = torch.cat([_payload(s * n + p.rank, chunk, p.dtype) for s in range(n)])
    inp = torch.empty_like(src)
    out = inp if p.in_place else torch.empty_like(src)

    def reset() -> None:
        inp.copy_(src)
        if not p.in_place:
            out.zero_()

    def ours(comm: TorchComm) -> None:
        comm.all_to_all_single(out, inp, False)

    def gloo(pg: Any) -> None:
        pg.alltoall_base(out, inp, [], [], c10d.AllToAllOptions()).wait()

    in_view, out_view = _mpi_buffer(p, inp, False), _mpi_buffer(p, out, False)

    def mpi(world: Any) -> None:
        world.Alltoall(in_view, out_view)

    return _compared(ours, gloo, reset, out, expected, None if p.in_place else mpi)


def _build_sendrecv(p: CaseParams) -> Case:
    """Ping-pong: rank 0 sends to rank 1, which sends it back; other ranks sit out."""
    payload = _payload(0, p.count, p.dtype)
    got = torch.empty_like(payload)
    if p.rank > 1:
        return Case(ours=_noop_comm, gloo=_noop_comm, mpi=_noop_comm)
    sent, back = _mpi_buffer(p, payload, False), _mpi_buffer(p, got, False)

    def reset() -> None:
        got.zero_()

    if p.rank == 0:

        def ours(comm: TorchComm) -> None:
            comm.send(payload, 1, False)
            comm.recv(got, 1, False)

        def gloo(pg: Any) -> None:
            pg.send([payload], 1, _P2P_TAG).wait()
            pg.recv([got], 1, _P2P_TAG).wait()

        def mpi(world: Any) -> None:
            world.Send(sent, 1, _P2P_TAG)
            world.Recv(back, 1, _P2P_TAG)

    else:

        def ours(comm: TorchComm) -> None:
            comm.recv(got, 0, False)
            comm.send(got, 0, False)

        def gloo(pg: Any) -> None:
            pg.recv([got], 0, _P2P_TAG).wait()
            pg.send([got], 0, _P2P_TAG).wait()

        def mpi(world: Any) -> None:
            world.Recv(back, 0, _P2P_TAG)
            world.Send(back, 0, _P2P_TAG)

    return _compared(ours, gloo, reset, got, payload, mpi)


def _build_barrier(p: CaseParams) -> Case:
    def ours(comm: TorchComm) -> None:
        comm.barrier(False)

    def gloo(pg: Any) -> None:
        pg.barrier(c10d.BarrierOptions()).wait()

    def mpi(world: Any) -> None:
        world.Barrier()

    return Case(ours=ours, gloo=gloo, mpi=mpi)
