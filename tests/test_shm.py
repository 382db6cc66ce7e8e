"""The CPU backend's shared-memory transport (issue 5), against the TCP path and the spec.

* Equivalence: every collective, send/recv and batched send/recv, every supported dtype and
  every valid reduce op, on sizes that span the one-shot / reduce-scatter+all-gather switch
  and the slot chunking boundary (tiny slots: ``shm_slot_bytes=8192``,
  ``shm_oneshot_max=1024``), sync and async, with in-place variants: the shm result equals
  the TCP result bit for bit and an independently computed expected value.
* Several live shm communicators at once, interleaved and async, and splits of them.
* Resources: 200 create/finalize cycles leave no ``/dev/shm`` entry, mapping or fd behind;
  a live communicator's segment is already unlinked; ``sweep_stale`` removes dead owners'.
* Faults: a peer SIGKILLed mid-collective or between a single-copy op's address round and
  its copy, a rank that skips a collective (timeout),
  mismatched collectives, a peer that finalizes early; typed errors naming the ranks, then
  a poisoned communicator.
* Point-to-point: crossed large async sends, batches to several peers, message order, size
  and tag mismatches, tagged messages.
* Transport selection: hint / ``TORCHCOMM_TRANSPORT``, invalid values,
  ``TORCHCOMM_HOST_ID`` (different hosts: auto picks TCP, forced shm refuses).

The hierarchical (several simulated hosts) path is tested elsewhere.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness import RankContext, RankFailure, run_ranks
from tests.reference import (
    ALL_DTYPES,
    FLOAT_TOL,
    reds_for,
    reduce_ref,
)
from tests.reference import make_reduce_op as make_op
from tests.reference import rank_data as data
from torchcomms import (
    CollectiveMismatchError,
    CommError,
    CommTimeoutError,
    PeerFailureError,
    ReduceOp,
    TorchComm,
    TorchWork,
    new_comm,
)
from torchcomms.backends.cpu.shm import single_copy
from torchcomms.transport.errors import WaitError
from torchcomms.transport.shm import segment as shm_segment

CPU = torch.device("cpu")

#: Tiny slots and one-shot limit, so small sizes cross the algorithm switch and chunking.
SHM_HINTS = {"transport": "shm", "shm_slot_bytes": "8192", "shm_oneshot_max": "1024"}
TCP_HINTS = {"transport": "tcp"}
COMM_TIMEOUT = timedelta(seconds=60)

#: 1 and 7: one-shot; 300: one-shot only for 1-byte dtypes; 1025: reduce-scatter+all-gather
#: for every dtype, chunked for 8-byte dtypes (1024 per 8 KiB slot); 5000: chunked for >= 2 bytes.
SIZES = (1, 7, 300, 1025, 5000)


def sentinel(n: int, dtype: torch.dtype) -> torch.Tensor:
    """An output buffer whose elements no expected value has (bool: a fixed pattern)."""
    if dtype is torch.bool:
        return torch.arange(n) % 2 == 0
    return torch.full((n,), 99, dtype=dtype)


# ----------------------------------------------------------------------------- 1. equivalence


@dataclass(frozen=True)
class Case:
    """One call of one op with fixed arguments."""

    op: str
    dtype: torch.dtype
    n: int
    red: str | None
    root: int
    async_op: bool
    salt: int

    def label(self) -> str:
        parts = [self.op, str(self.dtype).removeprefix("torch."), f"n={self.n}"]
        if self.red is not None:
            parts.append(self.red)
        parts += [f"root={self.root}", "async" if self.async_op else "sync"]
        return " ".join(parts)


#: Ops that take a reduce op (run for every valid op of every dtype).
REDUCING = (
    "all_reduce",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_single_inplace",
    "reduce_scatter_v",
)
#: Ops that move data only (run for every dtype).
MOVING = (
    "broadcast",
    "all_gather",
    "all_gather_single",
    "all_gather_single_inplace",
    "all_gather_v",
    "all_to_all",
    "all_to_all_single",
    "all_to_all_single_inplace",
    "all_to_all_v_single",
    "gather",
    "gather_single",
    "scatter",
    "send_recv",
    "batch_send_recv",
)


#: The default run's dtypes: one of each element size (1, 2, 4 and 8 bytes), floats, integers
#: and bool; every dtype with ``-m slow`` (``tests/test_collectives.py``'s matrix checks every
#: dtype against arithmetic in the default run).
SOME_DTYPES = (torch.bool, torch.bfloat16, torch.float32, torch.int64)


def equivalence_cases(world: int, dtypes: Sequence[torch.dtype] = ALL_DTYPES) -> list[Case]:
    """The op x dtype x reduce-op x size table; roots and sync/async rotate."""
    cases: list[Case] = []
    for op in (*REDUCING, *MOVING):
        reds: Callable[[torch.dtype], Sequence[str | None]] = (
            reds_for if op in REDUCING else (lambda _d: (None,))
        )
        for dtype in dtypes:
            for red in reds(dtype):
                for n in SIZES:
                    i = len(cases)
                    cases.append(Case(op, dtype, n, red, i % world, i % 2 == 1, i % 11))
    for i in range(4):
        cases.append(Case("barrier", torch.float32, 0, None, 0, i % 2 == 1, 0))
    return cases


def expected_case_count(dtypes: Sequence[torch.dtype]) -> int:
    """Independent count of the table above (an empty or truncated table fails the test)."""
    per_dtype_reds = sum(len(reds_for(d)) for d in dtypes)
    # every dtype: 7*4 floats + 8*4 ints + 7 bool; some: 7*2 floats + 8 int64 + 7 bool
    assert per_dtype_reds == (67 if len(dtypes) == len(ALL_DTYPES) else 29), dtypes
    return len(SIZES) * (len(REDUCING) * per_dtype_reds + len(MOVING) * len(dtypes)) + 4


def v_size(rank: int, n: int) -> int:
    """Rank ``rank``'s contribution to the *_v ops: uneven, sometimes zero."""
    return 0 if (rank + n) % 4 == 1 else n + rank


def a2a_split(src: int, dst: int, n: int) -> int:
    """Rows ``src`` sends ``dst`` in all_to_all_v_single / all_to_all: uneven, some zero."""
    return 0 if (src + 2 * dst + n) % 3 == 2 else n + src + 2 * dst


Outcome = tuple[list[torch.Tensor], list[torch.Tensor]]  # (results, expected)


def _wait(work: TorchWork, case: Case) -> None:
    if case.async_op:
        work.wait()
        assert work.is_completed(), f"{case.label()}: wait() returned but work is not completed"


def run_case(comm: TorchComm, c: Case) -> Outcome:
    """Run one case on ``comm``; return what this rank got and what it must have got."""
    me, w, n, dt = comm.get_rank(), comm.get_size(), c.n, c.dtype
    a = c.async_op

    def mine(k: int = n, salt: int = 0) -> torch.Tensor:
        return data(me, k, dt, c.red, c.salt + salt)

    def every(k: int = n, salt: int = 0) -> list[torch.Tensor]:
        return [data(r, k, dt, c.red, c.salt + salt) for r in range(w)]

    if c.op == "barrier":
        _wait(comm.barrier(a), c)
        return [], []
    if c.op == "all_reduce":
        assert c.red is not None
        t = mine()
        _wait(comm.all_reduce(t, make_op(c.red), a), c)
        return [t], [reduce_ref(every(), c.red, dt)]
    if c.op == "reduce":
        assert c.red is not None
        t = mine()
        _wait(comm.reduce(t, c.root, make_op(c.red), a), c)
        if me != c.root:  # a non-root tensor's content is unspecified afterwards
            return [], []
        return [t], [reduce_ref(every(), c.red, dt)]
    if c.op == "reduce_scatter":
        assert c.red is not None
        ins = [mine(salt=p) for p in range(w)]
        kept = [t.clone() for t in ins]
        out = sentinel(n, dt)
        _wait(comm.reduce_scatter(out, ins, make_op(c.red), a), c)
        exp = reduce_ref(every(salt=me), c.red, dt)
        return [out, *ins], [exp, *kept]
    if c.op in ("reduce_scatter_single", "reduce_scatter_single_inplace"):
        assert c.red is not None
        inp = torch.cat([mine(salt=p) for p in range(w)])
        kept = inp.clone()
        inplace = c.op.endswith("inplace")
        out = inp[me * n : (me + 1) * n] if inplace else sentinel(n, dt)
        _wait(comm.reduce_scatter_single(out, inp, make_op(c.red), a), c)
        exp = reduce_ref(every(salt=me), c.red, dt)
        if inplace:
            return [out], [exp]
        return [out, inp], [exp, kept]
    if c.op == "reduce_scatter_v":
        assert c.red is not None
        ins = [mine(v_size(p, n), salt=p) for p in range(w)]
        kept = [t.clone() for t in ins]
        out = sentinel(v_size(me, n), dt)
        _wait(comm.reduce_scatter_v(out, ins, make_op(c.red), a), c)
        exp = reduce_ref(every(v_size(me, n), salt=me), c.red, dt)
        return [out, *ins], [exp, *kept]
    if c.op == "broadcast":
        exp = every()[c.root]
        t = exp.clone() if me == c.root else sentinel(n, dt)
        _wait(comm.broadcast(t, c.root, a), c)
        return [t], [exp]
    if c.op == "all_gather":
        outs = [sentinel(n, dt) for _ in range(w)]
        t = mine()
        _wait(comm.all_gather(outs, t, a), c)
        return [*outs, t], [*every(), mine()]
    if c.op in ("all_gather_single", "all_gather_single_inplace"):
        out = sentinel(w * n, dt)
        if c.op.endswith("inplace"):
            t = out[me * n : (me + 1) * n]
            t.copy_(mine())
        else:
            t = mine()
        _wait(comm.all_gather_single(out, t, a), c)
        return [out, t], [torch.cat(every()), mine()]
    if c.op == "all_gather_v":
        outs = [sentinel(v_size(r, n), dt) for r in range(w)]
        t = mine(v_size(me, n))
        _wait(comm.all_gather_v(outs, t, a), c)
        exp = [data(r, v_size(r, n), dt, None, c.salt) for r in range(w)]
        return [*outs, t], [*exp, mine(v_size(me, n))]
    if c.op == "all_to_all":
        # Block for peer p: elements of this rank's data with salt p (uneven, some empty).
        ins = [mine(a2a_split(me, p, n), salt=p) for p in range(w)]
        kept = [t.clone() for t in ins]
        outs = [sentinel(a2a_split(p, me, n), dt) for p in range(w)]
        _wait(comm.all_to_all(outs, ins, a), c)
        exp = [data(p, a2a_split(p, me, n), dt, None, c.salt + me) for p in range(w)]
        return [*outs, *ins], [*exp, *kept]
    if c.op in ("all_to_all_single", "all_to_all_single_inplace"):
        inp = torch.cat([mine(salt=p) for p in range(w)])
        kept = inp.clone()
        inplace = c.op.endswith("inplace")
        out = inp if inplace else sentinel(w * n, dt)
        _wait(comm.all_to_all_single(out, inp, a), c)
        exp = torch.cat([data(p, n, dt, None, c.salt + me) for p in range(w)])
        if inplace:
            return [out], [exp]
        return [out, inp], [exp, kept]
    if c.op == "all_to_all_v_single":
        # Odd sizes use 2-D tensors (splits count rows of 2); the output has a spare row that
        # must stay untouched.
        width = 2 if n % 2 else 1
        in_rows = [a2a_split(me, p, n) for p in range(w)]
        out_rows = [a2a_split(p, me, n) for p in range(w)]
        inp = torch.cat([mine(r * width, salt=p) for p, r in enumerate(in_rows)])
        inp = inp.view(-1, width) if width > 1 else inp
        kept = inp.clone()
        out = sentinel((sum(out_rows) + 1) * width, dt)
        spare = out[sum(out_rows) * width :].clone()
        out = out.view(-1, width) if width > 1 else out
        _wait(comm.all_to_all_v_single(out, inp, out_rows, in_rows, a), c)
        blocks = [data(p, r * width, dt, None, c.salt + me) for p, r in enumerate(out_rows)]
        exp = torch.cat([*blocks, spare])
        return [out.reshape(-1), inp], [exp, kept]
    if c.op == "gather":
        outs = [sentinel(n, dt) for _ in range(w)] if me == c.root else []
        t = mine()
        _wait(comm.gather(outs, t, c.root, a), c)
        exp = every() if me == c.root else []
        return [*outs, t], [*exp, mine()]
    if c.op == "gather_single":
        out = sentinel(w * n, dt) if me == c.root else torch.empty(0, dtype=dt)
        t = mine()
        _wait(comm.gather_single(out, t, c.root, a), c)
        exp = torch.cat(every()) if me == c.root else torch.empty(0, dtype=dt)
        return [out, t], [exp, mine()]
    if c.op == "scatter":
        ins = [data(c.root, n, dt, None, c.salt + p) for p in range(w)] if me == c.root else []
        kept = [t.clone() for t in ins]
        out = sentinel(n, dt)
        _wait(comm.scatter(out, ins, c.root, a), c)
        return [out, *ins], [data(c.root, n, dt, None, c.salt + me), *kept]
    if c.op == "send_recv":
        # Rank 0 exchanges one message each way with every other rank (sync or async).
        if me == 0:
            got = [sentinel(n, dt) for _ in range(w - 1)]
            for p in range(1, w):
                _wait(comm.send(data(0, n, dt, None, c.salt + p), p, a), c)
                _wait(comm.recv(got[p - 1], p, a), c)
            return got, [data(p, n, dt, None, c.salt) for p in range(1, w)]
        t = sentinel(n, dt)
        _wait(comm.recv(t, 0, a), c)
        _wait(comm.send(mine(), 0, a), c)
        return [t], [data(0, n, dt, None, c.salt + me)]
    if c.op == "batch_send_recv":
        # One batch: a message to and from every other rank.
        batch = comm.batch_op_create()
        got = {p: sentinel(n, dt) for p in range(w) if p != me}
        for p in got:
            batch.send(mine(salt=p), p)
            batch.recv(got[p], p)
        _wait(batch.issue(a), c)
        return list(got.values()), [data(p, n, dt, None, c.salt + me) for p in got]
    raise AssertionError(f"no runner for {c.op}")


def _difference(label: str, got: torch.Tensor, exp: torch.Tensor, avg_float: bool) -> str | None:
    if got.dtype != exp.dtype or got.shape != exp.shape:
        return f"{label}: got {got.dtype}{tuple(got.shape)}, expected {exp.dtype}{tuple(exp.shape)}"
    if avg_float:
        rtol, atol = FLOAT_TOL[exp.dtype]
        try:
            torch.testing.assert_close(got, exp, rtol=rtol, atol=atol)
        except AssertionError as exc:
            return f"{label}: " + " ".join(str(exc).split())[:300]
        return None
    if torch.equal(got, exp):
        return None
    bad = (got != exp).reshape(-1).nonzero().flatten()[:6].tolist()
    return (
        f"{label}: {int((got != exp).sum())} element(s) differ, first at {bad}: got "
        f"{got.reshape(-1)[bad].tolist()}, expected {exp.reshape(-1)[bad].tolist()}"
    )


def _equivalence(ctx: RankContext, dtypes: Sequence[torch.dtype]) -> dict[str, Any]:
    """Every case on a TCP comm and an shm comm: both equal each other and the reference."""
    tcp = new_comm(
        "gloo", CPU, name="eq_tcp", store=ctx.store, timeout=COMM_TIMEOUT, hints=TCP_HINTS
    )
    shm = new_comm(
        "gloo", CPU, name="eq_shm", store=ctx.store, timeout=COMM_TIMEOUT, hints=SHM_HINTS
    )
    transports = [tcp.get_backend_impl().transport, shm.get_backend_impl().transport]  # type: ignore[attr-defined]
    failures: list[str] = []
    checked = 0
    start = time.monotonic()
    for case in equivalence_cases(ctx.world_size, dtypes):
        label = case.label()
        try:
            got_tcp, _ = run_case(tcp, case)
            got_shm, expected = run_case(shm, case)
        except Exception as exc:  # keep going: report every failing case at once
            failures.append(f"{label}: raised {type(exc).__name__}: {exc}")
            if len(failures) > 40:
                break
            continue
        avg_float = case.red == "AVG" and case.dtype.is_floating_point
        for i, (s, t, e) in enumerate(zip(got_shm, got_tcp, expected, strict=True)):
            problem = _difference(f"{label} [{i}] shm vs tcp", s, t, False) or _difference(
                f"{label} [{i}] shm vs expected", s, e, avg_float
            )
            if problem is not None:
                failures.append(problem)
        checked += 1
    elapsed = time.monotonic() - start
    tcp.finalize()
    shm.finalize()
    return {"checked": checked, "failures": failures, "transports": transports, "elapsed": elapsed}


@pytest.mark.parametrize(
    ("world", "dtypes"),
    # 3: an odd world, where chunk and slot arithmetic is least regular, with one dtype of each
    # size; every dtype, and 2 and 4 ranks, with -m slow.
    [
        pytest.param(2, ALL_DTYPES, marks=pytest.mark.slow),
        (3, SOME_DTYPES),
        pytest.param(3, ALL_DTYPES, marks=pytest.mark.slow),
        pytest.param(4, ALL_DTYPES, marks=pytest.mark.slow),
    ],
    ids=["2", "3-some-dtypes", "3", "4"],
)
def test_shm_equals_tcp_over_every_op_dtype_and_reduce_op(
    world: int, dtypes: tuple[torch.dtype, ...]
) -> None:
    results = run_ranks(_equivalence, world, dtypes, timeout=240)
    for rank, r in enumerate(results):
        tcp_transport, shm_transport = r["transports"]
        assert tcp_transport.startswith("tcp ("), (rank, tcp_transport)
        assert shm_transport.startswith(f"shm ({world} ranks on this host, 8 KiB slots"), (
            rank,
            shm_transport,
        )
        assert r["failures"] == [], f"rank {rank}:\n" + "\n".join(r["failures"])
        count = expected_case_count(dtypes)
        assert r["checked"] == count == len(equivalence_cases(world, dtypes)), r


# ----------------------------------------------------------------------------- 2. many comms


def _shm(ctx: RankContext, name: str, **kw: Any) -> TorchComm:
    hints = dict(SHM_HINTS)
    hints.update(kw.pop("hints", {}))
    kw.setdefault("timeout", COMM_TIMEOUT)
    return new_comm("gloo", CPU, name=name, store=ctx.store, hints=hints, **kw)


def _transport(comm: TorchComm) -> str:
    return str(comm.get_backend_impl().transport)  # type: ignore[attr-defined]


def _concurrent_comms(ctx: RankContext) -> dict[str, Any]:
    """Three live shm comms with interleaved and async ops, then splits (and a split's split)."""
    me, w = ctx.rank, ctx.world_size
    comms = [_shm(ctx, f"live{i}") for i in range(3)]
    out: dict[str, Any] = {"transports": [_transport(c) for c in comms]}
    # Interleaved sync ops: a different op on each comm, round after round.
    for step in range(20):
        n = (1, 700, 3000)[step % 3]  # one-shot, reduce-scatter+all-gather, chunked
        t = torch.full((n,), float(me + step))
        comms[0].all_reduce(t, ReduceOp.SUM, False)
        assert torch.equal(t, torch.full((n,), float(sum(range(w)) + w * step))), step
        b = (
            torch.arange(n, dtype=torch.int64) * (step + 1)
            if me == step % w
            else torch.zeros(n, dtype=torch.int64)
        )
        comms[1].broadcast(b, step % w, False)
        assert torch.equal(b, torch.arange(n, dtype=torch.int64) * (step + 1)), step
        g = torch.empty(w * n, dtype=torch.int32)
        comms[2].all_gather_single(g, torch.full((n,), me * 100 + step, dtype=torch.int32), False)
        exp = torch.cat([torch.full((n,), r * 100 + step, dtype=torch.int32) for r in range(w)])
        assert torch.equal(g, exp), step
    # Async ops queued on every comm, waited for in reverse order.
    tensors: list[torch.Tensor] = []
    works: list[TorchWork] = []
    for rep in range(4):
        for i, comm in enumerate(comms):
            t = torch.full((1500,), float(me + 1 + rep + 10 * i))
            works.append(comm.all_reduce(t, ReduceOp.MAX if i == 1 else ReduceOp.SUM, True))
            tensors.append(t)
    for work in reversed(works):
        work.wait()
    for k, t in enumerate(tensors):
        rep, i = divmod(k, 3)
        vals = [r + 1 + rep + 10 * i for r in range(w)]
        want = float(max(vals) if i == 1 else sum(vals))
        assert torch.equal(t, torch.full((1500,), want)), (rep, i, t[:3])
    # Splits: a pair (the last rank sits out), every rank in reversed order, a split's split.
    pair = comms[0].split([0, 1] if me < 2 else [], "pair", hints=SHM_HINTS)
    rev = comms[1].split(list(reversed(range(w))), "reversed", hints=SHM_HINTS)
    assert rev is not None and rev.get_rank() == w - 1 - me, rev
    out["rev_transport"] = _transport(rev)
    if me < 2:
        assert pair is not None and pair.get_size() == 2 and pair.get_rank() == me
        out["pair_transport"] = _transport(pair)
        solo = pair.split([me], "solo", hints=SHM_HINTS)  # two size-1 comms
        assert solo is not None and solo.get_size() == 1
        t = torch.arange(5000, dtype=torch.float64)
        solo.all_reduce(t, ReduceOp.SUM, False)
        assert torch.equal(t, torch.arange(5000, dtype=torch.float64))
        solo.finalize()
    else:
        assert pair is None
    # Ops on the children interleaved with the parents, async on both.
    for step in range(10):
        t_rev = torch.full((3000,), rev.get_rank() + step, dtype=torch.int64)
        w_rev = rev.all_reduce(t_rev, ReduceOp.SUM, True)
        t_parent = torch.full((300,), float(me))
        w_parent = comms[2].all_reduce(t_parent, ReduceOp.MAX, True)
        if pair is not None:
            t_pair = torch.full((2000,), float(me + step))
            pair.all_reduce(t_pair, ReduceOp.PRODUCT, False)
            assert torch.equal(t_pair, torch.full((2000,), float(step * (1 + step)))), step
        w_parent.wait()
        w_rev.wait()
        assert torch.equal(t_rev, torch.full((3000,), sum(range(w)) + w * step, dtype=torch.int64))
        assert torch.equal(t_parent, torch.full((300,), float(w - 1)))
        # The reversed comm's rank 0 is the parent's last rank.
        got = torch.empty(5, dtype=torch.int64)
        rev.scatter(
            got,
            [torch.full((5,), 10 * r + step) for r in range(w)] if rev.get_rank() == 0 else [],
            0,
            False,
        )
        assert torch.equal(got, torch.full((5,), 10 * rev.get_rank() + step)), step
    if pair is not None:
        pair.finalize()
    rev.finalize()
    for comm in comms:
        comm.finalize()
    return out


def test_several_live_shm_comms_async_ops_and_splits() -> None:
    results = run_ranks(_concurrent_comms, 3, timeout=120)
    for rank, r in enumerate(results):
        assert all(t.startswith("shm (3 ranks") for t in r["transports"]), r
        assert r["rev_transport"].startswith("shm (3 ranks"), r
        if rank < 2:
            assert r["pair_transport"].startswith("shm (2 ranks"), r


# ----------------------------------------------------------------------------- 3. resources


def _own_segments(pids: Sequence[int]) -> list[str]:
    """``/dev/shm`` entries named for one of ``pids`` (other jobs' segments are not ours)."""
    prefixes = tuple(f"{shm_segment.PREFIX}{pid}-" for pid in pids)
    return sorted(e for e in os.listdir(shm_segment.SHM_DIR) if e.startswith(prefixes))


def _segment_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(shm_segment.PREFIX in line for line in f)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _dead_pid() -> int:
    """The pid of a child that has exited and been reaped."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def _resource_cycles(ctx: RankContext, cycles: int, private_cycles: int) -> dict[str, Any]:
    """``cycles`` create/op/finalize rounds leave no segment file, mapping or fd behind."""
    me = ctx.rank
    ctx.store.set(f"pid{me}", str(os.getpid()))
    pids = [int(ctx.store.get(f"pid{r}")) for r in range(ctx.world_size)]
    out: dict[str, Any] = {}
    # Warm-up: first-use imports, thread pools and store connections are not leaks.
    warm = _shm(ctx, "warm")
    warm.all_reduce(torch.ones(4), ReduceOp.SUM, False)
    warm.finalize()
    gc.collect()
    fds_before, maps_before = _open_fds(), _segment_mappings()
    out["segments_before"] = _own_segments(pids)
    live_entries: list[str] = []
    live_maps: list[int] = []
    for i in range(cycles):
        # Most cycles talk through the harness store itself ("persistent_store"): creating a
        # private TCPStore per comm (the default, also exercised) costs seconds now and then.
        private = i % (cycles // private_cycles) == 0
        hints = SHM_HINTS if private else {**SHM_HINTS, "persistent_store": "true"}
        comm = new_comm(
            "gloo", CPU, name=f"cyc{i}", store=ctx.store, timeout=COMM_TIMEOUT, hints=hints
        )
        t = torch.full((3,), float(me + i))
        comm.all_reduce(t, ReduceOp.SUM, False)
        assert torch.equal(t, torch.full((3,), float(1 + 2 * i))), (i, t)
        if i % 100 == 0:
            # Live: mapped once, but rank 0 unlinked the file as soon as every rank mapped it.
            live_entries += _own_segments(pids)
            live_maps.append(_segment_mappings() - maps_before)
        comm.finalize()
    del comm, t
    gc.collect()
    out["live_entries"] = live_entries
    out["live_maps"] = live_maps
    out["extra_fds"] = _open_fds() - fds_before
    out["extra_maps"] = _segment_mappings() - maps_before
    out["segments_after"] = _own_segments(pids)
    ctx.store.set(f"done{me}", "1")
    ctx.store.wait([f"done{r}" for r in range(ctx.world_size)])
    if me == 0:
        # sweep_stale: a dead owner's segment goes, a live owner's stays.
        stale = f"{shm_segment.PREFIX}{_dead_pid()}-{'ab' * 8}"
        live = f"{shm_segment.PREFIX}{os.getpid()}-{'cd' * 8}"
        for name in (stale, live):
            shm_segment.create(name, 4096).close()
        removed = shm_segment.sweep_stale()
        out["stale_removed"] = stale in removed
        out["live_removed"] = live in removed
        out["stale_left"] = os.path.exists(os.path.join(shm_segment.SHM_DIR, stale))
        out["live_left"] = os.path.exists(os.path.join(shm_segment.SHM_DIR, live))
        out["mode"] = oct(os.stat(os.path.join(shm_segment.SHM_DIR, live)).st_mode & 0o777)
        shm_segment.unlink(live)
    return out


def test_create_finalize_cycles_leave_no_segment_mapping_or_fd() -> None:
    cycles = 200  # a leak per cycle shows as 200 extra fds or mappings; 500 proved no more
    results = run_ranks(_resource_cycles, 2, cycles, 10, timeout=300)
    for rank, r in enumerate(results):
        assert r["segments_before"] == [] and r["segments_after"] == [], (rank, r)
        assert r["live_entries"] == [], (rank, r)  # unlinked while the comm is live
        assert r["live_maps"] == [1] * (cycles // 100), (rank, r)  # ... yet mapped
        assert r["extra_maps"] == 0, (rank, r)
        assert r["extra_fds"] == 0, (rank, r)
    r0 = results[0]
    assert r0["stale_removed"] and not r0["stale_left"], r0
    assert not r0["live_removed"] and r0["live_left"], r0
    assert r0["mode"] == "0o600", r0  # segments are private to their user


# ----------------------------------------------------------------------------- 4. faults

#: Generous bound on how long a survivor may take to notice a dead peer (not a measurement).
DEAD_PEER_BOUND_S = 10.0


def _run_one_killed(
    fn: Callable[..., Any], world: int, dead: int, tmp_path: Path, *args: Any
) -> None:
    """Run ``fn(ctx, report_dir, *args)`` on ``world`` ranks, of which rank ``dead`` SIGKILLs
    itself: it, and only it, died; no rank timed out or raised (the survivors report through
    files in ``tmp_path``)."""
    with pytest.raises(RankFailure) as info:
        run_ranks(fn, world, str(tmp_path), *args, timeout=120)
    failure = info.value
    assert list(failure.died) == [dead] and "SIGKILL" in failure.died[dead], str(failure)
    assert not failure.timed_out and not failure.errors, str(failure)


def _killed_mid_collective(ctx: RankContext, report_dir: str) -> None:
    """Rank 2 dies (SIGKILL) inside a chunked all_reduce; ranks 0 and 1 must name it.

    The survivors are, at that moment, in an all_reduce on one comm; then they try a
    broadcast rooted at the dead rank and a barrier on two more comms. Each raises
    ``PeerFailureError`` naming rank 2 well within the 60 s timeout; the first comm is then
    poisoned. Survivors write what they saw to ``report_dir`` (the dead rank fails the task).
    """
    me = ctx.rank
    ar, bc, bar = (_shm(ctx, name) for name in ("k_allreduce", "k_broadcast", "k_barrier"))
    for step in range(3):
        t = torch.full((4096,), float(me + step))
        ar.all_reduce(t, ReduceOp.SUM, False)
        assert torch.equal(t, torch.full((4096,), float(3 + 3 * step)))
    big = 1 << 22  # 2048 slot-sized chunks of 2 rounds each (8 KiB slots)
    if me == 2:
        # Die while the executor thread is inside the all_reduce: a few rounds done, most not.
        chan = ar.get_backend_impl()._ops.chan  # type: ignore[attr-defined]
        first = chan.round
        ar.all_reduce(torch.ones(big), ReduceOp.SUM, True)
        give_up = time.monotonic() + 30
        while chan.round < first + 8 and time.monotonic() < give_up:
            time.sleep(0.0002)
        os.kill(os.getpid(), signal.SIGKILL)
    seen: dict[str, Any] = {}
    calls: list[tuple[str, Callable[[], object]]] = [
        ("all_reduce", lambda: ar.all_reduce(torch.ones(big), ReduceOp.SUM, False)),
        ("broadcast", lambda: bc.broadcast(torch.zeros(10), 2, False)),
        ("barrier", lambda: bar.barrier(False)),
        ("poisoned", lambda: ar.all_reduce(torch.ones(3), ReduceOp.SUM, False)),
    ]
    for what, call in calls:
        start = time.monotonic()
        try:
            call()
        except Exception as exc:
            seen[what] = {
                "type": type(exc).__name__,
                "text": str(exc),
                "s": time.monotonic() - start,
            }
        else:
            seen[what] = {"type": None, "text": "returned", "s": time.monotonic() - start}
    Path(report_dir, f"rank{me}.json").write_text(json.dumps(seen))
    for comm in (ar, bc, bar):
        comm.finalize()


def test_peer_sigkilled_mid_collective_is_named_by_every_survivor(tmp_path: Path) -> None:
    _run_one_killed(_killed_mid_collective, 3, 2, tmp_path)
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for what, comm in (
            ("all_reduce", "k_allreduce"),
            ("broadcast", "k_broadcast"),
            ("barrier", "k_barrier"),
        ):
            got = seen[what]
            assert got["type"] == PeerFailureError.__name__, (rank, what, got)
            assert "peer rank 2 died" in got["text"], (rank, what, got)
            assert f"comm={comm} rank={rank}" in got["text"] and what in got["text"], got
            assert got["s"] < DEAD_PEER_BOUND_S, (rank, what, got)
        poisoned = seen["poisoned"]
        assert poisoned["type"] == "PeerFailureError", (rank, poisoned)
        assert "unusable after an earlier failure" in poisoned["text"], poisoned
        assert "peer rank 2 died" in poisoned["text"], poisoned
        assert poisoned["s"] < 1.0, poisoned  # fails fast, does not wait again


def _killed_between_address_and_copy(ctx: RankContext, report_dir: str, op: str) -> None:
    """On the single-copy path the ranks move data in each other's memory: a rank that dies
    after publishing its address leaves its peer writing into, or reading from, a process
    that is gone (or going).  Rank 1 dies right after the address round of a large broadcast
    rooted at rank 0 (which writes the first half into rank 1's tensor) or of a large reduce
    rooted at rank 1 (whose peer, rank 0, writes its third into rank 1's tensor).  Rank 0
    must raise ``PeerFailureError`` naming rank 1, whichever of the write, the read or the
    last round finds out first."""
    me = ctx.rank
    comm = _shm(ctx, f"k_sc_{op}")
    n = (4 << 20) // 4
    t = torch.full((n,), float(me))
    comm.broadcast(t, 0, False)  # the probe, and a first op that completes
    assert torch.equal(t, torch.zeros(n))

    def call() -> None:
        if op == "broadcast":
            comm.broadcast(torch.ones(n), 0, False)
        else:
            comm.reduce(torch.ones(n), 1, ReduceOp.SUM, False)

    if me == 1:
        addresses = single_copy.SingleCopy._addresses

        def then_die(self: Any, *args: Any, **kwargs: Any) -> list[int]:
            got = addresses(self, *args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)
            return got

        single_copy.SingleCopy._addresses = then_die  # type: ignore[method-assign]
        call()
        raise AssertionError("rank 1 should have died")
    start = time.monotonic()
    try:
        call()
    except Exception as exc:
        seen: dict[str, Any] = {"type": type(exc).__name__, "text": str(exc)}
    else:
        seen = {"type": None, "text": "returned"}
    seen["s"] = time.monotonic() - start
    # Rank 1 is gone now (at most a zombie): moving bytes into or out of it, as the single copy
    # does, fails with "process gone", and the error names it.
    single = comm.get_backend_impl()._ops.coll.single  # type: ignore[attr-defined]
    word = torch.zeros(1, dtype=torch.int64)
    for write in (True, False):
        try:
            single._move(write, 1, word.data_ptr(), 4096, 8, op)
        except WaitError as exc:
            seen[f"move write={write}"] = [exc.kind, exc.ranks, str(exc)]
    Path(report_dir, "rank0.json").write_text(json.dumps(seen))
    comm.finalize()


@pytest.mark.parametrize("op", ["broadcast", "reduce"])
def test_a_peer_killed_inside_a_single_copy_op_is_named(tmp_path: Path, op: str) -> None:
    _run_one_killed(_killed_between_address_and_copy, 2, 1, tmp_path, op)
    got = json.loads((tmp_path / "rank0.json").read_text())
    assert got["type"] == PeerFailureError.__name__, got
    assert "peer rank 1 died" in got["text"] and op in got["text"], got
    assert got["s"] < DEAD_PEER_BOUND_S, got
    assert got["move write=True"] == [
        "dead",
        [1],
        f"peer rank 1 died (process gone) while this rank wrote into its memory for {op}",
    ]
    assert got["move write=False"] == [
        "dead",
        [1],
        f"peer rank 1 died (process gone) while this rank read its data for {op}",
    ]


def _timeouts_and_mismatches(ctx: RankContext) -> dict[str, Any]:
    """Rank 1 skips a collective; ranks call mismatched collectives; a peer finalizes early."""
    me = ctx.rank
    short = timedelta(seconds=2)
    out: dict[str, Any] = {}

    def attempt(key: str, call: Callable[[], object], tensor: torch.Tensor | None = None) -> None:
        before = None if tensor is None else tensor.clone()
        start = time.monotonic()
        try:
            call()
        except CommError as exc:
            out[key] = {"type": type(exc).__name__, "text": str(exc), "s": time.monotonic() - start}
        else:
            out[key] = {"type": None, "text": "returned", "s": time.monotonic() - start}
        if before is not None:
            out[key]["unchanged"] = torch.equal(before, tensor)

    # Timeout: rank 1 never joins rank 0's all_reduce.
    to = _shm(ctx, "skipper", timeout=short)
    to.barrier(False)
    if me == 0:
        attempt("timeout", lambda: to.all_reduce(torch.ones(10), ReduceOp.SUM, False))
        attempt("timeout_poisoned", lambda: to.barrier(False))
    ctx.store.set(f"timeout_done{me}", "1")
    ctx.store.wait([f"timeout_done{r}" for r in range(2)])
    to.finalize()

    # Mismatches, each on a fresh comm (an error poisons the comm).
    cases: dict[str, Callable[[TorchComm], Callable[[], object]]] = {
        "size": lambda c: lambda: c.all_reduce(ar_tensor, ReduceOp.SUM, False),
        "op_kind": lambda c: (
            (lambda: c.all_reduce(ar_tensor, ReduceOp.SUM, False))
            if me == 0
            else (lambda: c.broadcast(ar_tensor, 0, False))
        ),
        "dtype": lambda c: lambda: c.all_reduce(ar_tensor, ReduceOp.SUM, False),
        "algorithm": lambda c: lambda: c.all_reduce(ar_tensor, ReduceOp.SUM, False),
        "reduce_op": lambda c: (
            lambda: c.all_reduce(ar_tensor, ReduceOp.SUM if me == 0 else ReduceOp.MAX, False)
        ),
        "all_gather_size": lambda c: (
            lambda: c.all_gather_single(torch.empty(2 * ar_tensor.numel()), ar_tensor, False)
        ),
        "barrier_vs_all_reduce": lambda c: (
            (lambda: c.barrier(False))
            if me == 0
            else (lambda: c.all_reduce(ar_tensor, ReduceOp.SUM, False))
        ),
    }
    tensors = {
        "size": torch.ones(10 if me == 0 else 20),
        "op_kind": torch.full((10,), float(me + 1)),
        "dtype": torch.ones(10, dtype=torch.float32 if me == 0 else torch.int32),
        "algorithm": torch.ones(5000 if me == 0 else 10),  # RS+AG chunks vs one-shot
        "reduce_op": torch.ones(10),
        "all_gather_size": torch.ones(10 if me == 0 else 11),
        "barrier_vs_all_reduce": torch.ones(10),
    }
    for key, make in cases.items():
        comm = _shm(ctx, f"mismatch_{key}", timeout=timedelta(seconds=30))
        ar_tensor = tensors[key]
        attempt(key, make(comm), ar_tensor)
        attempt(f"{key}_poisoned", lambda comm=comm: comm.barrier(False))
        ctx.store.set(f"{key}_done{me}", "1")
        ctx.store.wait([f"{key}_done{r}" for r in range(2)])
        comm.finalize()

    # A peer that finalizes while this rank waits for it.
    early = _shm(ctx, "early_leaver", timeout=timedelta(seconds=30))
    early.barrier(False)
    if me == 1:
        early.finalize()
        ctx.store.set("left", "1")
    else:
        ctx.store.wait(["left"])
        attempt("finalized_peer", lambda: early.all_reduce(torch.ones(10), ReduceOp.SUM, False))
        early.finalize()
    return out


def test_timeout_mismatch_and_early_finalize_are_typed_and_poison() -> None:
    r0, r1 = run_ranks(_timeouts_and_mismatches, 2, timeout=180)
    got = r0["timeout"]
    assert got["type"] == "CommTimeoutError", got
    for part in (
        "comm=skipper rank=0",
        "all_reduce",
        "timed out after 2 s",
        "waiting for peer rank 1",
    ):
        assert part in got["text"], (part, got)
    assert got["s"] < 30, got  # the 2 s timeout, far from the harness deadline (a hang guard)
    poisoned = r0["timeout_poisoned"]
    assert poisoned["type"] == "CommTimeoutError" and "earlier failure" in poisoned["text"], (
        poisoned
    )
    assert "barrier" in poisoned["text"] and "waiting for peer rank 1" in poisoned["text"], poisoned

    mismatch_keys = (
        "size",
        "op_kind",
        "dtype",
        "algorithm",
        "reduce_op",
        "all_gather_size",
        "barrier_vs_all_reduce",
    )
    # Every rank names the mismatch and the field that differs, before any data is combined.
    field = {
        "size": "count=",
        "op_kind": "op=",
        "dtype": "dtype=",
        "algorithm": "count=",
        "reduce_op": "reduce_op=",
        "all_gather_size": "count=",
        "barrier_vs_all_reduce": "op=",
    }
    for key in mismatch_keys:
        outcomes = [r0[key], r1[key]]
        for rank, o in enumerate(outcomes):
            assert o["type"] == "CollectiveMismatchError", (key, rank, o)
            assert "collective mismatch: rank 1 passed " + field[key] in o["text"], (key, o)
            assert o["s"] < 20, (key, o)
            assert o["unchanged"], (key, rank, "tensor modified by a failed op")
        for rank, r in enumerate((r0, r1)):
            p = r[f"{key}_poisoned"]
            assert p["type"] == outcomes[rank]["type"] and "earlier failure" in p["text"], (key, p)
    fin = r0["finalized_peer"]
    assert fin["type"] == "PeerFailureError", fin
    assert "peer rank 1 finalized the communicator" in fin["text"], fin


# ----------------------------------------------------------------------------- 5. point-to-point


def _p2p(ctx: RankContext) -> dict[str, Any]:
    """Crossed large async sends, batches to several peers, message order, mismatches, tags."""
    me, w = ctx.rank, ctx.world_size
    comm = _shm(ctx, "p2p", hints={"shm_slot_bytes": "4M"})  # default ring slots: 1 MiB
    out: dict[str, Any] = {"transport": _transport(comm)}
    peers = [p for p in range(w) if p != me]
    big = (5 << 20) // 4  # 5 MiB of float32 / int32 per message

    # Crossed: every rank first isends 5 MiB to every peer, then irecvs from every peer; a
    # send cannot finish before its receiver posts, so completion needs non-blocking posts.
    sends = [comm.send(torch.full((big,), float(10 * me + p)), p, True) for p in peers]
    got = {p: torch.empty(big) for p in peers}
    recvs = [comm.recv(got[p], p, True) for p in peers]
    for work in (*sends, *recvs):
        work.wait()
    for p in peers:
        assert torch.equal(got[p], torch.full((big,), float(10 * p + me))), p
    # The same crossing with blocking calls ordered to pair up (lower rank sends first).
    for p in peers:
        mine, theirs = (
            torch.arange(big, dtype=torch.int32) + me,
            torch.empty(big, dtype=torch.int32),
        )
        if me < p:
            comm.send(mine, p, False)
            comm.recv(theirs, p, False)
        else:
            comm.recv(theirs, p, False)
            comm.send(mine, p, False)
        assert torch.equal(theirs, torch.arange(big, dtype=torch.int32) + p), p

    # A batch to and from every peer, with several messages per peer of different sizes
    # (one of them larger than a ring slot, one empty).
    sizes = (3, 0, (3 << 20) // 8, 17)
    batch = comm.batch_op_create()
    inbox: dict[tuple[int, int], torch.Tensor] = {}
    for p in peers:
        for k, n in enumerate(sizes):
            batch.send(torch.arange(n, dtype=torch.float64) * (me + 1) + k, p)
            inbox[p, k] = torch.full((n,), -1.0, dtype=torch.float64)
            batch.recv(inbox[p, k], p)
    batch.issue(True).wait()
    for (p, k), t in inbox.items():
        exp = torch.arange(sizes[k], dtype=torch.float64) * (p + 1) + k
        assert torch.equal(t, exp), (p, k)

    # Order: many messages of one pair arrive in issue order (async sends, sync receives).
    lengths = (1, 200_000, 5, 600_000, 0, 3, 1_500_000)
    if me == 0:
        works = [
            comm.send(torch.full((n,), i, dtype=torch.int64), 1, True)
            for i, n in enumerate(lengths)
        ]
        for work in works:
            work.wait()
    elif me == 1:
        for i, n in enumerate(lengths):
            t = torch.full((n,), -1, dtype=torch.int64)
            comm.recv(t, 0, False)
            assert torch.equal(t, torch.full((n,), i, dtype=torch.int64)), (i, n)

    # Tag hints: matching tags in issue order deliver.
    if me == 0:
        comm.send(torch.tensor([7.0]), 1, False, hints={"tag": "5"})
        comm.send(torch.tensor([8.0]), 1, False, hints={"tag": "6"})
    elif me == 1:
        a, b = torch.zeros(1), torch.zeros(1)
        comm.recv(a, 0, False, hints={"tag": "5"})
        comm.recv(b, 0, False, hints={"tag": "6"})
        assert (a.item(), b.item()) == (7.0, 8.0)
    comm.barrier(False)
    comm.finalize()

    # Mismatches (rank 1 receives; each poisons its comm, so each gets its own). A size
    # mismatch fails at once; a receive whose tag no message carries waits out its timeout.
    for key, send_kw, recv_n, recv_kw, error in (
        ("size", {}, 20, {}, CollectiveMismatchError),
        ("tag", {"hints": {"tag": "1"}}, 10, {"hints": {"tag": "2"}}, CommTimeoutError),
    ):
        bad = _shm(ctx, f"p2p_{key}", timeout=timedelta(seconds=2 if key == "tag" else 30))
        if me == 0:
            bad.send(torch.ones(10), 1, False, **send_kw)  # fits the ring: completes
        elif me == 1:
            t = torch.zeros(recv_n)
            with pytest.raises(error) as info:
                bad.recv(t, 0, False, **recv_kw)
            out[key] = str(info.value)
            assert torch.equal(t, torch.zeros(recv_n)), key  # nothing written
            with pytest.raises(error, match="earlier failure"):
                bad.send(torch.ones(1), 0, False)
        ctx.store.set(f"{key}_done{me}", "1")
        ctx.store.wait([f"{key}_done{r}" for r in range(w)])
        bad.finalize()
    return out


def test_point_to_point_crossed_batched_ordered_and_mismatched() -> None:
    results = run_ranks(_p2p, 3, timeout=180)
    assert all(r["transport"].startswith("shm (3 ranks") for r in results), results
    size = results[1]["size"]
    assert "recv" in size and "comm=p2p_size rank=1" in size, size
    assert (
        "message from peer rank 0 does not match this receive: 40 bytes sent, 80 bytes expected"
        in size
    )
    tag = results[1]["tag"]
    assert "comm=p2p_tag rank=1" in tag and "timed out after 2 s" in tag, tag
    assert "waiting for peer rank 0" in tag, tag


def _tags_out_of_order(ctx: RankContext) -> list[float]:
    """Receives posted in another tag order than the sends match by tag (as c10d does).

    The first message is larger than a ring slot, so the ring must not stall behind it.
    """
    comm = _shm(ctx, "tag_order", timeout=timedelta(seconds=30))
    big = (3 << 20) // 4
    got: list[float] = []
    if ctx.rank == 0:
        sends = [comm.send(torch.full((big,), 1.0), 1, True, hints={"tag": "1"})]
        sends.append(comm.send(torch.tensor([2.0]), 1, True, hints={"tag": "2"}))
        sends.append(comm.send(torch.tensor([3.0]), 1, True))  # untagged
        for work in sends:
            work.wait()
    else:
        second, first, untagged = torch.zeros(1), torch.zeros(big), torch.zeros(1)
        comm.recv(second, 0, False, hints={"tag": "2"})  # blocking: tag 1 must not block it
        w0 = comm.recv(untagged, 0, True)
        w1 = comm.recv(first, 0, True, hints={"tag": "1"})
        w1.wait()
        w0.wait()
        assert torch.equal(first, torch.full((big,), 1.0))
        got = [first[0].item(), second.item(), untagged.item()]
    comm.finalize()
    return got


def test_tagged_messages_match_by_tag_out_of_order() -> None:
    assert run_ranks(_tags_out_of_order, 2, timeout=60)[1] == [1.0, 2.0, 3.0]


# ----------------------------------------------------------------------------- 6. selection


def _selection(ctx: RankContext) -> dict[str, Any]:
    """Which transport each setting picks, and how invalid or impossible settings fail."""
    me = ctx.rank
    out: dict[str, Any] = {}
    seq = iter(range(100))

    def make(**kw: Any) -> str:
        comm = new_comm(
            "gloo",
            CPU,
            name=f"sel{next(seq)}",
            store=ctx.store,
            timeout=timedelta(seconds=30),
            **kw,
        )
        t = torch.full((5,), float(me + 1))
        comm.all_reduce(t, ReduceOp.SUM, False)
        assert torch.equal(t, torch.full((5,), 3.0))
        transport = _transport(comm)
        comm.finalize()
        return transport

    def fails(exc_type: type[BaseException], **kw: Any) -> str:
        with pytest.raises(exc_type) as info:
            new_comm(
                "gloo",
                CPU,
                name=f"sel{next(seq)}",
                store=ctx.store,
                timeout=timedelta(seconds=30),
                **kw,
            )
        return str(info.value)

    for var in ("TORCHCOMM_TRANSPORT", "TORCHCOMM_HOST_ID"):
        os.environ.pop(var, None)
    out["default"] = make()
    out["hint_shm"] = make(hints={"transport": "shm"})
    out["hint_tcp"] = make(hints={"transport": "tcp"})
    out["hint_auto"] = make(hints={"transport": " AUTO "})
    os.environ["TORCHCOMM_TRANSPORT"] = "tcp"
    out["env_tcp"] = make()
    out["env_tcp_hint_shm"] = make(hints={"transport": "shm"})  # the hint wins
    os.environ["TORCHCOMM_TRANSPORT"] = "shm"
    out["env_shm"] = make()
    os.environ["TORCHCOMM_TRANSPORT"] = "carrier-pigeon"
    out["env_invalid"] = fails(RuntimeError)
    del os.environ["TORCHCOMM_TRANSPORT"]
    out["hint_invalid"] = fails(RuntimeError, hints={"transport": "udp"})
    # A bad shm size setting fails on every rank at once (not only where it is read first).
    start = time.monotonic()
    out["slot_invalid"] = fails(RuntimeError, hints={"transport": "shm", "shm_slot_bytes": "1000"})
    out["slot_invalid_s"] = time.monotonic() - start
    # Different hosts (as far as locality knows): auto falls back to TCP, forced shm refuses.
    os.environ["TORCHCOMM_HOST_ID"] = f"simulated-host-{me}"
    out["two_hosts_auto"] = make()
    out["two_hosts_shm"] = fails(CommError, hints={"transport": "shm"})
    os.environ["TORCHCOMM_HOST_ID"] = "one-simulated-host"
    out["same_host_id"] = make()
    del os.environ["TORCHCOMM_HOST_ID"]
    return out


def test_transport_selection_by_hint_env_and_host_identity() -> None:
    for rank, r in enumerate(run_ranks(_selection, 2, timeout=120)):
        for key in (
            "default",
            "hint_shm",
            "hint_auto",
            "env_shm",
            "env_tcp_hint_shm",
            "same_host_id",
        ):
            assert r[key].startswith("shm (2 ranks on this host"), (rank, key, r[key])
        for key in ("hint_tcp", "env_tcp"):
            assert r[key] == "tcp (loopback: all ranks on this host)", (rank, key, r[key])
        # Hierarchical placement needs a host with several members; one per host is plain TCP.
        assert r["two_hosts_auto"] == "tcp (default interface: 2 hosts)", (rank, r)
        assert r["env_invalid"] == (
            "Invalid value for TORCHCOMM_TRANSPORT: 'carrier-pigeon' (expected one of auto, shm, tcp)"
        ), r
        assert (
            r["hint_invalid"]
            == "Invalid value for hint transport: 'udp' (expected one of auto, shm, tcp)"
        ), r
        assert r["slot_invalid"] == (
            "Invalid value for shm slot bytes: 1000 (must be a multiple of 4096, at least 4096)"
        ), r
        assert r["slot_invalid_s"] < 10, r  # not the 30 s comm timeout on the ranks that wait
        assert r["two_hosts_shm"] == (
            f"[TorchCommGloo comm=sel{11} rank={rank}] transport=shm requested but the members "
            "span 2 hosts; use auto or tcp"
        ), r


# ----------------------------------------------------------------------------- 7. bad settings


def test_bad_sizes_wait_policy_segments_and_platform_raise_clear_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Single-process checks of every set-up error the transport can raise, by type and text."""
    from torchcomms import config
    from torchcomms.backends.cpu.shm import ops as shm_ops
    from torchcomms.transport.shm.channel import Layout
    from torchcomms.transport.wait_policy import WaitPolicy

    # Byte counts: units accepted, garbage and negatives refused with the setting's name.
    assert config.parse_bytes("TORCHCOMM_SHM_SLOT_BYTES", "64K") == 65536
    assert config.parse_bytes("TORCHCOMM_SHM_SLOT_BYTES", "4MiB") == 4 << 20
    with pytest.raises(RuntimeError, match=r"TORCHCOMM_SHM_SLOT_BYTES: '4X' \(expected a byte"):
        config.parse_bytes("TORCHCOMM_SHM_SLOT_BYTES", "4X")
    with pytest.raises(RuntimeError, match=r"hint shm_pair_bytes: '-1' \(must not be negative\)"):
        config.parse_bytes("hint shm_pair_bytes", "-1")
    with pytest.raises(ValueError, match="positive multiples of 4096"):
        Layout(2, 1000, 4096)

    # The wait-policy override: three integers, or a clear error.
    monkeypatch.setenv("TORCHCOMM_SHM_WAIT", "0,20,500")
    policy = WaitPolicy(2, cores=2)
    assert policy.spins == 0
    assert policy.yield_s == pytest.approx(20e-6) and policy.sleep_max_s == pytest.approx(500e-6)
    monkeypatch.setenv("TORCHCOMM_SHM_WAIT", "1,2")
    with pytest.raises(RuntimeError, match=r"TORCHCOMM_SHM_WAIT: '1,2' \(expected spins,"):
        WaitPolicy(2, cores=2)
    monkeypatch.delenv("TORCHCOMM_SHM_WAIT")
    assert WaitPolicy(4, cores=2).spins == 0 and WaitPolicy(2, cores=2).spins > 0

    # Segment files: only our own names, and a mapping of the wrong size is refused.
    with pytest.raises(ValueError, match="not a torchcomms segment name"):
        shm_segment.attach("../etc/passwd", 4096)
    name = shm_segment.new_name()
    shm_segment.create(name, 4096).close()
    try:
        with pytest.raises(RuntimeError, match=f"{name} has 4096 bytes, expected 8192"):
            shm_segment.attach(name, 8192)
    finally:
        shm_segment.unlink(name)
    assert not os.path.exists(os.path.join(shm_segment.SHM_DIR, name))

    # A machine without x86 store ordering: auto falls back to gloo, forced shm says why.
    monkeypatch.setattr(shm_ops.platform, "machine", lambda: "aarch64")
    assert shm_ops.unsupported_reason() == (
        "the shm transport relies on x86 store ordering; this machine is aarch64"
    )
    monkeypatch.setenv("TORCHCOMM_RANK", "0")
    monkeypatch.setenv("TORCHCOMM_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "0")
    with pytest.raises(CommError, match="transport=shm requested but unavailable: the shm trans"):
        new_comm("gloo", CPU, name="arm_shm", hints={"transport": "shm"})
    comm = new_comm("gloo", CPU, name="arm_auto")
    try:
        assert comm.get_backend_impl().transport.startswith("tcp (loopback"), (  # type: ignore[attr-defined]
            comm.get_backend_impl().transport  # type: ignore[attr-defined]
        )
        t = torch.ones(3)
        comm.all_reduce(t, ReduceOp.SUM, False)
        assert torch.equal(t, torch.ones(3))
    finally:
        comm.finalize()


# -------------------------------------------------- single copy (large all_gather, all_to_all)
def _chunk(src: int, dst: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """What rank ``src`` sends rank ``dst``: small integers, exact in every dtype."""
    vals = torch.arange(numel, dtype=torch.int64) * 7 + src * 1000 + dst
    return (vals % 2).to(dtype) if dtype == torch.bool else (vals % 120).to(dtype)


def _single_copy(ctx: RankContext, disable_on: int) -> dict[str, Any]:
    """Large all_gather, all_to_all and broadcast (every path into ``cpu.shm.single_copy``),
    every dtype, out of place, in place, and all_gather's input another rank's row; then a communicator on which one rank turned the
    path off."""
    me, n = ctx.rank, ctx.world_size
    got: dict[str, Any] = {}
    for label, off in (("on", False), ("one_rank_off", me == disable_on)):
        if off:
            os.environ["TORCHCOMM_SHM_SINGLE_COPY"] = "0"
        comm = _shm(ctx, f"single_{label}")
        os.environ.pop("TORCHCOMM_SHM_SINGLE_COPY", None)
        wrong = []
        for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool):
            per = ((160 << 10) + 3) // torch.empty(0, dtype=dtype).element_size() + 1

            mine = _chunk(me, 0, per, dtype)
            want = torch.cat([_chunk(r, 0, per, dtype) for r in range(n)])
            out = torch.zeros(n * per, dtype=dtype)
            comm.all_gather_single(out, mine, False)
            wrong += [f"all_gather {dtype}"] if not torch.equal(out, want) else []
            inplace = torch.zeros(n * per, dtype=dtype)
            inplace[me * per : (me + 1) * per] = mine
            version = inplace._version
            comm.all_gather_single(inplace, inplace[me * per : (me + 1) * per], False)
            wrong += [f"all_gather in place {dtype}"] if not torch.equal(inplace, want) else []
            # Written outside torch, counted as an in-place write (autograd's version).
            wrong += [f"all_gather version {dtype}"] if inplace._version == version else []
            aliased = torch.zeros(n * per, dtype=dtype)  # input: another rank's row
            row = slice(((me + 1) % n) * per, ((me + 1) % n + 1) * per)
            aliased[row] = mine
            comm.all_gather_single(aliased, aliased[row], False)
            wrong += (
                [f"all_gather from another row {dtype}"] if not torch.equal(aliased, want) else []
            )
            inp = torch.cat([_chunk(me, d, per, dtype) for d in range(n)])
            want = torch.cat([_chunk(s, me, per, dtype) for s in range(n)])
            out = torch.zeros_like(inp)
            comm.all_to_all_single(out, inp, False)
            wrong += [f"all_to_all {dtype}"] if not torch.equal(out, want) else []
            comm.all_to_all_single(inp, inp, False)
            wrong += [f"all_to_all in place {dtype}"] if not torch.equal(inp, want) else []
            root = n - 1
            want = _chunk(root, 9, 16 * per, dtype)
            buf = want.clone() if me == root else torch.zeros_like(want)
            version = buf._version
            comm.broadcast(buf, root, False)
            wrong += [f"broadcast {dtype}"] if not torch.equal(buf, want) else []
            if me != root and buf._version == version:
                wrong.append(f"broadcast version {dtype}")
        single = comm.get_backend_impl()._ops.coll.single.usable  # type: ignore[attr-defined]
        got[label] = {"wrong": wrong, "single_copy": single}
        comm.finalize()
    return got


def test_large_all_gather_all_to_all_and_broadcast_copy_once_and_agree_to_fall_back() -> None:
    results = run_ranks(_single_copy, 3, 2, timeout=120)
    for rank, res in enumerate(results):
        assert res["on"] == {"wrong": [], "single_copy": True}, (rank, res)
        # One rank said no: every rank took the slot path, with the same results.
        assert res["one_rank_off"] == {"wrong": [], "single_copy": False}, (rank, res)


def _two_rank_copies(ctx: RankContext, comm: TorchComm) -> list[str]:
    """all_gather (out of place, in place, from another rank's row) and all_to_all (out of
    place, in place) of just over a slot per rank, so the slot path runs two rounds."""
    me, wrong = ctx.rank, []
    for dtype in (torch.float32, torch.bfloat16, torch.bool):
        per = ((1 << 20) + 3) // torch.empty(0, dtype=dtype).element_size() + 1
        mine = _chunk(me, 0, per, dtype)
        want = torch.cat([_chunk(r, 0, per, dtype) for r in range(2)])
        out = torch.zeros(2 * per, dtype=dtype)
        comm.all_gather_single(out, mine, False)
        wrong += [f"all_gather {dtype}"] if not torch.equal(out, want) else []
        inplace = torch.zeros(2 * per, dtype=dtype)
        inplace[me * per : (me + 1) * per] = mine
        comm.all_gather_single(inplace, inplace[me * per : (me + 1) * per], False)
        wrong += [f"all_gather in place {dtype}"] if not torch.equal(inplace, want) else []
        aliased = torch.zeros(2 * per, dtype=dtype)  # input: the other rank's row
        row = slice((1 - me) * per, (2 - me) * per)
        aliased[row] = mine
        comm.all_gather_single(aliased, aliased[row], False)
        wrong += [f"all_gather from another row {dtype}"] if not torch.equal(aliased, want) else []
        inp = torch.cat([_chunk(me, d, per, dtype) for d in range(2)])
        want = torch.cat([_chunk(s, me, per, dtype) for s in range(2)])
        out = torch.zeros_like(inp)
        comm.all_to_all_single(out, inp, False)
        wrong += [f"all_to_all {dtype}"] if not torch.equal(out, want) else []
        comm.all_to_all_single(inp, inp, False)
        wrong += [f"all_to_all in place {dtype}"] if not torch.equal(inp, want) else []
    return wrong


def _pair_ops(ctx: RankContext, disable_on: int) -> dict[str, Any]:
    """Large all_reduce, reduce and broadcast between two ranks, from 512 KiB by the single copy
    (``SingleCopy.all_reduce_pair``, ``reduce_pair``, ``broadcast``): odd sizes, every op on
    five dtypes, reduce and broadcast from either root.  Then a communicator on which one rank
    turned the single copy off: the slot path, where two ranks trade halves of two-slot
    chunks, and (``_two_rank_copies``) all_gather and all_to_all pass only the peer's part
    through the slots."""
    me = ctx.rank
    got: dict[str, Any] = {}
    for label, off in (("on", False), ("one_rank_off", me == disable_on)):
        if off:
            os.environ["TORCHCOMM_SHM_SINGLE_COPY"] = "0"
        comm = _shm(ctx, f"pair_{label}", hints={"shm_slot_bytes": "1M", "shm_oneshot_max": "1M"})
        os.environ.pop("TORCHCOMM_SHM_SINGLE_COPY", None)
        wrong = []
        dtypes = (torch.float32, torch.bfloat16, torch.int32, torch.uint8, torch.bool)
        for dtype in dtypes if label != "one_rank_off" else (torch.float32,):
            # just over 2 MiB (two of the slot path's pair chunks) and 768 KiB (one slot: the
            # single copy, or the one-shot round)
            for nbytes in ((2 << 20) + 5, 768 << 10):
                n = nbytes // torch.empty(0, dtype=dtype).element_size() + 1
                for red in reds_for(dtype) if label != "one_rank_off" else ("SUM",):
                    inputs = [data(r, n, dtype, red) for r in range(2)]
                    want = reduce_ref(inputs, red, dtype)
                    t = inputs[me].clone()
                    comm.all_reduce(t, make_op(red), False)
                    if not _close(t, want, dtype, red):
                        wrong.append(f"all_reduce {nbytes} {dtype} {red}")
                    for root in (0, 1):
                        t = inputs[me].clone()
                        comm.reduce(t, root, make_op(red), False)
                        if not _close(t, want if me == root else inputs[me], dtype, red):
                            wrong.append(f"reduce {nbytes} to {root} {dtype} {red}")
                # broadcast: with a core per rank the root writes the first half into its peer
                # as the peer reads the second (an odd size: the split is rounded to pages).
                for root in (0, 1):
                    want = data(root, n, dtype, "SUM")
                    buf = want.clone() if me == root else torch.zeros_like(want)
                    comm.broadcast(buf, root, False)
                    if not torch.equal(buf, want):
                        wrong.append(f"broadcast {nbytes} from {root} {dtype}")
        if label == "one_rank_off":
            wrong += _two_rank_copies(ctx, comm)
        coll = comm.get_backend_impl()._ops.coll  # type: ignore[attr-defined]
        got[label] = {"wrong": wrong, "single_copy": coll.single.usable}
        if label == "on":
            assert coll.single.own_cores == (not coll.chan.policy.oversubscribed)
            # A peer that is alive but whose memory is not there (address 4096): the failure
            # names the peer and the kernel's reason, and touches nothing here.
            word = torch.full((1,), 7, dtype=torch.int64)
            for write, doing in (
                (True, "writing into the memory of"),
                (False, "reading the data of"),
            ):
                with pytest.raises(WaitError) as info:
                    coll.single._move(write, 1 - me, word.data_ptr(), 4096, 8, "reduce")
                assert info.value.kind == "peer_failed" and info.value.ranks == [1 - me]
                assert (
                    str(info.value) == f"{doing} peer rank {1 - me} for reduce failed: Bad address"
                )
            assert word.item() == 7
            comm.barrier(False)  # neither returns while the other still probes its memory
        comm.finalize()
    return got


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, red: str) -> bool:
    if red == "AVG" and dtype.is_floating_point:
        rtol, atol = FLOAT_TOL[dtype]
        return torch.allclose(got.double(), want.double(), rtol=rtol, atol=atol)
    return torch.equal(got, want)


def test_large_ops_of_two_ranks_read_each_byte_once_and_agree_to_fall_back() -> None:
    results = run_ranks(_pair_ops, 2, 0, timeout=180)
    for rank, res in enumerate(results):
        assert res["on"] == {"wrong": [], "single_copy": True}, (rank, res)
        assert res["one_rank_off"] == {"wrong": [], "single_copy": False}, (rank, res)


def _probed(ctx: RankContext, name: str, rendezvous: bool, **kw: Any) -> TorchComm:
    """A 2-rank comm whose first op (an all_gather of 256 KiB per rank) ran the single-copy
    probe; with ``rendezvous`` this rank sends its large messages by rendezvous
    (``transport.shm.p2p``)."""
    if rendezvous:
        os.environ["TORCHCOMM_SHM_P2P_RENDEZVOUS"] = "1"
    try:
        comm = _shm(ctx, name, hints={"shm_slot_bytes": "1M"}, **kw)
    finally:
        os.environ.pop("TORCHCOMM_SHM_P2P_RENDEZVOUS", None)
    out = torch.zeros(2 * (64 << 10))
    comm.all_gather_single(out, out[ctx.rank * (64 << 10) : (ctx.rank + 1) * (64 << 10)], False)
    assert comm.get_backend_impl()._ops.coll.single.usable is True  # type: ignore[attr-defined]
    return comm


def _rendezvous(ctx: RankContext) -> dict[str, Any]:
    """Large send/recv between two ranks, rank 0 sending by rendezvous and rank 1 through the
    rings (the default): crossed async sends, blocking pairs of an odd size, mixed sizes in
    issue order (rendezvous and ring alike), tagged messages received out of order (one waits
    as an unexpected message), then a size mismatch."""
    from torchcomms.transport.shm import p2p

    me, peer = ctx.rank, 1 - ctx.rank
    reads = []
    read = p2p.ShmP2P._rendezvous_read

    def counted(self: Any, t: Any, src: int, address: int) -> bool:
        reads.append(t.nbytes)
        return read(self, t, src, address)

    p2p.ShmP2P._rendezvous_read = counted  # type: ignore[method-assign]
    comm = _probed(ctx, "rndv", rendezvous=me == 0)
    big = (3 << 20) // 4
    send = comm.send(torch.full((big,), float(10 * me + peer)), peer, True)
    got = torch.empty(big)
    comm.recv(got, peer, True).wait()
    send.wait()
    assert torch.equal(got, torch.full((big,), float(10 * peer + me)))
    odd = (2 << 20) + 5
    mine, theirs = _chunk(me, peer, odd, torch.uint8), torch.zeros(odd, dtype=torch.uint8)
    if me == 0:
        comm.send(mine, peer, False)
        comm.recv(theirs, peer, False)
    else:
        comm.recv(theirs, peer, False)
        comm.send(mine, peer, False)
    assert torch.equal(theirs, _chunk(peer, me, odd, torch.uint8))
    lengths = (2 << 20, 5, 1 << 20, 0, (1 << 20) - 8, 3 << 20)  # bytes, int64 elements below
    if me == 0:
        works = [
            comm.send(torch.full((n // 8,), i, dtype=torch.int64), 1, True)
            for i, n in enumerate(lengths)
        ]
        for tag, value in ((5, 5.0), (6, 6.0)):
            works.append(comm.send(torch.full((big,), value), 1, True, hints={"tag": str(tag)}))
        for work in works:
            work.wait()
    else:
        for i, n in enumerate(lengths):
            t = torch.full((n // 8,), -1, dtype=torch.int64)
            comm.recv(t, 0, False)
            assert torch.equal(t, torch.full((n // 8,), i, dtype=torch.int64)), (i, n)
        six, five = torch.zeros(big), torch.zeros(big)
        comm.recv(six, 0, False, hints={"tag": "6"})  # tag 5's message waits, unexpected
        comm.recv(five, 0, False, hints={"tag": "5"})
        assert torch.equal(six, torch.full((big,), 6.0)) and torch.equal(
            five, torch.full((big,), 5.0)
        )
    # A read the kernel refuses (address 4096 of a live peer) fails the message, naming the
    # peer and the reason, and writes nothing.
    engine = comm.get_backend_impl()._ops.p2p  # type: ignore[attr-defined]
    bad_read = p2p.Transfer(False, peer, torch.full((8,), 7, dtype=torch.uint8), None)
    refused = [read(engine, bad_read, peer, 4096), str(bad_read.error)]
    refused += [bad_read.error.kind if bad_read.error else None, bad_read.buf.tolist()]
    comm.barrier(False)
    comm.finalize()

    # A size mismatch fails the receive at once; the sender, still waiting for its message
    # to be read, learns that its peer failed.
    bad = _probed(ctx, "rndv_size", rendezvous=me == 0, timeout=timedelta(seconds=30))
    start = time.monotonic()
    try:
        if me == 0:
            bad.send(torch.ones((2 << 20) // 4), 1, False)
        else:
            bad.recv(torch.ones((3 << 20) // 4), 0, False)
    except CommError as exc:
        error = {"type": type(exc).__name__, "text": str(exc), "s": time.monotonic() - start}
    else:
        error = {"type": None}
    bad.finalize()
    return {"reads": reads, "error": error, "refused": refused}


def test_large_messages_go_by_rendezvous_in_order_tagged_and_mismatched() -> None:
    results = run_ranks(_rendezvous, 2, timeout=120)
    # Rank 1 read every message of rank 0's from 1 MiB out of its memory, none smaller; rank
    # 0 read none (rank 1 sends through the rings).
    reads = results[1]["reads"]
    assert len(reads) == 7 and min(reads) >= 1 << 20 and results[0]["reads"] == [], results
    receiver, sender = results[1]["error"], results[0]["error"]
    assert receiver["type"] == "CollectiveMismatchError", receiver
    assert "2097152 bytes sent, 3145728 bytes expected" in receiver["text"], receiver
    assert sender["type"] == "PeerFailureError" and "peer rank 1" in sender["text"], sender
    assert sender["s"] < DEAD_PEER_BOUND_S, sender
    for rank, res in enumerate(results):
        text = f"reading a message from peer rank {1 - rank} failed: Bad address"
        assert res["refused"] == [False, text, "peer_failed", [7] * 8], (rank, res["refused"])


def _rendezvous_sender_killed(ctx: RankContext, report_dir: str) -> None:
    """Rank 1 announces a 2 MiB message by rendezvous and dies; rank 0 posts its receive
    half a second later (a receive that reads while the dying process still has its memory
    gets the message: the sender delivered, then left), finds the announcement, and its
    read finds the process gone: ``PeerFailureError`` naming rank 1, nothing written."""
    from torchcomms.transport.shm import p2p

    comm = _probed(ctx, "rndv_dead", rendezvous=ctx.rank == 1)
    n = (2 << 20) // 4
    if ctx.rank == 1:
        announce = p2p.ShmP2P._rendezvous_send

        def then_die(self: Any, t: Any, acked: int) -> bool:
            done = announce(self, t, acked)
            if t.rendezvous > 0:
                os.kill(os.getpid(), signal.SIGKILL)
            return done

        p2p.ShmP2P._rendezvous_send = then_die  # type: ignore[method-assign]
        comm.send(torch.ones(n), 0, False)
        raise AssertionError("rank 1 should have died")
    attempts = []
    read = p2p.ShmP2P._rendezvous_read

    def counted(self: Any, t: Any, src: int, address: int) -> bool:
        attempts.append(t.nbytes)
        return read(self, t, src, address)

    p2p.ShmP2P._rendezvous_read = counted  # type: ignore[method-assign]
    time.sleep(0.5)
    start = time.monotonic()
    got = torch.zeros(n)
    try:
        comm.recv(got, 1, False)
    except Exception as exc:
        seen: dict[str, Any] = {"type": type(exc).__name__, "text": str(exc)}
    else:
        seen = {"type": None, "text": "returned"}
    seen["s"] = time.monotonic() - start
    seen["untouched"] = bool(torch.equal(got, torch.zeros(n)))
    # Progress after the failure neither reads the message again nor keeps it as unexpected.
    engine = comm.get_backend_impl()._ops.p2p  # type: ignore[attr-defined]
    for _ in range(3):
        engine._progress_in_background()
    seen["attempts"] = attempts
    seen["unexpected"] = len(engine._incoming[1].unexpected)
    Path(report_dir, "rank0.json").write_text(json.dumps(seen))
    comm.finalize()


def test_a_sender_killed_before_its_rendezvous_is_read_is_named(tmp_path: Path) -> None:
    _run_one_killed(_rendezvous_sender_killed, 2, 1, tmp_path)
    got = json.loads((tmp_path / "rank0.json").read_text())
    assert got["type"] == PeerFailureError.__name__, got
    assert "peer rank 1 died (process gone) while this rank read its message" in got["text"]
    assert got["untouched"] and got["s"] < DEAD_PEER_BOUND_S, got
    assert got["attempts"] == [2 << 20] and got["unexpected"] == 0, got
