"""``torchcomms.distwrap``'s collectives, point-to-point and object calls, in both routing modes.

One task of three ranks (``tests/distwrap_cases.py``).  ``_every_call`` runs each call sync
and async on integer-valued data through a namespace: distwrap with ``use_torchcomms=True``
(values checked exactly), and, on a pass-through world, distwrap and torch.distributed itself,
whose results must be equal bit for bit.  The torchcomms-only paths (PREMUL_SUM, uneven
sizes, ``reduce_scatter_quantized``, windows) and the errors of bad input, which leave the
group usable, have cases of their own.
"""

from __future__ import annotations

import functools
import operator
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as tdist
from torch._C._distributed_c10d import PrefixStore

from tests.distwrap_cases import Cases
from tests.harness import RankContext
from torchcomms import distwrap as dist
from torchcomms.errors import CommValidationError
from torchcomms.runtime.work import TorchWork

WORLD = 3
cases = Cases()


def _init(ctx: RankContext, torchcomms: bool, tag: str) -> None:
    dist.init_process_group("gloo", store=PrefixStore(tag, ctx.store), use_torchcomms=torchcomms)


def _wait(work: Any) -> None:
    assert work is not None
    work.wait()


def _every_call(ns: ModuleType, r: int, n: int) -> dict[str, Any]:
    """Run every call of ``ns`` (distwrap or torch.distributed); return what each produced."""
    out: dict[str, Any] = {}
    base = torch.arange(4, dtype=torch.float32) + 10 * r
    ops = {"sum": ns.ReduceOp.SUM, "max": ns.ReduceOp.MAX, "min": ns.ReduceOp.MIN,
           "product": ns.ReduceOp.PRODUCT}  # fmt: skip
    for name, op in ops.items():
        t = base.clone()
        assert ns.all_reduce(t, op=op) is None
        out[f"all_reduce_{name}"] = t
    t = torch.full((4,), float(3 * r))
    ns.all_reduce(t, ns.ReduceOp.AVG)
    out["all_reduce_avg"] = t
    for name, op in {"band": ns.ReduceOp.BAND, "bor": ns.ReduceOp.BOR,
                     "bxor": ns.ReduceOp.BXOR}.items():  # fmt: skip
        t = torch.tensor([1 << r, 7, r + 1], dtype=torch.int64)
        ns.all_reduce(t, op)
        out[f"all_reduce_{name}"] = t
    t = base.clone()
    _wait(ns.all_reduce(t, async_op=True))
    out["all_reduce_async"] = t

    t = base.clone()
    ns.broadcast(t, src=1)
    out["broadcast"] = t
    t = base.clone()
    _wait(ns.broadcast(t, group_src=2, async_op=True))
    out["broadcast_group_src_async"] = t
    t = base.clone()
    ns.reduce(t, dst=0)
    out["reduce"] = t if r == 0 else None
    t = base.clone()
    _wait(ns.reduce(t, group_dst=2, op=ns.ReduceOp.MAX, async_op=True))
    out["reduce_async"] = t if r == 2 else None

    outs = [torch.zeros(4) for _ in range(n)]
    ns.all_gather(outs, base)
    out["all_gather"] = torch.stack(outs)
    outs = [torch.zeros(4) for _ in range(n)]
    _wait(ns.all_gather(outs, base, async_op=True))
    out["all_gather_async"] = torch.stack(outs)
    flat = torch.zeros(4 * n)
    ns.all_gather_into_tensor(flat, base)
    out["all_gather_into_tensor"] = flat
    flat = torch.zeros(4 * n)
    _wait(ns.all_gather_into_tensor(flat, base, async_op=True))
    out["all_gather_into_tensor_async"] = flat

    inputs = [base + 100 * j for j in range(n)]
    t = torch.zeros(4)
    ns.reduce_scatter(t, inputs)
    out["reduce_scatter"] = t
    t = torch.zeros(4)
    _wait(ns.reduce_scatter(t, inputs, ns.ReduceOp.MAX, async_op=True))
    out["reduce_scatter_async"] = t
    t = torch.zeros(4)
    ns.reduce_scatter_tensor(t, torch.cat(inputs))
    out["reduce_scatter_tensor"] = t
    t = torch.zeros(4)
    _wait(ns.reduce_scatter_tensor(t, torch.cat(inputs), async_op=True))
    out["reduce_scatter_tensor_async"] = t

    outs = [torch.zeros(4) for _ in range(n)]
    ns.all_to_all(outs, inputs)
    out["all_to_all"] = torch.stack(outs)
    outs = [torch.zeros(4) for _ in range(n)]
    _wait(ns.all_to_all(outs, inputs, async_op=True))
    out["all_to_all_async"] = torch.stack(outs)
    t = torch.zeros(4 * n)
    ns.all_to_all_single(t, torch.cat(inputs))
    out["all_to_all_single"] = t
    in_splits = [j + 1 for j in range(n)]
    out_splits = [r + 1] * n
    src = torch.arange(sum(in_splits), dtype=torch.float32) + 100 * r
    t = torch.zeros(sum(out_splits))
    _wait(ns.all_to_all_single(t, src, out_splits, in_splits, async_op=True))
    out["all_to_all_single_splits_async"] = t

    t = torch.zeros(4)
    ns.scatter(t, inputs if r == 0 else None, src=0)
    out["scatter"] = t
    t = torch.zeros(4)
    _wait(ns.scatter(t, inputs if r == 1 else None, group_src=1, async_op=True))
    out["scatter_async"] = t
    got = [torch.zeros(4) for _ in range(n)] if r == 2 else None
    ns.gather(base, got, dst=2)
    out["gather"] = torch.stack(got) if got is not None else None
    got = [torch.zeros(4) for _ in range(n)] if r == 0 else None
    _wait(ns.gather(base, got, group_dst=0, async_op=True))
    out["gather_async"] = torch.stack(got) if got is not None else None

    # scatter and gather (and three object calls) default to global rank 0, as torch's do
    t = torch.zeros(4)
    ns.scatter(t, inputs if r == 0 else None)
    out["scatter_default_src"] = t
    got = [torch.zeros(4) for _ in range(n)] if r == 0 else None
    ns.gather(base, got)
    out["gather_default_dst"] = torch.stack(got) if got is not None else None

    assert ns.barrier() is None
    _wait(ns.barrier(async_op=True))

    # point to point on a ring: even ranks send first, odd ranks receive first
    nxt, prv = (r + 1) % n, (r - 1) % n
    t = torch.zeros(4)
    if r % 2 == 0:
        ns.send(base, dst=nxt)
        sender = ns.recv(t, src=prv)
    else:
        sender = ns.recv(t, src=prv)
        ns.send(base, dst=nxt)
    out["send_recv"] = t
    out["recv_returns_the_sender"] = torch.tensor([sender])
    t = torch.zeros(4)
    works = [ns.irecv(t, src=prv, tag=5), ns.isend(base, dst=nxt, tag=5)]
    for w in works:
        _wait(w)
    out["isend_irecv_tagged"] = t
    t = torch.zeros(4)
    works = [ns.irecv(t, group_src=nxt), ns.isend(base, group_dst=prv)]
    for w in works:
        _wait(w)
    out["isend_irecv_group_peer"] = t
    a, b = torch.zeros(4), torch.zeros(4)
    batch = [
        ns.P2POp(ns.isend, base, nxt),
        ns.P2POp(ns.irecv, a, prv),
        ns.P2POp(ns.isend, base * 2, group_peer=prv),
        ns.P2POp(ns.irecv, b, group_peer=nxt),
    ]
    works = ns.batch_isend_irecv(batch)
    assert len(works) == 4
    for w in works:
        _wait(w)
    out["batch_isend_irecv"] = torch.stack([a, b])

    objs: list[Any] = [None] * n
    ns.all_gather_object(objs, {"rank": r, "name": f"r{r}"})
    out["all_gather_object"] = objs
    gathered: list[Any] | None = [None] * n if r == 0 else None
    ns.gather_object(("g", r), gathered, dst=0)
    out["gather_object"] = gathered
    received: list[Any] = [None]
    ns.scatter_object_list(received, [[j] * j for j in range(n)] if r == 1 else None, src=1)
    out["scatter_object_list"] = received
    bcast: list[Any] = [{"from": r}, r] if r == 2 else [None, None]
    ns.broadcast_object_list(bcast, group_src=2)
    out["broadcast_object_list"] = bcast
    defaults: list[Any] = [f"from {r}"]
    ns.broadcast_object_list(defaults)
    gathered = [None] * n if r == 0 else None
    ns.gather_object(r * r, gathered)
    received = [None]
    ns.scatter_object_list(received, list(range(10, 10 + n)) if r == 0 else None)
    out["object_calls_default_to_rank_0"] = [defaults, gathered, received]
    return out


def _expected(r: int, n: int) -> dict[str, Any]:
    """What every call of ``_every_call`` must produce on rank ``r`` (integer-valued)."""
    f = torch.float32
    base = [torch.arange(4, dtype=f) + 10 * j for j in range(n)]
    inputs = [[base[j] + 100 * k for k in range(n)] for j in range(n)]  # inputs[sender][dest]
    src_v = [torch.arange(sum(k + 1 for k in range(n)), dtype=f) + 100 * j for j in range(n)]
    off = sum(k + 1 for k in range(r))
    nxt, prv = (r + 1) % n, (r - 1) % n
    e: dict[str, Any] = {
        "all_reduce_sum": sum(base),
        "all_reduce_max": base[-1],
        "all_reduce_min": base[0],
        "all_reduce_product": torch.stack(base).prod(0),
        "all_reduce_avg": torch.full((4,), float(3 * sum(range(n)) / n)),
        "all_reduce_band": _bits(operator.and_, n),
        "all_reduce_bor": _bits(operator.or_, n),
        "all_reduce_bxor": _bits(operator.xor, n),
        "all_reduce_async": sum(base),
        "broadcast": base[1],
        "broadcast_group_src_async": base[2],
        "reduce": sum(base) if r == 0 else None,
        "reduce_async": base[-1] if r == 2 else None,
        "all_gather": torch.stack(base),
        "all_gather_async": torch.stack(base),
        "all_gather_into_tensor": torch.cat(base),
        "all_gather_into_tensor_async": torch.cat(base),
        "reduce_scatter": sum(inputs[j][r] for j in range(n)),
        "reduce_scatter_async": inputs[-1][r],
        "reduce_scatter_tensor": sum(inputs[j][r] for j in range(n)),
        "reduce_scatter_tensor_async": sum(inputs[j][r] for j in range(n)),
        "all_to_all": torch.stack([inputs[j][r] for j in range(n)]),
        "all_to_all_async": torch.stack([inputs[j][r] for j in range(n)]),
        "all_to_all_single": torch.cat([inputs[j][r] for j in range(n)]),
        "all_to_all_single_splits_async": torch.cat(
            [src_v[j][off : off + r + 1] for j in range(n)]
        ),
        "scatter_default_src": inputs[0][r],
        "gather_default_dst": torch.stack(base) if r == 0 else None,
        "object_calls_default_to_rank_0": [
            ["from 0"],
            [j * j for j in range(n)] if r == 0 else None,
            [10 + r],
        ],
        "scatter": inputs[0][r],
        "scatter_async": inputs[1][r],
        "gather": torch.stack(base) if r == 2 else None,
        "gather_async": torch.stack(base) if r == 0 else None,
        "send_recv": base[prv],
        "recv_returns_the_sender": torch.tensor([prv]),
        "isend_irecv_tagged": base[prv],
        "isend_irecv_group_peer": base[nxt],
        "batch_isend_irecv": torch.stack([base[prv], base[nxt] * 2]),
        "all_gather_object": [{"rank": j, "name": f"r{j}"} for j in range(n)],
        "gather_object": [("g", j) for j in range(n)] if r == 0 else None,
        "scatter_object_list": [[r] * r],
        "broadcast_object_list": [{"from": 2}, 2],
    }
    return e


def _bits(op: Any, n: int) -> torch.Tensor:
    """The bitwise reduction over ranks of each rank's ``[1 << r, 7, r + 1]``."""
    rows = [[1 << j, 7, j + 1] for j in range(n)]
    return torch.tensor([functools.reduce(op, col) for col in zip(*rows, strict=True)])


def _same(a: Any, b: Any, exact_dtype: bool = True) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if exact_dtype and a.dtype != b.dtype:
            return False
        return a.shape == b.shape and bool(torch.equal(a.to(b.dtype), b))
    return bool(a == b)


def _compare(got: dict[str, Any], want: dict[str, Any], exact_dtype: bool) -> list[str]:
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    return [f"{k}: got {got[k]}, expected {want[k]}" for k in got
            if not _same(got[k], want[k], exact_dtype)]  # fmt: skip


@cases.case("every_call_on_torchcomms")
def _on_torchcomms(ctx: RankContext) -> None:
    _init(ctx, True, "tc")
    got = _every_call(dist, ctx.rank, ctx.world_size)
    wrong = _compare(got, _expected(ctx.rank, ctx.world_size), exact_dtype=False)
    assert not wrong, "\n".join(wrong)
    # Async calls return the communicator's works.
    work = dist.all_reduce(torch.ones(2), async_op=True)
    assert isinstance(work, TorchWork)
    work.wait()
    dist.destroy_process_group()


@cases.case("pass_through_is_torch_distributed_bit_for_bit")
def _pass_through(ctx: RankContext) -> None:
    _init(ctx, False, "pt")
    ours = _every_call(dist, ctx.rank, ctx.world_size)
    theirs = _every_call(tdist, ctx.rank, ctx.world_size)
    wrong = _compare(ours, theirs, exact_dtype=True)
    assert not wrong, "\n".join(wrong)
    wrong = _compare(ours, _expected(ctx.rank, ctx.world_size), exact_dtype=False)
    assert not wrong, "\n".join(wrong)
    # Floats with rounding: still torch's own bits.
    gen = torch.Generator().manual_seed(ctx.rank)
    x = torch.randn(1000, generator=gen)
    y = x.clone()
    dist.all_reduce(x)
    tdist.all_reduce(y)
    assert torch.equal(x, y)
    assert isinstance(dist.all_reduce(x, async_op=True), tdist.Work)
    dist.destroy_process_group()


@cases.case("premul_sum_and_uneven_sizes_on_torchcomms")
def _torchcomms_only(ctx: RankContext) -> None:
    r, n = ctx.rank, ctx.world_size
    _init(ctx, True, "tc_only")
    total = float(sum(range(1, n + 1)))
    for factor in (2.0, torch.tensor([2.0])):
        op = dist._make_nccl_premul_sum(factor)
        assert isinstance(op, tdist.ReduceOp)
        t = torch.full((3,), float(r + 1))
        dist.all_reduce(t, op=op)
        assert t.tolist() == [2 * total] * 3
    t = torch.zeros(2)
    dist.reduce_scatter_tensor(t, torch.ones(2 * n) * (r + 1), op=dist._make_nccl_premul_sum(0.5))
    assert t.tolist() == [total / 2] * 2
    t = torch.full((2,), float(r + 1))
    _wait(dist.reduce(t, dst=0, op=dist._make_nccl_premul_sum(3.0), async_op=True))
    if r == 0:
        assert t.tolist() == [3 * total] * 2
    # unequal sizes: all_gather_v / reduce_scatter_v
    outs = [torch.zeros(j + 1) for j in range(n)]
    dist.all_gather(outs, torch.full((r + 1,), float(r)))
    assert [o.tolist() for o in outs] == [[float(j)] * (j + 1) for j in range(n)]
    out = torch.zeros(r + 1)
    dist.reduce_scatter(out, [torch.full((j + 1,), float(r)) for j in range(n)])
    assert out.tolist() == [float(sum(range(n)))] * (r + 1)
    dist.destroy_process_group()


@cases.case("reduce_scatter_quantized")
def _quantized(ctx: RankContext) -> None:
    r, n = ctx.rank, ctx.world_size
    _init(ctx, True, "rsq")
    chunk = 64
    out = torch.zeros(chunk)
    work = dist.reduce_scatter_quantized(
        out, torch.ones(n * chunk), dist.ReduceOp.SUM, torch.tensor([42 + r])
    )
    work.wait()  # a work even when sync, as upstream's
    assert out.tolist() == [float(n)] * chunk  # ones are exact in bf16
    # Random data: within bf16's rounding of each contribution, the same bits for a seed.
    gen = torch.Generator().manual_seed(100 + r)
    x = torch.randn(n * chunk, generator=gen)
    runs = []
    for async_op in (False, True):
        out = torch.zeros(chunk)
        w = dist.reduce_scatter_quantized(
            out, x, dist.ReduceOp.AVG, torch.tensor([7]), async_op=async_op
        )
        w.wait()
        runs.append(out)
    assert torch.equal(runs[0], runs[1])
    exact = torch.zeros(chunk)
    dist.reduce_scatter_tensor(exact, x, op=dist.ReduceOp.AVG)
    torch.testing.assert_close(runs[0], exact, atol=2e-2, rtol=1e-2)
    # Bad input: refused before anything moves; the group still works.
    with pytest.raises(TypeError, match=r"input must be a float32 tensor, got torch\.float16"):
        dist.reduce_scatter_quantized(out, x.half(), dist.ReduceOp.SUM, torch.tensor([1]))
    with pytest.raises(ValueError, match=r"op must be ReduceOp\.SUM or ReduceOp\.AVG"):
        dist.reduce_scatter_quantized(out, x, dist.ReduceOp.MAX, torch.tensor([1]))
    with pytest.raises(ValueError, match=r"input has 3 elements, expected output\.numel"):
        dist.reduce_scatter_quantized(out, torch.ones(3), dist.ReduceOp.SUM, torch.tensor([1]))
    with pytest.raises(TypeError, match="seed must be a one-element int64 tensor"):
        dist.reduce_scatter_quantized(out, x, dist.ReduceOp.SUM, torch.tensor([1.0]))
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [float(n)] * 2
    dist.destroy_process_group()


@cases.case("window_allocator_and_torch_s_own_calls_on_torchcomms")
def _extensions(ctx: RankContext) -> None:
    r, n = ctx.rank, ctx.world_size
    _init(ctx, True, "ext")
    window = dist.new_window()
    buf = torch.zeros(n)
    window.tensor_register(buf)
    nxt, prv = (r + 1) % n, (r - 1) % n
    window.put(torch.tensor([float(r + 1)]), nxt, r, False)
    window.signal(nxt, False)
    window.wait_signal(prv, False)
    assert buf[prv].item() == float(prv + 1)
    window.tensor_deregister()
    assert dist.new_window(backend="gloo") is not None
    # The communicator's own answer (TorchComm.mem_allocator): no allocator for gloo on CPU.
    with pytest.raises(RuntimeError, match=r"(?i)allocator.*gloo"):
        dist.get_mem_allocator(None, torch.device("cpu"))
    assert dist.register_mem_pool(None, torch.device("cpu"), object()) is None  # upstream: no-op
    with pytest.raises(ValueError, match="No torchcomms instance for device type 'cuda'"):
        dist.new_window(backend="nccl")
    # torch.distributed's own calls run on the same communicator, in the same order.
    t = torch.full((2,), float(r))
    work = tdist.all_reduce(t, async_op=True)
    u = torch.full((2,), float(r))
    dist.all_reduce(u)
    work.wait()
    assert t.tolist() == u.tolist() == [float(sum(range(n)))] * 2
    dist.destroy_process_group()


@cases.case("bad_input_on_torchcomms_leaves_the_group_usable")
def _errors_torchcomms(ctx: RankContext) -> None:
    n = ctx.world_size
    _init(ctx, True, "err_tc")
    t = torch.ones(2)
    no_meta = r"all_reduce: No torchcomms instance for device type 'meta'\. Available: cpu"
    with pytest.raises(ValueError, match=no_meta):
        dist.all_reduce(torch.ones(2, device="meta"))
    with pytest.raises(ValueError, match=r"broadcast: Global rank 7 is not in process group\. "
                                         r"Group ranks: \[0, 1, 2\]"):  # fmt: skip
        dist.broadcast(t, src=7)
    with pytest.raises(ValueError, match="Cannot specify both src and group_src"):
        dist.broadcast(t, src=0, group_src=0)
    with pytest.raises(ValueError, match="Either dst or group_dst must be specified"):
        dist.reduce(t)
    with pytest.raises(ValueError, match=r"does not support wildcard recv \(src=None\)"):
        dist.recv(t)
    with pytest.raises(ValueError, match=r"does not support wildcard irecv \(src=None\)"):
        dist.irecv(t)
    assert dist.batch_isend_irecv([]) == []  # upstream's answer with torchcomms
    with pytest.raises(CommValidationError, match="root"):
        dist.broadcast(t, group_src=n + 5)
    with pytest.raises(ValueError, match="Unsupported ReduceOp"):
        dist.all_reduce(t, op="sum")
    with pytest.raises(ValueError, match="do not split evenly across 3 ranks"):
        dist.all_to_all_single(torch.zeros(4), torch.zeros(4), output_split_sizes=None,
                               input_split_sizes=[1, 1, 2])  # fmt: skip
    dist.all_reduce(t)
    assert t.tolist() == [float(n)] * 2
    dist.destroy_process_group()


@cases.case("pass_through_refusals_are_torch_s")
def _errors_pass_through(ctx: RankContext) -> None:
    r, n = ctx.rank, ctx.world_size
    _init(ctx, False, "err_pt")
    t = torch.ones(2)
    for call in (
        lambda ns: ns.broadcast(t, src=7),
        lambda ns: ns.all_reduce(t, op=ns._make_nccl_premul_sum(2.0)),
        lambda ns: ns.all_to_all_single(torch.zeros(n), torch.zeros(n + 1)),
    ):
        errors = []
        for ns in (dist, tdist):
            with pytest.raises(Exception) as caught:
                call(ns)
            errors.append((type(caught.value), str(caught.value)))
        assert errors[0] == errors[1], errors
    # torch's gloo refuses unequal all_gather sizes; distwrap sends them point to point.
    outs = [torch.zeros(j + 1) for j in range(n)]
    dist.all_gather(outs, torch.full((r + 1,), float(r)))
    assert [o.tolist() for o in outs] == [[float(j)] * (j + 1) for j in range(n)]
    outs = [torch.zeros(j + 1) for j in range(n)]
    _wait(dist.all_gather(outs, torch.full((r + 1,), float(r)), async_op=True))
    assert [o.tolist() for o in outs] == [[float(j)] * (j + 1) for j in range(n)]
    with pytest.raises(RuntimeError, match="Backend gloo does not support getMemAllocator"):
        dist.get_mem_allocator(None, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="register_mem_pool: backend 'gloo'"):
        dist.register_mem_pool(None, torch.device("cpu"), object())
    for extension in (
        lambda: dist.new_window(),
        lambda: dist.reduce_scatter_quantized(t, t, dist.ReduceOp.SUM, torch.tensor([1])),
    ):
        with pytest.raises(AssertionError, match="requires torchcomms to be enabled"):
            extension()
    dist.all_reduce(t)
    assert t.tolist() == [float(n)] * 2
    dist.destroy_process_group()


@cases.case("upstream_s_gloo_fallbacks_give_torch_s_results")
def _fallbacks(ctx: RankContext) -> None:
    from torchcomms.distwrap import fallback

    r, n = ctx.rank, ctx.world_size
    _init(ctx, False, "fallbacks")
    world = tdist.group.WORLD
    assert world is not None
    inputs = [torch.arange(3, dtype=torch.float32) + 10 * r + 100 * j for j in range(n)]
    for async_op in (False, True):
        ours = [torch.zeros(3) for _ in range(n)]
        work = fallback.fallback_all_to_all_gloo(ours, inputs, world, async_op)
        if async_op:
            _wait(work)
        else:
            assert work is None
        theirs = [torch.zeros(3) for _ in range(n)]
        tdist.all_to_all(theirs, inputs)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    in_splits = [j + 1 for j in range(n)]
    out_splits = [r + 1] * n
    src = torch.arange(sum(in_splits), dtype=torch.float32) + 100 * r
    for async_op in (False, True):
        ours_t = torch.zeros(sum(out_splits))
        work = fallback.fallback_all_to_all_single_gloo(
            ours_t, src, out_splits, in_splits, world, async_op
        )
        if async_op:
            _wait(work)
        theirs_t = torch.zeros(sum(out_splits))
        tdist.all_to_all_single(theirs_t, src, out_splits, in_splits)
        assert torch.equal(ours_t, theirs_t)
    even_src = torch.arange(2 * n, dtype=torch.float32) + 100 * r
    ours_t, theirs_t = torch.zeros(2 * n), torch.zeros(2 * n)
    fallback.fallback_all_to_all_single_gloo(ours_t, even_src, None, None, world, False)
    tdist.all_to_all_single(theirs_t, even_src)
    assert torch.equal(ours_t, theirs_t)
    with pytest.raises(ValueError, match=r"input_split_sizes \[1, 1\] must have 3 entries"):
        fallback.fallback_all_to_all_single_gloo(ours_t, even_src, None, [1, 1], world, False)
    outs = [torch.zeros(j + 1) for j in range(n)]
    fallback.fallback_all_gather_gloo(outs, torch.full((r + 1,), float(r)), world, False)
    assert [o.tolist() for o in outs] == [[float(j)] * (j + 1) for j in range(n)]
    # split_group's stand-in: every rank passes its own list (parent ranks).
    mine = [0, 1] if r < 2 else [2]
    pg = fallback.fallback_split_group_new_group(world, mine, None, None, "fb")
    assert tdist.get_process_group_ranks(pg) == mine
    t = torch.ones(2)
    tdist.all_reduce(t, group=pg)
    assert t.tolist() == [float(len(mine))] * 2
    dist.destroy_process_group()


def _rank(ctx: RankContext) -> dict[str, object]:
    return cases.run_all(ctx)


@pytest.mark.parametrize("name", list(cases.cases))
def test_collectives(name: str) -> None:
    cases.check(_rank, WORLD, name)
