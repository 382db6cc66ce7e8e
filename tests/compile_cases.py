"""The op table of the torch.compile tests: each case is a function of (comm, tensors).

Every case function calls communicator ops the way user code does (rank-dependent roots,
peers and sizes come from ``comm.get_rank()`` / ``get_size()``, read at trace time), and
returns the tensors whose values the test compares.  ``inputs(rank, size)`` builds the
case's fresh integer-valued inputs, so eager and compiled runs start from equal data.
A case runs in the rank processes of ``tests/test_compile.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from torchcomms import BatchP2POptions, ReduceOp

N = 6  # elements per rank and chunk: small, so compiled kernels stay tiny
T30 = timedelta(seconds=30)
HINTS = {"compile_test": "1"}  # an unknown hint: passed through, ignored by the backend
#: A PREMUL_SUM factor given as a tensor (created outside the graph, as users do).
FACTOR = torch.tensor([3.0])

Tensors = tuple[torch.Tensor, ...]


def _ranked(rank: int, n: int = N, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.arange(n, dtype=dtype) + 10 * (rank + 1)


# -- case functions ------------------------------------------------------------------------------
def all_reduce(comm: Any, x: torch.Tensor) -> Tensors:
    y = x * 2
    comm.all_reduce(y, ReduceOp.SUM, False, hints=HINTS, timeout=T30)
    work = comm.all_reduce(y, ReduceOp.MAX, True)
    work.wait()
    z = y - 1
    comm.all_reduce(z, ReduceOp.PREMUL_SUM(2.0), False)
    w = z + 0
    comm.all_reduce(w, ReduceOp.PREMUL_SUM(FACTOR), async_op=False)
    return y, z, w


def reduce(comm: Any, x: torch.Tensor) -> Tensors:
    root = comm.get_size() - 1
    y = x + 1
    comm.reduce(y, root, ReduceOp.SUM, False)
    z = x * 3
    comm.reduce(z, 0, ReduceOp.MAX, True).wait()
    if comm.get_rank() == root:
        return (y,) if root != 0 else (y, z)
    return (z,) if comm.get_rank() == 0 else ()


def broadcast(comm: Any, x: torch.Tensor) -> Tensors:
    y = x.clone()
    comm.broadcast(y, 1, False)
    z = x * 5
    work = comm.broadcast(z, 0, True, timeout=T30)
    work.wait()
    return y + z, y


def all_gather(comm: Any, x: torch.Tensor) -> Tensors:
    size, rank = comm.get_size(), comm.get_rank()
    outs = [torch.zeros(N) for _ in range(size)]
    comm.all_gather(outs, x, False)
    single = torch.zeros(size * N)
    comm.all_gather_single(single, x * 2, True).wait()
    var = [torch.zeros(r + 1) for r in range(size)]
    comm.all_gather_v(var, x[: rank + 1] + 1, False)
    return (*outs, single, *var)


def reduce_scatter(comm: Any, x: torch.Tensor) -> Tensors:
    size, rank = comm.get_size(), comm.get_rank()
    ins = [x + i for i in range(size)]
    out = torch.zeros(N)
    comm.reduce_scatter(out, ins, ReduceOp.SUM, False)
    single_in = torch.cat([x * (i + 1) for i in range(size)])
    single = torch.zeros(N)
    comm.reduce_scatter_single(single, single_in, ReduceOp.MAX, True).wait()
    var_in = [x[: i + 1] * 2 for i in range(size)]
    var = torch.zeros(rank + 1)
    comm.reduce_scatter_v(var, var_in, ReduceOp.SUM, False)
    return out, single, var


def all_to_all(comm: Any, x: torch.Tensor) -> Tensors:
    size, rank = comm.get_size(), comm.get_rank()
    ins = [x + 100 * i for i in range(size)]
    outs = [torch.zeros(N) for _ in range(size)]
    comm.all_to_all(outs, ins, False)
    single_in = torch.cat([x * (i + 1) for i in range(size)])
    single = torch.zeros(size * N)
    comm.all_to_all_single(single, single_in, True).wait()
    # rank r sends i+1 rows to rank i and receives r+1 rows from every rank
    in_splits = [i + 1 for i in range(size)]
    out_splits = [rank + 1] * size
    v_in = torch.arange(sum(in_splits) * 2, dtype=torch.float32).reshape(-1, 2) + rank * 1000
    v_out = torch.zeros(sum(out_splits), 2)
    comm.all_to_all_v_single(v_out, v_in, out_splits, in_splits, False)
    return (*outs, single, v_out)


def scatter_gather(comm: Any, x: torch.Tensor) -> Tensors:
    size, rank = comm.get_size(), comm.get_rank()
    root = size - 1
    ins = [x * (i + 1) for i in range(size)] if rank == root else []
    out = torch.zeros(N)
    comm.scatter(out, ins, root, False)
    gathered = [torch.zeros(N) for _ in range(size)] if rank == 0 else []
    comm.gather(gathered, out + rank, 0, True).wait()
    single = torch.zeros(size * N if rank == 0 else 0)  # the output is ignored off the root
    comm.gather_single(single, out * 2, 0, False)
    return (out, *gathered, single)


def send_recv(comm: Any, x: torch.Tensor) -> Tensors:
    size, rank = comm.get_size(), comm.get_rank()
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    got = torch.zeros(N)
    # receives are posted first, asynchronously: a sync ring of sends would deadlock
    work = comm.recv(got, prv, True)
    comm.send(x * 7, nxt, False)
    work.wait()
    # then the pair (0, 1) once more, sync, in the order that cannot deadlock
    back = torch.zeros(N)
    if rank == 0:
        comm.send(got + 1, 1, False)
        comm.recv(back, 1, False)
    elif rank == 1:
        comm.recv(back, 0, False)
        comm.send(back * 2, 0, False)
    comm.barrier(False)
    comm.barrier(True).wait()
    return got, back


def batch(comm: Any, x: torch.Tensor) -> Tensors:
    size, rank = comm.get_size(), comm.get_rank()
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    a, b = torch.zeros(N), torch.zeros(N)
    ops = comm.batch_op_create()
    ops.send(x + 1, nxt)
    ops.recv(a, prv)
    ops.send(x + 2, prv)
    ops.recv(b, nxt)
    ops.issue(False)
    c = torch.zeros(N)
    ops2 = comm.batch_op_create()
    ops2.recv(c, prv)
    ops2.send(a * 3, nxt)
    ops2.issue(True, BATCH_OPTIONS).wait()
    return a, b, c


BATCH_OPTIONS = BatchP2POptions()
BATCH_OPTIONS.timeout = T30
BATCH_OPTIONS.hints = dict(HINTS)


def autograd(comm: Any, x: torch.Tensor) -> Tensors:
    """Gradients pass through a collective and its wait as through the identity."""
    y = x * 3
    work = comm.all_reduce(y, ReduceOp.SUM, True)
    work.wait()
    z = y * y
    comm.broadcast(z, 0, False)
    return (z.sum(),)


@dataclass(frozen=True)
class Case:
    name: str
    fn: Callable[..., Tensors]
    inputs: Callable[[int, int], Tensors]
    #: the ops the case covers (reported by the test, checked against the op list)
    covers: tuple[str, ...]


def in_place(comm: Any, x: torch.Tensor) -> Tensors:
    """Collectives on the graph's own input and no compute: with Inductor, the graph lowers to
    our ops alone (mutations of an input, an async op and its wait, a barrier), and no C++
    kernel is compiled (a kernel's first compile costs 12-18 s on 2 cores)."""
    comm.all_reduce(x, ReduceOp.SUM, False)
    comm.broadcast(x, comm.get_size() - 1, True).wait()
    comm.all_reduce(x, ReduceOp.MAX, True).wait()
    comm.barrier(False)
    return (x,)


def _one(rank: int, size: int) -> Tensors:
    return (_ranked(rank),)


CASES = (
    Case("all_reduce", all_reduce, _one, ("all_reduce",)),
    Case("reduce", reduce, _one, ("reduce",)),
    Case("broadcast", broadcast, _one, ("broadcast",)),
    Case("all_gather", all_gather, _one, ("all_gather", "all_gather_single", "all_gather_v")),
    Case(
        "reduce_scatter",
        reduce_scatter,
        _one,
        ("reduce_scatter", "reduce_scatter_single", "reduce_scatter_v"),
    ),
    Case(
        "all_to_all", all_to_all, _one, ("all_to_all", "all_to_all_single", "all_to_all_v_single")
    ),
    Case("scatter_gather", scatter_gather, _one, ("scatter", "gather", "gather_single")),
    Case("send_recv", send_recv, _one, ("send", "recv", "barrier")),
    Case("batch", batch, _one, ("batch_op_create",)),
    Case("in_place", in_place, _one, ("all_reduce", "broadcast", "barrier")),
)

#: One graph covering several cases (the default run compiles it once instead of nine times).
COMBINED = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


def combined(comm: Any, x: torch.Tensor) -> Tensors:
    """Several cases in one graph: ops of different kinds interleaved with compute."""
    by_name = {case.name: case.fn for case in CASES}
    out: list[torch.Tensor] = []
    for name in COMBINED:
        out.extend(by_name[name](comm, x + len(out)))
    return tuple(out)


# -- autograd: upstream's formulas, checked against the analytic gradient ----------------------
C = 4  # elements per chunk in the autograd cases


def _tri(n: int) -> int:
    return n * (n - 1) // 2


def grad_all_reduce(comm: Any, x: torch.Tensor) -> torch.Tensor:
    b = x * 1.0
    comm.all_reduce(b, ReduceOp.SUM, False)
    return (b * (torch.arange(C) + comm.get_rank() + 1)).sum()


def grad_all_reduce_async(comm: Any, x: torch.Tensor) -> torch.Tensor:
    b = x * 1.0
    comm.all_reduce(b, ReduceOp.SUM, True).wait()
    return (b * (torch.arange(C) + comm.get_rank() + 1)).sum()


def grad_all_gather(comm: Any, x: torch.Tensor) -> torch.Tensor:
    b = x * 1.0
    outs = [torch.zeros(C) for _ in range(comm.get_size())]
    comm.all_gather(outs, b, False)
    return sum((t * (i + comm.get_rank() + 1)).sum() for i, t in enumerate(outs))


def grad_all_gather_single(comm: Any, x: torch.Tensor) -> torch.Tensor:
    b = x * 1.0
    out = torch.zeros(C * comm.get_size())
    comm.all_gather_single(out, b, False)
    return (out * (torch.arange(out.numel()) + comm.get_rank())).sum()


def grad_reduce_scatter(comm: Any, x: torch.Tensor) -> torch.Tensor:
    b = x * 1.0
    out = torch.zeros(C)
    comm.reduce_scatter(out, list(b.chunk(comm.get_size())), ReduceOp.SUM, False)
    return (out * (comm.get_rank() + 1)).sum()


def grad_reduce_scatter_single(comm: Any, x: torch.Tensor) -> torch.Tensor:
    b = x * 1.0
    out = torch.zeros(C)
    comm.reduce_scatter_single(out, b, ReduceOp.SUM, False)
    return (out * (comm.get_rank() + 1)).sum()


def grad_all_to_all_single(comm: Any, x: torch.Tensor) -> torch.Tensor:
    b = x * 1.0
    out = torch.zeros(C * comm.get_size())
    comm.all_to_all_single(out, b, False)
    return (out * (torch.arange(out.numel()) + 100 * comm.get_rank())).sum()


def _v_splits(rank: int, size: int) -> tuple[list[int], list[int]]:
    """Rank r sends i + 1 elements to rank i and receives r + 1 from every rank."""
    return [rank + 1] * size, [i + 1 for i in range(size)]


def grad_all_to_all_v_single(comm: Any, x: torch.Tensor) -> torch.Tensor:
    rank, size = comm.get_rank(), comm.get_size()
    out_splits, in_splits = _v_splits(rank, size)
    b = x * 1.0
    out = torch.zeros(sum(out_splits))
    comm.all_to_all_v_single(out, b, out_splits, in_splits, False)
    return (out * (torch.arange(out.numel()) + 100 * rank)).sum()


def grad_scaled(comm: Any, x: torch.Tensor) -> torch.Tensor:
    """The scaling reductions: PREMUL_SUM(2) all_reduce, then an AVG reduce_scatter_single, and
    a MAX all_reduce (no formula: no autograd node, the identity)."""
    size, rank = comm.get_size(), comm.get_rank()
    b = x * 1.0
    comm.all_reduce(b, ReduceOp.PREMUL_SUM(2.0), False)
    out = torch.zeros(C)
    comm.reduce_scatter_single(out, b, ReduceOp.AVG, False)
    comm.all_reduce(out, ReduceOp.MAX, False)
    return (out * (rank + 1) * size).sum()


@dataclass(frozen=True)
class GradCase:
    """A loss through one collective: ``fn(comm, x)``, ``x`` of ``numel(rank, size)`` elements,
    and ``grad(rank, size)``, d loss / d x on that rank (integer-valued)."""

    name: str
    fn: Callable[[Any, torch.Tensor], torch.Tensor]
    numel: Callable[[int, int], int]
    grad: Callable[[int, int], torch.Tensor]


def _chunked(size: int, chunk: Callable[[int], torch.Tensor]) -> torch.Tensor:
    return torch.cat([chunk(i) for i in range(size)])


GRAD_CASES = (
    # sum_r (arange + r + 1)
    GradCase(
        "all_reduce",
        grad_all_reduce,
        lambda r, n: C,
        lambda r, n: n * torch.arange(C) + _tri(n) + n,
    ),
    GradCase(
        "all_reduce_async",
        grad_all_reduce_async,
        lambda r, n: C,
        lambda r, n: n * torch.arange(C) + _tri(n) + n,
    ),
    # outs[r] on every rank q is weighted r + q + 1
    GradCase(
        "all_gather",
        grad_all_gather,
        lambda r, n: C,
        lambda r, n: torch.full((C,), float(n * (r + 1) + _tri(n))),
    ),
    GradCase(
        "all_gather_single",
        grad_all_gather_single,
        lambda r, n: C,
        lambda r, n: n * torch.arange(r * C, (r + 1) * C) + _tri(n),
    ),
    # chunk i of every rank lands on rank i, weighted i + 1
    GradCase(
        "reduce_scatter",
        grad_reduce_scatter,
        lambda r, n: C * n,
        lambda r, n: _chunked(n, lambda i: torch.full((C,), float(i + 1))),
    ),
    GradCase(
        "reduce_scatter_single",
        grad_reduce_scatter_single,
        lambda r, n: C * n,
        lambda r, n: _chunked(n, lambda i: torch.full((C,), float(i + 1))),
    ),
    # chunk i of rank r is chunk r of rank i's output, weighted arange + 100 i
    GradCase(
        "all_to_all_single",
        grad_all_to_all_single,
        lambda r, n: C * n,
        lambda r, n: _chunked(n, lambda i: torch.arange(r * C, (r + 1) * C) + 100 * i),
    ),
    # d loss / d b_q (chunk i) = size (i + 1) / size; b_q = 2 sum_r x_r: 2 size (i + 1)
    GradCase(
        "scaled",
        grad_scaled,
        lambda r, n: C * n,
        lambda r, n: _chunked(n, lambda i: torch.full((C,), float(2 * n * (i + 1)))),
    ),
    # the i + 1 elements rank r sends rank i are rank i's output from r: at r * (i + 1)
    GradCase(
        "all_to_all_v_single",
        grad_all_to_all_v_single,
        lambda r, n: sum(range(1, n + 1)),
        lambda r, n: _chunked(n, lambda i: torch.arange(r * (i + 1), (r + 1) * (i + 1)) + 100 * i),
    ),
)
