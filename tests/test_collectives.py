"""Collective correctness matrix for the ``gloo`` CPU backend.

Every collective of ``TorchComm`` is run on world sizes 1, 2, 3 (not a power of two) and 4,
sync (``async_op=False``: result in place on return, work already completed) and async
(``work.wait()``, then the result and ``work.is_completed()``), for every supported dtype,
every reduce op that applies to the dtype, and counts 0, 1 and 7, plus 1 MiB messages for a
few ops. Rooted ops are run for every root; ``all_to_all_v_single`` for uniform, variable,
zero-size and 2-D (splits in dim-0 rows) patterns.

The ops are data: ``OPS`` maps an op name to a descriptor whose ``prepare`` builds this rank's
arguments and the checks to run afterwards. Expected values come from ``rank_data`` (the
per-rank input formula, evaluated for every rank) and ``reduce_ref`` (the reduction done
independently in wide dtypes), never from the library. Inputs that are not outputs must be
unchanged afterwards. Dtype/op combinations the library rejects (bitwise ops on floats,
PREMUL_SUM on integers and bool, AVG on bool) are asserted to raise ``CommValidationError``
with the documented message.

Each world size runs one task whose ranks loop over the whole case table, collect every
failure, and return a summary; the test asserts the number of cases checked (so an empty or
truncated table fails) and lists every failed case.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
import torch

from tests.harness import RankContext, run_ranks
from tests.reference import (
    ALL_DTYPES,
    ALL_REDS,
    BITWISE,
    FLOAT_TOL,
    PREMUL_FLOAT,
    PREMUL_TENSOR,
    make_reduce_op,
    rank_data,
    reduce_ref,
)
from torchcomms import CommValidationError, ReduceOp, TorchComm, TorchWork, new_comm

# ----------------------------------------------------------------------------- dtypes and ops

#: Messages of the CommValidationError raised for combinations the library rejects.
REJECT_BITWISE_FLOAT = r"Cannot use ReduceOp\.{op} with non-integral dtype"
REJECT_PREMUL_NON_FLOAT = r"ReduceOp\.PREMUL_SUM requires a floating-point dtype"
REJECT_AVG_BOOL = r"ReduceOp\.AVG is not supported for dtype torch\.bool"

#: One MiB of 4-byte elements.
LARGE_COUNT = (1 << 20) // 4

COMM_TIMEOUT = timedelta(seconds=30)


def reduce_ops_for(dtype: torch.dtype) -> list[tuple[str, str | None]]:
    """(reduce op name, regex of the expected rejection or None) for every op on ``dtype``."""
    if dtype.is_floating_point:
        return [
            (red, REJECT_BITWISE_FLOAT.format(op=red) if red in BITWISE else None)
            for red in ALL_REDS
        ]
    rejected = {PREMUL_FLOAT: REJECT_PREMUL_NON_FLOAT, PREMUL_TENSOR: REJECT_PREMUL_NON_FLOAT}
    if dtype is torch.bool:
        rejected["AVG"] = REJECT_AVG_BOOL
    return [(red, rejected.get(red)) for red in ALL_REDS]


# ----------------------------------------------------------------------------- reference model


def sentinel_like(expected: torch.Tensor) -> torch.Tensor:
    """An output buffer whose every element differs from ``expected`` (detects unwritten output)."""
    if expected.dtype is torch.bool:
        return ~expected
    return torch.full_like(expected, 99)


def mismatch(actual: torch.Tensor, expected: torch.Tensor) -> str | None:
    """None if equal (exact for integers/bool, per-dtype tolerance for floats), else a message."""
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        return (
            f"got {actual.dtype}{tuple(actual.shape)}, expected {expected.dtype}"
            f"{tuple(expected.shape)}"
        )
    if expected.dtype.is_floating_point:
        rtol, atol = FLOAT_TOL[expected.dtype]
        try:
            torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
        except AssertionError as exc:
            return " ".join(str(exc).split())[:300]
        return None
    if torch.equal(actual, expected):
        return None
    bad = (actual != expected).nonzero().flatten()[:8].tolist()
    return (
        f"{int((actual != expected).sum())} element(s) differ; first at {bad}: "
        f"got {actual.flatten()[bad].tolist()}, expected {expected.flatten()[bad].tolist()}"
    )


# ----------------------------------------------------------------------------- case table


@dataclass(frozen=True)
class Case:
    """One run of one collective with fixed arguments."""

    op: str
    async_op: bool
    dtype: torch.dtype | None = None
    count: int = 0
    red: str | None = None
    root: int | None = None
    variant: str | None = None
    #: Regex of the expected CommValidationError message; None = must succeed.
    reject: str | None = None

    def label(self) -> str:
        parts = [self.op + (f"[{self.variant}]" if self.variant else "")]
        if self.dtype is not None:
            parts.append(f"dtype={str(self.dtype).removeprefix('torch.')}")
            parts.append(f"count={self.count}")
        if self.red is not None:
            parts.append(f"op={self.red}")
        if self.root is not None:
            parts.append(f"root={self.root}")
        parts.append("async" if self.async_op else "sync")
        if self.reject is not None:
            parts.append("(must be rejected)")
        return " ".join(parts)


Check = Callable[[], "str | None"]


@dataclass
class Prepared:
    """This rank's arguments for one case: the call to make and what to check afterwards."""

    call: Callable[[TorchComm, bool], TorchWork]
    checks: list[Check] = field(default_factory=list)

    def expect(self, what: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
        self.checks.append(lambda: _named(what, mismatch(actual, expected)))

    def unchanged(self, what: str, tensor: torch.Tensor) -> None:
        snapshot = tensor.clone()
        self.checks.append(lambda: _named(f"{what} was modified", mismatch(tensor, snapshot)))


def _named(what: str, problem: str | None) -> str | None:
    return None if problem is None else f"{what}: {problem}"


@dataclass(frozen=True)
class Env:
    rank: int
    size: int
    ctx: RankContext
    seq: int


@dataclass(frozen=True)
class OpSpec:
    """How to build one collective's arguments and expectations (see ``OPS``)."""

    prepare: Callable[[Case, Env], Prepared]
    reduces: bool = False
    rooted: bool = False
    variants: tuple[str | None, ...] = (None,)
    typed: bool = True


def _inputs(case: Case, env: Env, n: int, offset: int = 0) -> list[torch.Tensor]:
    """``rank_data`` of every rank (index = rank)."""
    assert case.dtype is not None
    return [rank_data(q, n, case.dtype, case.red, offset) for q in range(env.size)]


def _mine(case: Case, env: Env, n: int, offset: int = 0) -> torch.Tensor:
    assert case.dtype is not None
    return rank_data(env.rank, n, case.dtype, case.red, offset)


def _reduced(case: Case, env: Env, n: int, offset: int = 0) -> torch.Tensor:
    assert case.dtype is not None and case.red is not None
    if case.reject is not None:  # the call must raise; there is no result to expect
        return torch.zeros(n, dtype=case.dtype)
    return reduce_ref(_inputs(case, env, n, offset), case.red, case.dtype)


def _red(case: Case) -> ReduceOp:
    assert case.red is not None
    return make_reduce_op(case.red)


def prep_all_reduce(case: Case, env: Env) -> Prepared:
    tensor = _mine(case, env, case.count)
    op = _red(case)
    p = Prepared(lambda comm, a: comm.all_reduce(tensor, op, a))
    p.expect("tensor", tensor, _reduced(case, env, case.count))
    return p


def prep_reduce(case: Case, env: Env) -> Prepared:
    assert case.root is not None
    root = case.root
    tensor = _mine(case, env, case.count)
    op = _red(case)
    p = Prepared(lambda comm, a: comm.reduce(tensor, root, op, a))
    if env.rank == root:  # non-root content is implementation-defined afterwards
        p.expect("tensor on root", tensor, _reduced(case, env, case.count))
    return p


def prep_broadcast(case: Case, env: Env) -> Prepared:
    assert case.root is not None
    root = case.root
    expected = _inputs(case, env, case.count)[root]
    tensor = expected.clone() if env.rank == root else sentinel_like(expected)
    p = Prepared(lambda comm, a: comm.broadcast(tensor, root, a))
    p.expect("tensor", tensor, expected)
    return p


def prep_all_gather(case: Case, env: Env) -> Prepared:
    expected = _inputs(case, env, case.count)
    outs = [sentinel_like(e) for e in expected]
    tensor = _mine(case, env, case.count)
    p = Prepared(lambda comm, a: comm.all_gather(outs, tensor, a))
    for i, (out, exp) in enumerate(zip(outs, expected, strict=True)):
        p.expect(f"tensor_list[{i}]", out, exp)
    p.unchanged("input tensor", tensor)
    return p


def prep_all_gather_v(case: Case, env: Env) -> Prepared:
    # Rank i contributes count + i elements.
    expected = [_inputs(case, env, case.count + i)[i] for i in range(env.size)]
    outs = [sentinel_like(e) for e in expected]
    tensor = _mine(case, env, case.count + env.rank)
    p = Prepared(lambda comm, a: comm.all_gather_v(outs, tensor, a))
    for i, (out, exp) in enumerate(zip(outs, expected, strict=True)):
        p.expect(f"tensor_list[{i}] (size {case.count + i})", out, exp)
    p.unchanged("input tensor", tensor)
    return p


def prep_all_gather_single(case: Case, env: Env) -> Prepared:
    expected = torch.cat(_inputs(case, env, case.count))
    output = sentinel_like(expected)
    tensor = _mine(case, env, case.count)
    p = Prepared(lambda comm, a: comm.all_gather_single(output, tensor, a))
    p.expect("output", output, expected)
    p.unchanged("input", tensor)
    return p


def prep_reduce_scatter(case: Case, env: Env) -> Prepared:
    n = case.count
    input_list = [_mine(case, env, n, offset=i * n) for i in range(env.size)]
    expected = _reduced(case, env, n, offset=env.rank * n)
    output = sentinel_like(expected)
    op = _red(case)
    p = Prepared(lambda comm, a: comm.reduce_scatter(output, input_list, op, a))
    p.expect("output", output, expected)
    for i, t in enumerate(input_list):
        p.unchanged(f"input_list[{i}]", t)
    return p


def prep_reduce_scatter_v(case: Case, env: Env) -> Prepared:
    # input_list[i] has count + i elements and is reduced onto rank i.
    sizes = [case.count + i for i in range(env.size)]
    offsets = [sum(sizes[:i]) for i in range(env.size)]
    input_list = [_mine(case, env, sizes[i], offsets[i]) for i in range(env.size)]
    expected = _reduced(case, env, sizes[env.rank], offsets[env.rank])
    output = sentinel_like(expected)
    op = _red(case)
    p = Prepared(lambda comm, a: comm.reduce_scatter_v(output, input_list, op, a))
    p.expect(f"output (size {sizes[env.rank]})", output, expected)
    for i, t in enumerate(input_list):
        p.unchanged(f"input_list[{i}]", t)
    return p


def prep_reduce_scatter_single(case: Case, env: Env) -> Prepared:
    n = case.count
    tensor = _mine(case, env, n * env.size)
    expected = _reduced(case, env, n, offset=env.rank * n)
    output = sentinel_like(expected)
    op = _red(case)
    p = Prepared(lambda comm, a: comm.reduce_scatter_single(output, tensor, op, a))
    p.expect("output", output, expected)
    p.unchanged("input", tensor)
    return p


def prep_all_to_all_single(case: Case, env: Env) -> Prepared:
    n = case.count
    tensor = _mine(case, env, n * env.size)
    # Block j of my output is block <my rank> of rank j's input.
    expected = torch.cat([_inputs(case, env, n, offset=env.rank * n)[j] for j in range(env.size)])
    output = sentinel_like(expected)
    p = Prepared(lambda comm, a: comm.all_to_all_single(output, tensor, a))
    p.expect("output", output, expected)
    p.unchanged("input", tensor)
    return p


#: Row width of the 2-D all_to_all_v_single variant.
A2AV_ROW = 3


def a2av_rows(variant: str, src: int, dst: int, count: int, size: int) -> int:
    """Rows rank ``src`` sends to rank ``dst`` in each all_to_all_v_single pattern."""
    if variant == "uniform":
        return count
    if variant in ("variable", "2d"):
        return count + (src + 2 * dst) % 3
    assert variant == "zero-size", variant
    # Nothing to the next rank (nothing at all on one rank); the others get count + dst + 1.
    return 0 if dst == (src + 1) % size else count + dst + 1


def prep_all_to_all_v_single(case: Case, env: Env) -> Prepared:
    assert case.dtype is not None and case.variant is not None
    size, me = env.size, env.rank
    width = A2AV_ROW if case.variant == "2d" else 1

    def rows(src: int, dst: int) -> int:
        return a2av_rows(case.variant or "", src, dst, case.count, size)

    def shaped(flat: torch.Tensor) -> torch.Tensor:
        return flat.view(-1, width) if width > 1 else flat

    in_splits = [rows(me, j) for j in range(size)]
    out_splits = [rows(j, me) for j in range(size)]
    tensor = shaped(_mine(case, env, sum(in_splits) * width))
    pieces = []
    for j in range(size):
        start = sum(rows(j, k) for k in range(me))  # where rank j's block for me starts
        pieces.append(rank_data(j, rows(j, me) * width, case.dtype, None, start * width))
    expected = shaped(torch.cat(pieces))
    output = sentinel_like(expected)
    p = Prepared(lambda comm, a: comm.all_to_all_v_single(output, tensor, out_splits, in_splits, a))
    p.expect(f"output (out splits {out_splits}, in splits {in_splits})", output, expected)
    p.unchanged("input", tensor)
    return p


def prep_all_to_all(case: Case, env: Env) -> Prepared:
    n = case.count
    input_list = [_mine(case, env, n, offset=j * n) for j in range(env.size)]
    expected = _inputs(case, env, n, offset=env.rank * n)  # expected[j] = rank j's block for me
    output_list = [sentinel_like(e) for e in expected]
    p = Prepared(lambda comm, a: comm.all_to_all(output_list, input_list, a))
    for j, (out, exp) in enumerate(zip(output_list, expected, strict=True)):
        p.expect(f"output_tensor_list[{j}]", out, exp)
    for j, t in enumerate(input_list):
        p.unchanged(f"input_tensor_list[{j}]", t)
    return p


def prep_scatter(case: Case, env: Env) -> Prepared:
    assert case.root is not None and case.dtype is not None
    root, n = case.root, case.count
    expected = rank_data(root, n, case.dtype, None, offset=env.rank * n)
    output = sentinel_like(expected)
    input_list = (
        [_mine(case, env, n, offset=j * n) for j in range(env.size)] if env.rank == root else []
    )
    p = Prepared(lambda comm, a: comm.scatter(output, input_list, root, a))
    p.expect("output_tensor", output, expected)
    for j, t in enumerate(input_list):
        p.unchanged(f"input_tensor_list[{j}] on root", t)
    return p


def prep_gather(case: Case, env: Env) -> Prepared:
    assert case.root is not None
    root = case.root
    expected = _inputs(case, env, case.count)
    outs = [sentinel_like(e) for e in expected] if env.rank == root else []
    tensor = _mine(case, env, case.count)
    p = Prepared(lambda comm, a: comm.gather(outs, tensor, root, a))
    for i, out in enumerate(outs):
        p.expect(f"output_tensor_list[{i}] on root", out, expected[i])
    p.unchanged("input_tensor", tensor)
    return p


def prep_gather_single(case: Case, env: Env) -> Prepared:
    assert case.root is not None and case.dtype is not None
    root = case.root
    expected = torch.cat(_inputs(case, env, case.count))
    # Non-root output is ignored: pass an empty tensor.
    output = sentinel_like(expected) if env.rank == root else torch.empty(0, dtype=case.dtype)
    tensor = _mine(case, env, case.count)
    p = Prepared(lambda comm, a: comm.gather_single(output, tensor, root, a))
    if env.rank == root:
        p.expect("output on root", output, expected)
    p.unchanged("input", tensor)
    return p


def prep_barrier(case: Case, env: Env) -> Prepared:
    # Every rank publishes a key before entering; once the barrier completes anywhere, every
    # rank has entered, so every key must already be there.
    store = env.ctx.store
    keys = [f"barrier/{env.seq}/{r}" for r in range(env.size)]

    def call(comm: TorchComm, async_op: bool) -> TorchWork:
        store.set(keys[env.rank], "entered")
        # TCPStore's set is not acknowledged; a get on the same connection makes sure the
        # server has applied it before this rank enters the barrier.
        store.get(keys[env.rank])
        return comm.barrier(async_op)

    def all_entered() -> str | None:
        if store.check(keys):
            return None
        missing = [k for k in keys if not store.check([k])]
        return f"barrier completed before every rank entered (missing {missing})"

    return Prepared(call, [all_entered])


#: Every collective of TorchComm (send/recv are point-to-point and tested elsewhere).
OPS: dict[str, OpSpec] = {
    "all_reduce": OpSpec(prep_all_reduce, reduces=True),
    "reduce": OpSpec(prep_reduce, reduces=True, rooted=True),
    "broadcast": OpSpec(prep_broadcast, rooted=True),
    "all_gather": OpSpec(prep_all_gather),
    "all_gather_v": OpSpec(prep_all_gather_v),
    "all_gather_single": OpSpec(prep_all_gather_single),
    "reduce_scatter": OpSpec(prep_reduce_scatter, reduces=True),
    "reduce_scatter_v": OpSpec(prep_reduce_scatter_v, reduces=True),
    "reduce_scatter_single": OpSpec(prep_reduce_scatter_single, reduces=True),
    "all_to_all_single": OpSpec(prep_all_to_all_single),
    "all_to_all_v_single": OpSpec(
        prep_all_to_all_v_single, variants=("uniform", "variable", "zero-size", "2d")
    ),
    "all_to_all": OpSpec(prep_all_to_all),
    "scatter": OpSpec(prep_scatter, rooted=True),
    "gather": OpSpec(prep_gather, rooted=True),
    "gather_single": OpSpec(prep_gather_single, rooted=True),
    "barrier": OpSpec(prep_barrier, typed=False),
}


@dataclass(frozen=True)
class Plan:
    """Which slice of the full product a task runs."""

    dtypes: tuple[torch.dtype, ...] = ALL_DTYPES
    counts: tuple[int, ...] = (0, 1, 7)
    asyncs: tuple[bool, ...] = (False, True)
    #: Op name -> reduce op names to run (None: every applicable one); None: every op.
    ops: dict[str, tuple[str, ...] | None] | None = None
    #: Run rooted ops for every root (else root = size - 1 only).
    all_roots: bool = True


PLANS = {
    # The full dtype x op x reduce-op x count x sync/async product.
    "full": Plan(),
    # World sizes 1 and 4: every op, reduce op and root, fewer dtypes and counts.
    "reduced": Plan(
        dtypes=(torch.float32, torch.bfloat16, torch.int8, torch.uint8, torch.bool),
        counts=(0, 7),
    ),
    # 1 MiB messages for a handful of ops.
    "large": Plan(
        dtypes=(torch.float32, torch.int32),
        counts=(LARGE_COUNT,),
        ops={
            "all_reduce": ("SUM", "MAX", "AVG"),
            "reduce_scatter_single": ("SUM",),
            "all_gather_single": None,
            "all_to_all_single": None,
            "broadcast": None,
            "reduce": ("SUM",),
            "scatter": None,
            "gather": None,
        },
        all_roots=False,
    ),
}


def build_cases(size: int, plan_name: str) -> list[Case]:
    """The case table of one plan on one world size (same on every rank and in the test)."""
    plan = PLANS[plan_name]
    cases: list[Case] = []
    for name, spec in OPS.items():
        if plan.ops is not None and name not in plan.ops:
            continue
        wanted_reds = plan.ops.get(name) if plan.ops is not None else None
        roots: list[int | None] = [None]
        if spec.rooted:
            roots = list(range(size)) if plan.all_roots else [size - 1]
        for async_op in plan.asyncs:
            if not spec.typed:
                cases.append(Case(name, async_op))
                continue
            for dtype in plan.dtypes:
                reds: list[tuple[str | None, str | None]] = [(None, None)]
                if spec.reduces:
                    reds = [
                        (red, reject)
                        for red, reject in reduce_ops_for(dtype)
                        if wanted_reds is None or red in wanted_reds
                    ]
                for count in plan.counts:
                    for red, reject in reds:
                        for root in roots:
                            for variant in spec.variants:
                                cases.append(
                                    Case(name, async_op, dtype, count, red, root, variant, reject)
                                )
    return cases


# ----------------------------------------------------------------------------- rank function


def run_case(comm: TorchComm, case: Case, env: Env) -> list[str]:
    """Run one case on this rank; return its problems (empty = passed)."""
    prepared = OPS[case.op].prepare(case, env)
    if case.reject is not None:
        try:
            work = prepared.call(comm, case.async_op)
        except RuntimeError as exc:  # CommValidationError is a RuntimeError, as upstream
            if not isinstance(exc, CommValidationError) or not re.search(case.reject, str(exc)):
                return [f"raised {exc!r}, expected CommValidationError matching {case.reject!r}"]
            return []
        work.wait()  # it ran on every rank (validation is symmetric), so it completes
        return [f"expected CommValidationError matching {case.reject!r}, nothing was raised"]
    work = prepared.call(comm, case.async_op)
    problems: list[str] = []
    if case.async_op:
        work.wait()
    elif not work.is_completed():
        problems.append("sync work is not completed on return")
    # Sync: checked before wait(), so the result must already be in place on return.
    problems += [msg for check in prepared.checks if (msg := check()) is not None]
    if not case.async_op:
        work.wait()
    if not work.is_completed():
        problems.append("work.is_completed() is False after wait()")
    return problems


def matrix_rank(ctx: RankContext, plan_name: str) -> dict[str, Any]:
    """Run the whole case table of ``plan_name`` on this rank; return a summary."""
    comm = new_comm(
        "gloo",
        torch.device("cpu"),
        name=f"matrix-{plan_name}",
        store=ctx.store,
        timeout=COMM_TIMEOUT,
    )
    assert comm.get_rank() == ctx.rank and comm.get_size() == ctx.world_size
    cases = build_cases(ctx.world_size, plan_name)
    failures: list[str] = []
    checked = 0
    rejected = 0
    for seq, case in enumerate(cases):
        env = Env(ctx.rank, ctx.world_size, ctx, seq)
        try:
            problems = run_case(comm, case, env)
        except Exception as exc:  # keep going: every failing case is reported
            problems = [f"raised {type(exc).__name__}: {exc}"]
        failures += [f"rank {ctx.rank}: {case.label()}: {p}" for p in problems]
        checked += 1
        rejected += case.reject is not None
    comm.finalize()
    return {
        "checked": checked,
        "rejected": rejected,
        "ops": sorted({c.op for c in cases}),
        "dtypes": sorted({str(c.dtype) for c in cases if c.dtype is not None}),
        "failures": failures,
    }


# ----------------------------------------------------------------------------- tests


def _assert_summaries(results: list[dict[str, Any]], size: int, plan_name: str) -> None:
    cases = build_cases(size, plan_name)
    expected_rejected = sum(c.reject is not None for c in cases)
    failures = [f for r in results for f in r["failures"]]
    assert not failures, f"{len(failures)} failed case(s) on world size {size}:\n" + "\n".join(
        failures
    )
    for rank, summary in enumerate(results):
        assert summary["checked"] == len(cases), (rank, summary["checked"], len(cases))
        assert summary["rejected"] == expected_rejected, (rank, summary["rejected"])
        assert summary["ops"] == sorted({c.op for c in cases}), (rank, summary["ops"])


def test_case_table_covers_every_collective_dtype_and_reduce_op() -> None:
    cases = build_cases(3, "full")
    assert {c.op for c in cases} == set(OPS)
    assert {c.dtype for c in cases if c.dtype is not None} == set(ALL_DTYPES)
    assert {c.red for c in cases if c.red is not None} == set(ALL_REDS)
    assert {c.count for c in cases if c.dtype is not None} == {0, 1, 7}
    assert {c.root for c in cases if c.op == "reduce"} == {0, 1, 2}
    assert {c.variant for c in cases if c.op == "all_to_all_v_single"} == {
        "uniform",
        "variable",
        "zero-size",
        "2d",
    }
    # Every rejected combination is in the table, with both sync and async.
    rejected = {(c.red, c.dtype, c.async_op) for c in cases if c.reject is not None}
    for async_op in (False, True):
        assert ("BAND", torch.float16, async_op) in rejected
        assert (PREMUL_TENSOR, torch.int8, async_op) in rejected
        assert (PREMUL_FLOAT, torch.bool, async_op) in rejected
        assert ("AVG", torch.bool, async_op) in rejected
        assert ("SUM", torch.bool, async_op) not in rejected
    large = build_cases(2, "large")
    assert large and all(c.count * c.dtype.itemsize == 1 << 20 for c in large if c.dtype)


@pytest.mark.parametrize(
    "world_size, plan_name", [(1, "reduced"), (2, "full"), (3, "full"), (4, "reduced")]
)
def test_collective_matrix(world_size: int, plan_name: str) -> None:
    """Every collective x dtype x reduce op x count x sync/async gives the reference result."""
    results = run_ranks(matrix_rank, world_size, plan_name, timeout=180.0)
    _assert_summaries(results, world_size, plan_name)


@pytest.mark.parametrize("transport", ["auto", "tcp"])
# 3: an odd world (uneven splits, a ring that does not pair up); 2 with -m slow.
@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_large_messages(world_size: int, transport: str) -> None:
    """1 MiB messages (past the tcp path's inline limit: its gloo calls) through all_reduce,
    reduce, reduce_scatter_single, all_gather_single, a2a, broadcast, scatter and gather."""
    env = {"TORCHCOMM_TRANSPORT": transport}
    results = run_ranks(matrix_rank, world_size, "large", timeout=120.0, env=env)
    _assert_summaries(results, world_size, "large")


def _all_to_all_in_place(ctx: RankContext) -> None:
    """The output may be the input itself (or overlap it): the result is still exact."""
    comm = new_comm("gloo", torch.device("cpu"), name="a2a_alias", store=ctx.store)
    n, r = comm.get_size(), comm.get_rank()
    # Rank r sends value 10*r + j to rank j, so rank r receives 10*j + r from rank j.
    expected = torch.tensor([10 * j + r for j in range(n)], dtype=torch.int64)
    buf = torch.tensor([10 * r + j for j in range(n)], dtype=torch.int64)
    comm.all_to_all_single(buf, buf, False)
    assert torch.equal(buf, expected), buf
    buf = torch.tensor([10 * r + j for j in range(n)], dtype=torch.int64)
    comm.all_to_all_v_single(buf, buf, [1] * n, [1] * n, False)
    assert torch.equal(buf, expected), buf
    comm.finalize()


def test_all_to_all_with_aliased_output() -> None:
    run_ranks(_all_to_all_in_place, 3, timeout=60.0)


def _splits_even_on_one_rank_only(ctx: RankContext, transport: str, count: int) -> None:
    """Upstream's ZeroSizes pattern at 2 ranks: rank r sends nothing to rank i when
    ``(r + i) % 3 == 0``, else ``count`` elements, so rank 1's splits are equal and rank 0's
    are not.  Every rank must still take the variable path (one header, the same bytes)."""
    comm = new_comm(
        "gloo",
        torch.device("cpu"),
        name=f"a2av_{transport}_{count}",
        store=ctx.store,
        hints={"transport": transport},
    )
    n, r = comm.get_size(), comm.get_rank()
    sends = [0 if (r + i) % 3 == 0 else count for i in range(n)]
    recvs = [0 if (i + r) % 3 == 0 else count for i in range(n)]
    inp = torch.cat([torch.full((s,), 100 * r + i, dtype=torch.int32) for i, s in enumerate(sends)])
    out = torch.full((sum(recvs),), -1, dtype=torch.int32)
    comm.all_to_all_v_single(out, inp, recvs, sends, False)
    want = torch.cat(
        [torch.full((s,), 100 * i + r, dtype=torch.int32) for i, s in enumerate(recvs)]
    )
    assert torch.equal(out, want), (r, out[:8], want[:8])
    # The list form: rank 1's tensors are all one size, rank 0's are not.
    outs = [torch.full((s,), -1, dtype=torch.int32) for s in recvs]
    comm.all_to_all(outs, list(inp.split(sends)), False)
    assert torch.equal(torch.cat(outs), want), r
    comm.finalize()


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_all_to_all_v_with_splits_even_on_one_rank_only(transport: str) -> None:
    # 4: the inline path of tcp and one shm round; 100,000: past both.
    for count in (4, 100_000):
        run_ranks(_splits_even_on_one_rank_only, 2, transport, count, timeout=60.0)
