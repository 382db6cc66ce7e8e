"""The op table: one small descriptor per benchmarked operation, nccl-tests style.

Each ``OpSpec`` says how many elements a row of ``S`` bytes means, the bus-bandwidth
factor, the memory traffic of the copy-in/copy-out model (for the ceiling column), and
how to build a ``Case``: integer-valued inputs, the expected output, and the call on a
``TorchComm``, on a raw ``ProcessGroupGloo`` and, for ``--vs mpi``, MPI's own operation.  One harness (``runner``) runs them all.

Input patterns are small integers (at most 80, or powers of two for ``prod``), exact in
every supported dtype, so checks are bit-exact comparisons.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._C._distributed_c10d as c10d

from torchcomms import ReduceOp, TorchComm
from torchcomms.bench import mpi as mpib
from torchcomms.bench import window_ops

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
}

# name -> (ours, raw c10d, how to combine two Python ints)
REDOPS: dict[str, tuple[ReduceOp, Any, Callable[[int, int], int]]] = {
    "sum": (ReduceOp.SUM, c10d.ReduceOp.SUM, lambda a, b: a + b),
    "prod": (ReduceOp.PRODUCT, c10d.ReduceOp.PRODUCT, lambda a, b: a * b),
    "min": (ReduceOp.MIN, c10d.ReduceOp.MIN, min),
    "max": (ReduceOp.MAX, c10d.ReduceOp.MAX, max),
}

_P2P_TAG = 7


@dataclass(frozen=True)
class CaseParams:
    """What one rank needs to build a case: ``count`` is the row's element count."""

    rank: int
    nranks: int
    count: int
    dtype: torch.dtype
    redop: str
    root: int
    in_place: bool
    #: ``--vs mpi`` asked for: only then are MPI's views built (mpi4py is imported only then).
    vs_mpi: bool = False


def _noop() -> None:
    return None


def _zero() -> int:
    return 0


@dataclass
class Case:
    """One rank's buffers for one (op, size, placement), with the calls that use them."""

    ours: Callable[[TorchComm], None]
    gloo: Callable[[Any], None]
    reset: Callable[[], None] = _noop  # restore inputs/outputs before a checked run
    wrong: Callable[[], int] = _zero  # elements of this rank's output that differ
    corrupt: Callable[[], None] = _noop  # test switch: damage this rank's output
    #: MPI's own operation on the same buffers (``--vs mpi``); None where MPI has none.
    mpi: Callable[[Any], None] | None = None


@dataclass(frozen=True)
class OpSpec:
    """A benchmarked op: sizes, formulas and how to build a case (see the module docstring)."""

    name: str
    factor_text: str  # nccl-tests busbw factor, as printed in the table header
    busbw_factor: Callable[[int], float]
    traffic_text: str  # memory traffic of the copy-in/copy-out model, in units of S
    traffic: Callable[[int], float] | None  # k(N): the model moves k * S bytes
    build: Callable[[CaseParams], Case]
    granularity: Callable[[int], int] = lambda n: 1  # count must be a multiple of this
    reduces: bool = False
    rooted: bool = False
    placements: tuple[bool, ...] = (False, True)  # in_place values it runs
    min_ranks: int = 1
    sized: bool = True  # barrier: one row, no payload
    time_divisor: int = 1  # ping-pong: one-way time = round trip / 2
    checked_rank: Callable[[int, int], int | None] = lambda n, root: n - 1  # corrupt target
    aliases: tuple[str, ...] = field(default_factory=tuple)
    #: In-place APIs only: the traffic of the bench's own copy of the input into the output,
    #: which the out-of-place column times before the op (``2N``: every rank copies S).
    copy_in_text: str = "0"

    def traffic_text_at(self, in_place: bool) -> str:
        """The model as printed for one placement: the out-of-place column adds the copy."""
        if in_place or self.copy_in_text == "0":
            return self.traffic_text
        return _spelled(_coefficients(self.traffic_text), _coefficients(self.copy_in_text))

    def traffic_at(self, nranks: int, in_place: bool) -> float | None:
        """``k(N)`` for one placement: the bytes the timed call moves, in units of S."""
        if self.traffic is None:
            return None
        a, b = _coefficients(self.copy_in_text)
        extra = 0 if in_place else a * nranks + b
        return self.traffic(nranks) + extra

    def count_for(self, nbytes: int, nranks: int, elem_size: int) -> int:
        """Elements a row of ``nbytes`` moves, rounded down as nccl-tests does."""
        if not self.sized:
            return 0
        g = self.granularity(nranks)
        return nbytes // elem_size // g * g


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


def _per_rank(n: int) -> int:
    return n


#: nccl-tests' busbw factor of each ``factor_text`` (``-``: no payload, so no busbw).
_BUSBW_FACTORS: dict[str, Callable[[int], float]] = {
    "2(n-1)/n": lambda n: 2 * (n - 1) / n,
    "(n-1)/n": lambda n: (n - 1) / n,
    "1": lambda n: 1.0,
    "-": lambda n: 0.0,
}


def _coefficients(text: str) -> tuple[int, int]:
    """``(a, b)`` of the model ``aN+b`` that ``text`` spells (``5N+1``, ``2N``, ``4``)."""
    slope, per_rank, rest = text.partition("N")
    return (int(slope or 1), int(rest or 0)) if per_rank else (0, int(slope))


def _spelled(*terms: tuple[int, int]) -> str:
    """The sum of models ``aN+b``, written as a ``traffic_text``."""
    a = sum(t[0] for t in terms)
    b = sum(t[1] for t in terms)
    slope = "" if a == 0 else ("N" if a == 1 else f"{a}N")
    if not slope:
        return str(b)
    return slope if b == 0 else f"{slope}+{b}"


def _traffic(text: str) -> Callable[[int], float] | None:
    """The model ``k(N) = aN+b`` that a ``traffic_text`` spells, or None for ``-`` (no
    payload)."""
    if text == "-":
        return None
    a, b = _coefficients(text)
    return lambda n: a * n + b


def _spec(
    name: str,
    factor_text: str,
    traffic_text: str,
    build: Callable[[CaseParams], Case],
    **options: Any,
) -> OpSpec:
    """A table row, its formulas written once: as the header prints them."""
    return OpSpec(
        name=name,
        factor_text=factor_text,
        busbw_factor=_BUSBW_FACTORS[factor_text],
        traffic_text=traffic_text,
        traffic=_traffic(traffic_text),
        build=build,
        **options,
    )


_TABLE = (
    _spec("all_reduce", "2(n-1)/n", "5N+1", _build_all_reduce, reduces=True, copy_in_text="2N"),
    _spec(
        "reduce",
        "1",
        "3N+1",
        _build_reduce,
        reduces=True,
        rooted=True,
        copy_in_text="2N",
        checked_rank=lambda n, root: root,
    ),
    _spec("broadcast", "1", "2N", _build_broadcast, rooted=True, copy_in_text="2"),
    _spec(
        "all_gather",
        "(n-1)/n",
        "2N+2",
        _build_all_gather,
        granularity=_per_rank,
        aliases=("all_gather_single",),
    ),
    _spec(
        "reduce_scatter",
        "(n-1)/n",
        "3N+1",
        _build_reduce_scatter,
        granularity=_per_rank,
        reduces=True,
        aliases=("reduce_scatter_single",),
    ),
    _spec(
        "all_to_all",
        "(n-1)/n",
        "4N",
        _build_all_to_all,
        granularity=_per_rank,
        placements=(False,),  # gloo's alltoall gives wrong results when output is input
        aliases=("all_to_all_single", "alltoall"),
    ),
    _spec(
        "sendrecv",
        "1",
        "4",
        _build_sendrecv,
        placements=(False,),
        min_ranks=2,
        time_divisor=2,
        checked_rank=lambda n, root: 1,
        aliases=("send_recv", "send/recv", "p2p"),
    ),
    _spec(
        "barrier",
        "-",
        "-",
        _build_barrier,
        placements=(False,),
        sized=False,
        checked_rank=lambda n, root: None,
    ),
)


def _build_put(p: CaseParams) -> Case:
    return Case(*window_ops.build_put(p.rank, p.count, p.dtype))


def _build_get(p: CaseParams) -> Case:
    return Case(*window_ops.build_get(p.rank, p.count, p.dtype))


#: One-sided window ops: run only when named (``--op put,get``), not by default.
_WINDOW_TABLE = (
    _spec(
        "put",
        "1",
        "2",
        _build_put,
        placements=(False,),
        min_ranks=2,
        time_divisor=2,
        checked_rank=lambda n, root: 0,
        aliases=("window_put",),
    ),
    _spec(
        "get",
        "1",
        "2",
        _build_get,
        placements=(False,),
        min_ranks=2,
        checked_rank=lambda n, root: 0,
        aliases=("window_get",),
    ),
)

#: The ops of the default run.
OPS: dict[str, OpSpec] = {spec.name: spec for spec in _TABLE}
ALIASES: dict[str, str] = {
    **{spec.name: spec.name for spec in (*_TABLE, *_WINDOW_TABLE)},
    **{alias: spec.name for spec in (*_TABLE, *_WINDOW_TABLE) for alias in spec.aliases},
}


def resolve(names: list[str]) -> list[OpSpec]:
    """Op specs for user-given names (aliases allowed, duplicates dropped, table order kept)."""
    wanted = set()
    for name in names:
        key = name.strip().lower()
        if key not in ALIASES:
            choices = ", ".join([*OPS, *(spec.name for spec in _WINDOW_TABLE)])
            raise ValueError(f"unknown op {name!r} (choose from {choices})")
        wanted.add(ALIASES[key])
    return [spec for spec in (*_TABLE, *_WINDOW_TABLE) if spec.name in wanted]
