"""torch.compile of communicator calls (issue 16), on real ranks over shm and tcp.

Each task runs on freshly spawned interpreters (``spawn=True``) that inherit
``TORCHCOMMS_PATCH_FOR_COMPILE=1`` from this process (the flag is read when torch imports
torchcomms, at process start, so neither the pooled workers nor their fork server, started
without it, can be used).  A rank runs every case of
``tests/compile_cases.py`` eagerly and then compiled with ``fullgraph=True`` (twice: the
second call must reuse the graph), compares the results bit for bit (integer-valued
data), and counts graphs with a ``CompileCounterWithBackend`` (exactly one per case) and
graph breaks with ``torch._dynamo.utils.counters`` (none).

The default run spawns one world of 2 with the flag set and compiles, over shm, one graph
covering five cases and one graph for each of the other cases.  ``in_place`` (collectives on
the graph's input, no compute) is compiled by Inductor, the rest by ``aot_eager`` (Dynamo,
AOTAutograd and functionalization without Inductor's C++ codegen, whose first kernel costs
12-18 s on 2 cores with a cold cache).  Then
the autograd cases and what reaches the eager path (hints, timeouts, hooks, an unwaited async
op).  The flag unset runs on the harness's pooled workers.  ``-m compile_matrix`` compiles
every case on its own with Inductor (compute kernels included) at worlds 2 and 3 over both
transports, and the combined graphs at world 3 over tcp.
"""

from __future__ import annotations

import functools
import sys
from datetime import timedelta
from typing import Any

import pytest
import torch

from tests import compile_cases
from tests.harness import RankContext, run_ranks
from torchcomms import ReduceOp, new_comm

CPU = torch.device("cpu")
COMM_TIMEOUT = timedelta(seconds=60)
FLAG = "TORCHCOMMS_PATCH_FOR_COMPILE"


def _enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FLAG, "1")
    monkeypatch.delenv("TORCHCOMMS_COMPILE_IGNORE_PYTORCH_VERSION_REQUIREMENT", raising=False)


def _comm(ctx: RankContext, transport: str, name: str) -> Any:
    return new_comm(
        "gloo",
        CPU,
        name=name,
        store=ctx.store,
        timeout=COMM_TIMEOUT,
        hints={"transport": transport},
    )


def _diff(label: str, eager: tuple[torch.Tensor, ...], got: tuple[torch.Tensor, ...]) -> list[str]:
    if len(eager) != len(got):
        return [f"{label}: {len(got)} results, eager gave {len(eager)}"]
    bad = []
    for i, (e, g) in enumerate(zip(eager, got, strict=True)):
        if e.dtype != g.dtype or e.shape != g.shape or not torch.equal(e, g):
            bad.append(f"{label}[{i}]: got {g.tolist()}, eager gave {e.tolist()}")
    return bad


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def compile_cases_on(
    comm: Any, names: list[str], backends: dict[str, str], default: str
) -> dict[str, Any]:
    """Run the named cases (``"combined"``: one graph of several) eager, then compiled with
    ``backends.get(name, default)``, twice each (the second call must reuse the graph)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    import torchcomms.functional as functional

    rank, size = comm.get_rank(), comm.get_size()
    fns = {case.name: (case.fn, case.inputs) for case in compile_cases.CASES}
    fns["combined"] = (compile_cases.combined, fns["all_reduce"][1])
    breaks = _graph_breaks()
    report: dict[str, Any] = {
        "class": type(comm).__name__,
        "enabled": functional.is_torch_compile_supported_and_enabled(),
        "failures": [],
        "frames": {},
        "checked": 0,
    }
    for name in names:
        fn, inputs = fns[name]
        eager = fn(comm, *inputs(rank, size))
        counter = CompileCounterWithBackend(backends.get(name, default))
        compiled = torch.compile(fn, fullgraph=True, backend=counter)
        for call in range(2):
            got = compiled(comm, *inputs(rank, size))
            report["failures"] += _diff(f"{name} call {call}", eager, got)
            report["checked"] += len(got)
        report["frames"][name] = counter.frame_count
    report["graph_breaks"] = _graph_breaks() - breaks
    return report


def compile_rank(
    ctx: RankContext, transport: str, names: list[str], backend: str
) -> dict[str, Any]:
    """The named cases on a fresh comm over ``transport``, every one compiled by ``backend``."""
    comm = _comm(ctx, transport, f"compile_{transport}")
    report = compile_cases_on(comm, names, {}, backend)
    comm.finalize()
    return report


def _check(reports: list[dict[str, Any]], names: list[str]) -> None:
    for rank, report in enumerate(reports):
        assert report["class"] == "TraceableTorchComm", (rank, report["class"])
        assert report["enabled"] is True
        assert report["failures"] == [], f"rank {rank}: {report['failures']}"
        assert report["frames"] == dict.fromkeys(names, 1), f"rank {rank}: {report['frames']}"
        assert report["graph_breaks"] == 0
        assert report["checked"] > 0


CASE_NAMES = [case.name for case in compile_cases.CASES]


@pytest.mark.compile_matrix
@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_case_compiled_alone(
    monkeypatch: pytest.MonkeyPatch, world_size: int, transport: str
) -> None:
    _enabled(monkeypatch)
    reports = run_ranks(
        compile_rank, world_size, transport, CASE_NAMES, "inductor", timeout=900.0, spawn=True
    )
    _check(reports, CASE_NAMES)


@pytest.mark.compile_matrix
def test_combined_graph_tcp_world3(monkeypatch: pytest.MonkeyPatch) -> None:
    _enabled(monkeypatch)
    names = ["combined", "reduce", "broadcast", "scatter_gather", "batch"]
    reports = run_ranks(compile_rank, 3, "tcp", names, "aot_eager", timeout=600.0, spawn=True)
    _check(reports, names)


def test_cases_cover_every_op() -> None:
    from torchcomms.functional.opaque import OPERATIONS

    covered = {op for case in compile_cases.CASES for op in case.covers}
    assert covered == set(OPERATIONS)


def test_the_op_table_matches_the_methods_it_traces() -> None:
    """Each row's argument names are the eager method's, in order, before ``async_op``; a
    declaration whose kinds do not fit its signature is refused when the table is built."""
    import inspect

    from torchcomms import optable
    from torchcomms.comm import TorchComm
    from torchcomms.functional import autograd, table

    for spec in table.OPS:
        params = list(inspect.signature(getattr(TorchComm, spec.method)).parameters)[1:]
        assert params[: len(spec.names) + 1] == [*spec.names, "async_op"], spec
        assert len(spec.kinds) == len(spec.names), spec
    all_reduce = next(s for s in table.OPS if s.method == "all_reduce")
    assert all_reduce.schema() == "Tensor(a!) tensor, int red, float? factor, Tensor? factor_tensor"
    assert all_reduce.mutated() == (0,)
    assert table.BATCH.mutated() == (1,)
    # upstream's names: in place, functional (its return: a new order token, then the outputs)
    assert (all_reduce.op, all_reduce.functional) == (
        "torchcomm_all_reduce_",
        "torchcomm_all_reduce",
    )
    assert all_reduce.functional_returns() == "(Tensor, Tensor)"
    gather = next(s for s in table.OPS if s.method == "all_gather")
    assert gather.functional_returns() == "(Tensor, Tensor[])"
    differentiable = {s.method for s in table.OPS if autograd.differentiable(s)}
    assert differentiable == set(autograd._BACKWARDS)
    assert differentiable.issubset(spec.method for spec in table.OPS if spec.mutated())

    def all_reduce_without_timeout(
        self: object, tensor: object, op: object, async_op: bool
    ) -> None:
        pass

    def split(self: object, async_op: bool, hints: object = None, timeout: object = None) -> None:
        pass  # an OpName, but no op: it has no check

    entries = len(optable.OPS)
    with pytest.raises(RuntimeError, match="must end with async_op, hints, timeout"):
        optable.op(optable.OUT, optable.RED, inputs="tensor", outputs="tensor")(
            all_reduce_without_timeout
        )
    with pytest.raises(RuntimeError, match=r"split has no checks\.check_split"):
        optable.op(inputs=None, outputs=None)(split)
    assert len(optable.OPS) == entries  # a refused declaration adds nothing


def test_a_traced_call_binds_arguments_as_the_eager_method_does() -> None:
    """Binding errors are raised before any op is emitted (no communicator is needed)."""
    from torchcomms.functional import table, traced

    spec = next(s for s in table.OPS if s.method == "broadcast")
    call = functools.partial(traced.call, spec, None)
    t = torch.zeros(2)
    with pytest.raises(TypeError, match=r"broadcast\(\) takes 5 arguments, got 6"):
        call((t, 0, False, None, None, "extra"), {})
    with pytest.raises(TypeError, match=r"unexpected or repeated argument 'root'"):
        call((t, 0), {"root": 1, "async_op": False})
    with pytest.raises(TypeError, match=r"unexpected or repeated argument 'peer'"):
        call((t,), {"peer": 1, "async_op": False})
    with pytest.raises(TypeError, match=r"broadcast\(\) missing argument 'async_op'"):
        call((t, 0), {})
    with pytest.raises(TypeError, match=r"broadcast\(\) missing argument 'root'"):
        call((t,), {"async_op": False})


# -- autograd -------------------------------------------------------------------------------------
def autograd_on(comm: Any) -> dict[str, Any]:
    """An all_reduce has upstream's formula (its backward all_reduces the gradient), compiled
    and, as upstream's eager path, eagerly; a broadcast has none (the identity); a leaf that
    requires grad may be written in place, compiled as eagerly (outside autograd)."""
    rank = comm.get_rank()
    out: dict[str, Any] = {}
    compiled = torch.compile(compile_cases.autograd, fullgraph=True, backend="aot_eager")
    grads = []
    for fn in (compile_cases.autograd, compiled, compiled):
        x = (torch.arange(4) + rank).float().requires_grad_()
        (loss,) = fn(comm, x)
        loss.backward()
        grads.append((float(loss), x.grad.clone()))
    out["losses"] = [g[0] for g in grads]
    out["grads_equal"] = torch.equal(grads[1][1], grads[2][1])
    out["grad"] = [g[1].tolist() for g in grads[:2]]

    def leaf_write(comm: Any, leaf: torch.Tensor) -> torch.Tensor:
        comm.all_reduce(leaf, ReduceOp.SUM, False)
        return leaf * 2

    leaf_compiled = torch.compile(leaf_write, fullgraph=True, backend="aot_eager")
    seen = []
    for fn in (leaf_write, leaf_compiled):
        leaf = torch.ones(3, requires_grad=True)
        result = fn(comm, leaf)
        result.sum().backward()
        seen.append(
            (leaf.is_leaf, leaf.grad_fn is None, leaf.detach().tolist(), leaf.grad.tolist())
        )
    out["leaf"] = seen
    return out


def _check_autograd(reports: list[dict[str, Any]]) -> None:
    size = len(reports)
    for rank, report in enumerate(reports):
        assert report["grads_equal"], report
        assert len(set(report["losses"])) == 1, report
        # x_r = arange(4) + r; y = 3 * sum_r x_r = 3 * (2 * arange(4) + 1); z = y * y, broadcast
        # (no formula: the identity). The all_reduce's backward sums every rank's 2 * y * 3, so
        # dz/dx = 6 * y * size, eagerly and compiled.
        want = [6.0 * 3 * (2 * i + 1) * size for i in range(4)]
        assert report["grad"] == [want, want], (rank, report["grad"])
        eager_leaf, compiled_leaf = report["leaf"]
        assert eager_leaf == compiled_leaf == (True, True, [2.0, 2.0, 2.0], [2.0, 2.0, 2.0])


# -- upstream's autograd: formulas, waits, the async tensor (issue 28) ----------------------------
def _recording(backend: str, targets: list[str]) -> Any:
    """A backend that records the ops of each Dynamo graph, then compiles it with ``backend``."""
    from torch._dynamo import lookup_backend

    def compile_graph(gm: torch.fx.GraphModule, inputs: list[Any]) -> Any:
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return lookup_backend(backend)(gm, inputs)

    return compile_graph


def grad_cases_on(comm: Any, backend: str) -> dict[str, Any]:
    """Each ``compile_cases.GRAD_CASES`` loss compiled by ``backend``: its gradient against the
    analytic one, after ``retain_graph`` (two backwards accumulate), and again on a second call
    (no recompilation); the same call with an input that does not require grad adds no
    autograd node and emits the in-place op."""
    from torch._dynamo.testing import CompileCounterWithBackend

    rank, size = comm.get_rank(), comm.get_size()
    failures: list[str] = []
    frames: dict[str, int] = {}
    for case in compile_cases.GRAD_CASES:
        want = case.grad(rank, size).float()
        x = (torch.arange(case.numel(rank, size)) + rank).float().requires_grad_()
        case.fn(comm, x).backward()  # eagerly: upstream's eager autograd path
        if x.grad is None or not torch.equal(x.grad, want):
            failures.append(f"{case.name} eager: grad {x.grad}, want {want.tolist()}")
        counter = CompileCounterWithBackend(backend)
        compiled = torch.compile(case.fn, fullgraph=True, backend=counter)
        x = (torch.arange(case.numel(rank, size)) + rank).float().requires_grad_()
        loss = compiled(comm, x)
        loss.backward(retain_graph=True)
        loss.backward()
        if x.grad is None or not torch.equal(x.grad, 2 * want):
            failures.append(f"{case.name}: grad {x.grad}, want 2 * {want.tolist()}")
        x.grad = None
        compiled(comm, x).backward()
        if x.grad is None or not torch.equal(x.grad, want):
            failures.append(f"{case.name} call 2: grad {x.grad}, want {want.tolist()}")
        frames[case.name] = counter.frame_count
    # Upstream's eager form: the call returns its result (all_gather: the list of them).
    x = torch.arange(float(compile_cases.C)).requires_grad_()
    result = comm.all_reduce(x * 1.0, ReduceOp.SUM, True)
    gathered = comm.all_gather([torch.zeros(compile_cases.C) for _ in range(size)], x * 1.0, True)
    (result.wait().sum() + sum(t.sum() for t in gathered)).backward()
    if x.grad is None or x.grad.tolist() != [2.0 * size] * compile_cases.C:
        failures.append(f"eager results: grad {x.grad}, want {2 * size} everywhere")
    # Bad arguments on that path are the eager method's own error, not a binding's.
    try:
        comm.all_reduce(x * 1.0, ReduceOp.SUM, False, nonsense=1)
        failures.append("eager autograd path: an unknown argument was accepted")
    except TypeError as exc:
        if "unexpected keyword argument 'nonsense'" not in str(exc):
            failures.append(f"eager autograd path: bad argument raised {exc!r}")
    # Through the torch.distributed bridge an op stays c10d's: a work, no autograd node.
    from torchcomms._backend_wrapper import _BackendWrapper

    b = x * 1.0
    work = _BackendWrapper(comm).allreduce([b])
    work.wait()
    summed = [float(size * i) for i in range(compile_cases.C)]  # x = arange(C) on every rank
    if type(b.grad_fn).__name__ != "MulBackward0" or b.tolist() != summed:
        failures.append(f"bridge allreduce: {b}, grad_fn {b.grad_fn}")
    targets: list[str] = []
    plain = torch.compile(
        compile_cases.grad_all_reduce, fullgraph=True, backend=_recording(backend, targets)
    )
    loss = plain(comm, torch.arange(float(compile_cases.C)))
    no_node = (
        loss.requires_grad,
        loss.grad_fn is None,
        sorted(t for t in set(targets) if "torchcomm" in t),
    )
    return {"failures": failures, "frames": frames, "no_node": no_node}


def _check_grad_cases(reports: list[dict[str, Any]]) -> None:
    names = [case.name for case in compile_cases.GRAD_CASES]
    for rank, report in enumerate(reports):
        assert report["failures"] == [], f"rank {rank}: {report['failures']}"
        assert report["frames"] == dict.fromkeys(names, 1), (rank, report["frames"])
        assert report["no_node"] == (False, True, ["torchcomms.torchcomm_all_reduce_"])


def _waited(xs: list[torch.Tensor], inplace: bool) -> list[torch.Tensor]:
    ops = torch.ops.torchcomms
    if inplace:
        result: list[torch.Tensor] = ops.torchcomm_wait_tensors_(xs)
    else:
        result = ops.torchcomm_wait_tensors(xs)
    return result


def _wait_two(a: torch.Tensor, b: torch.Tensor, inplace: bool) -> torch.Tensor:
    xs = [a.clone(), b.clone()] if inplace else [a, b]
    r = _waited(xs, inplace)
    return r[0].sum() + r[1].sum()


def _wait_chain(a: torch.Tensor) -> torch.Tensor:
    return (_waited([a * 2], False)[0] + 1).sum()


def waits_on(comm: Any, backend: str) -> dict[str, Any]:
    """Upstream's ``torchcomm_wait_tensors`` / ``_`` and ``TorchCommsAsyncTensor`` checks (our
    code), eager and compiled by ``backend``: each entry is (got, want)."""
    from torchcomms.functional.async_tensor import TorchCommsAsyncTensor

    ops = torch.ops.torchcomms
    out: dict[str, Any] = {}
    ones = torch.ones(3)

    def grads(fn: Any, *shapes: int, **kw: Any) -> list[list[float]]:
        xs = [torch.arange(float(n)).requires_grad_() for n in shapes]
        fn(*xs, **kw).backward()
        return [x.grad.tolist() for x in xs]

    for label, run in (
        ("eager", lambda f: f),
        ("compiled", lambda f: torch.compile(f, fullgraph=True, backend=backend)),
    ):
        for inplace in (False, True):
            fn = run(functools.partial(_wait_two, inplace=inplace))
            out[f"{label} two inplace={inplace}"] = (grads(fn, 3, 3), [ones.tolist()] * 2)
        out[f"{label} chain"] = (grads(run(_wait_chain), 3), [[2.0] * 3])
        x, y = torch.arange(3.0).requires_grad_(), torch.arange(3.0)
        waited = run(lambda a, b: ops.torchcomm_wait_tensors([a, b]))(x, y)
        out[f"{label} requires_grad mixed"] = ([t.requires_grad for t in waited], [True, True])
        x = torch.arange(3.0).requires_grad_()
        fn = run(lambda a: ops.torchcomm_wait_tensors([a.clone()])[0].sum())
        fn(x).backward()
        fn(x).backward()  # accumulates
        out[f"{label} accumulation"] = (x.grad.tolist(), [2.0] * 3)
        x = torch.arange(3.0).requires_grad_()
        loss = run(_wait_chain)(x)
        loss.backward(retain_graph=True)
        first = x.grad.clone()
        x.grad = None
        loss.backward()
        out[f"{label} retain_graph"] = (x.grad.tolist(), first.tolist())
    out["eager requires_grad false"] = (
        ops.torchcomm_wait_tensors([torch.ones(2)])[0].requires_grad,
        False,
    )
    x = torch.arange(3.0).requires_grad_()
    (g,) = torch.autograd.grad(ops.torchcomm_wait_tensors([x * x])[0].sum(), x, create_graph=True)
    (g2,) = torch.autograd.grad(g.sum(), x)
    out["eager create_graph"] = ((g.requires_grad, g2.tolist()), (True, [2.0] * 3))
    # the async tensor: autograd is elem's, a leaf's wrapper a leaf, a real work waited on first use
    x = torch.arange(3.0).requires_grad_()
    y = x * 2
    wrapped_y = TorchCommsAsyncTensor(y, None)
    out["async grad_fn"] = (wrapped_y.grad_fn is y.grad_fn, True)
    wrapped_y.sum().backward()
    out["async backward"] = (x.grad.tolist(), [2.0] * 3)
    wrapped_x = TorchCommsAsyncTensor(x, None)
    out["async is_leaf"] = ((wrapped_x.is_leaf, wrapped_y.is_leaf), (True, False))
    wrapped_x.grad = torch.full((3,), 7.0)
    out["async grad setter"] = ((x.grad.tolist(), wrapped_x.grad.tolist()), ([7.0] * 3,) * 2)
    t = torch.full((4,), float(comm.get_rank() + 1))
    pending = TorchCommsAsyncTensor(t, comm.all_reduce(t, ReduceOp.SUM, True))
    before = pending.completed
    total = float(comm.get_size() * (comm.get_size() + 1) // 2)
    out["async waited on first use"] = (
        (before, (pending + 0).tolist(), pending.completed),
        (False, [total] * 4, True),
    )
    t = torch.full((4,), float(comm.get_rank() + 1))
    pending = TorchCommsAsyncTensor(t, comm.all_reduce(t, ReduceOp.SUM, True))
    (waited,) = ops.torchcomm_wait_tensors([pending])
    out["wait_tensors waits an async tensor"] = (
        (waited.tolist(), pending.completed),
        ([total] * 4, True),
    )
    return out


def op_names() -> list[str]:
    """Upstream's op names, one set per table row, that are missing from ``torch.ops``."""
    from torchcomms.functional import table

    want = ["torchcomm_wait_tensors", "torchcomm_wait_tensors_"]
    for spec in table.OPS:
        want += [spec.op, spec.op + "async"]
        if spec.mutated():
            want.append(spec.functional)
    missing = [name for name in want if not hasattr(torch.ops.torchcomms, name)]
    # the functional ops' hints, one string, read back as the eager call gets them
    from torchcomms.functional import ops

    keys, values = ["a", "b=c", ""], ["1", "x\ny", ""]
    if ops._hints(ops.hints_text(keys, values)) != (keys, values) or ops._hints("") != ([], []):
        missing.append("hints round trip")
    return missing


def _check_waits(reports: list[dict[str, Any]]) -> None:
    for rank, report in enumerate(reports):
        bad = {k: v for k, v in report.items() if v[0] != v[1]}
        assert not bad, f"rank {rank}: {bad}"


def matrix_rank(ctx: RankContext, transport: str, backends: list[str]) -> dict[str, Any]:
    """The ring, the gradient cases and the waits, by each of ``backends``, on one comm."""
    comm = _comm(ctx, transport, f"matrix_{transport}")
    out = {
        backend: {
            "batch_ring": batch_ring_on(comm, backend),
            "grad_cases": grad_cases_on(comm, backend),
            "waits": waits_on(comm, backend),
        }
        for backend in backends
    }
    comm.finalize()
    return out


@pytest.mark.compile_matrix
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_and_gradients_compiled(monkeypatch: pytest.MonkeyPatch, world_size: int) -> None:
    """Batched p2p in a ring and upstream's autograd checks at worlds 2-4 by aot_eager and
    Inductor (the default run checks world 2 by aot_eager)."""
    _enabled(monkeypatch)
    backends = ["aot_eager", "inductor"]
    reports = run_ranks(matrix_rank, world_size, "shm", backends, timeout=1200.0, spawn=True)
    for backend in backends:
        _check_batch_ring([r[backend]["batch_ring"] for r in reports])
        _check_grad_cases([r[backend]["grad_cases"] for r in reports])
        _check_waits([r[backend]["waits"] for r in reports])


# -- the flag unset --------------------------------------------------------------------------------
def unset_rank(ctx: RankContext) -> dict[str, Any]:
    import torchcomms
    from torchcomms.comm import TorchComm

    comm = _comm(ctx, "auto", "compile_unset")

    def f(x: torch.Tensor) -> torch.Tensor:
        y = x + 1
        comm.all_reduce(y, ReduceOp.SUM, False)
        return y * 2

    x = torch.arange(4.0)
    eager = f(x)
    # Without the patch Dynamo treats the call as ordinary Python (graph breaks where it
    # cannot trace): what matters here is that the result is eager's.
    graph_break = torch.compile(f, backend="eager")(x)
    out = {
        "class_is_torchcomm": type(comm) is TorchComm,
        "enabled": torchcomms.functional.is_torch_compile_supported_and_enabled(),
        "opaque_imported": "torchcomms.functional.opaque" in sys.modules,
        "ops_defined": hasattr(torch.ops.torchcomms, "torchcomm_all_reduce_"),
        "equal": torch.equal(eager, graph_break),
        "eager": eager.tolist(),
    }
    comm.finalize()
    return out


def test_flag_unset_runs_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the harness's pooled workers, started without the flag (as every process is)."""
    monkeypatch.delenv(FLAG, raising=False)
    reports = run_ranks(unset_rank, 2, timeout=300.0)
    for report in reports:
        assert report["class_is_torchcomm"] and not report["enabled"], report
        assert not report["opaque_imported"] and not report["ops_defined"], report
        assert report["equal"] and report["eager"] == [4.0, 8.0, 12.0, 16.0], report


# -- hints, timeouts, hooks: what the compiled call hands the eager path --------------------------
class _Seen:
    """An internal observer (``torchcomms.runtime.oprecord``): the timeout each op ran with."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, float, bool]] = []

    def op_scheduled(self, record: Any) -> None:
        self.ops.append((record.name.name, record.timeout.total_seconds(), record.async_op))

    def op_finished(self, record: Any) -> None:
        pass


T7 = timedelta(seconds=7)
BAD_TAG = {"tag": "x"}


def _with_options(comm: Any, x: torch.Tensor) -> torch.Tensor:
    comm.all_reduce(x, ReduceOp.SUM, True, timeout=T7).wait()
    comm.broadcast(x, 0, False, hints={"tag": "1"})
    return x + 1


def _bad_hint(comm: Any, x: torch.Tensor) -> torch.Tensor:
    peer = 1 - comm.get_rank()
    comm.send(x, peer, False, hints=BAD_TAG)
    return x


def _never_waited(comm: Any, x: torch.Tensor) -> torch.Tensor:
    comm.all_reduce(x, ReduceOp.SUM, True)
    return x + 1


def options_on(comm: Any) -> dict[str, Any]:
    """What a compiled call hands the eager path; last on its comm (it leaves an op unwaited
    once, on purpose)."""
    seen = _Seen()
    comm._add_observer(seen)
    pre: list[tuple[str, bool]] = []
    hook = comm.register_pre_hook(lambda name, op_id, args: pre.append((name.name, args.async_op)))
    compiled = torch.compile(_with_options, fullgraph=True, backend="aot_eager")
    result = compiled(comm, torch.ones(3)).tolist()
    try:
        torch.compile(_bad_hint, fullgraph=True, backend="aot_eager")(comm, torch.ones(3))
        bad = "no error"
    except Exception as exc:  # the eager path's validation, raised from the graph
        bad = f"{type(exc).__name__}: {exc}"
    hook.remove()
    unwaited = torch.compile(_never_waited, fullgraph=True, backend="aot_eager")
    x = torch.ones(2)
    first = unwaited(comm, x).tolist()  # x is not written: the work was never waited
    try:
        unwaited(comm, x)
        again = "no error"
    except RuntimeError as exc:
        again = str(exc)
    comm.barrier(False)  # the abandoned all_reduce ran on every rank
    child = comm.split([1, 0], "compile_child")  # a split child is traceable too
    assert child is not None
    child_result = torch.compile(_with_options, fullgraph=True, backend="aot_eager")(
        child, torch.full((3,), float(child.get_rank()))
    ).tolist()
    child_class = type(child).__name__
    child.finalize()
    return {
        "seen": seen.ops,
        "pre": pre,
        "result": result,
        "bad": bad,
        "unwaited": (first, x.tolist(), again),
        "child": (child_class, child_result),
    }


def _check_options(reports: list[dict[str, Any]]) -> None:
    for report in reports:
        assert report["result"] == [3.0, 3.0, 3.0]
        default = COMM_TIMEOUT.total_seconds()
        assert report["seen"][:2] == [("all_reduce", 7.0, True), ("broadcast", default, False)]
        assert report["pre"][:2] == [("all_reduce", True), ("broadcast", False)]
        assert "CommValidationError" in report["bad"], report["bad"]
        assert "send/recv hint 'tag' must be an integer, got 'x'" in report["bad"]
        first, x_after, again = report["unwaited"]
        assert first == [2.0, 2.0] and x_after == [1.0, 1.0]
        assert "issued again at the same call site before the work of its previous run" in again
        # child ranks 0, 1 = parent ranks 1, 0; all_reduce of (0, 1) then broadcast, + 1
        assert report["child"] == ("TraceableTorchComm", [2.0, 2.0, 2.0])


# -- batched point-to-point in a ring: the batch made outside the graph or inside it --------------
def _ring(
    comm: Any, batch: Any, small: torch.Tensor, big: torch.Tensor, *recvs: torch.Tensor
) -> None:
    """Queue a ring exchange on ``batch``: ``small`` to the next rank, ``big`` to the previous."""
    size, rank = comm.get_size(), comm.get_rank()
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    batch.send(small, nxt)
    batch.recv(recvs[0], prv)
    batch.send(big, prv)
    batch.recv(recvs[1], nxt)


def _queue_outside(
    comm: Any, batch: Any, small: torch.Tensor, big: torch.Tensor, *recvs: torch.Tensor
) -> None:
    """Upstream's form: a barrier, then the ring queued on a batch made (and issued) outside."""
    comm.barrier(False)
    _ring(comm, batch, small, big, *recvs)


def _issue_inside(
    comm: Any, outer: Any, small: torch.Tensor, big: torch.Tensor, *recvs: torch.Tensor
) -> None:
    """A batch made in the graph (sync), then ``outer``, made outside, issued async and waited."""
    inner = comm.batch_op_create()
    _ring(comm, inner, small, big, recvs[0], recvs[1])
    inner.issue(False)
    _ring(comm, outer, small, big, recvs[2], recvs[3])
    outer.issue(True).wait()


def _ring_inputs(rank: int, recvs: int) -> list[torch.Tensor]:
    """One float32 element and 1024 int32 ones per rank, and zeroed receive buffers."""
    small = torch.tensor([1000.0 * (rank + 1)])
    big = torch.arange(1024, dtype=torch.int32) + 10_000 * (rank + 1)
    return [small, big] + [torch.zeros_like(t) for t in (small, big)] * (recvs // 2)


def batch_ring_on(comm: Any, backend: str) -> dict[str, Any]:
    """Batched p2p compiled as upstream's test writes it (the batch made eagerly, queued in the
    graph, issued eagerly, sync and async) and issued inside the graph; compared bit for bit with
    the eager run and with the values the ring sends."""
    from torch._dynamo.testing import CompileCounterWithBackend

    rank, size = comm.get_rank(), comm.get_size()
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    failures: list[str] = []
    frames: dict[str, int] = {}
    queued: list[int] = []
    breaks = _graph_breaks()
    # what the ring delivers: prv's small, nxt's big
    want = [_ring_inputs(prv, 0)[0], _ring_inputs(nxt, 0)[1]]

    def run_outside(fn: Any, async_op: bool) -> tuple[torch.Tensor, ...]:
        small, big, *recvs = _ring_inputs(rank, 2)
        batch = comm.batch_op_create()
        fn(comm, batch, small, big, *recvs)
        queued.append(len(batch.ops))
        work = batch.issue(async_op)
        work.wait()
        return tuple(recvs)

    def run_inside(fn: Any) -> tuple[torch.Tensor, ...]:
        small, big, *recvs = _ring_inputs(rank, 4)
        fn(comm, comm.batch_op_create(), small, big, *recvs)
        return tuple(recvs)

    counter = CompileCounterWithBackend(backend)
    outside = torch.compile(_queue_outside, fullgraph=True, backend=counter)
    for async_op in (False, True):
        eager = run_outside(_queue_outside, async_op)
        got = run_outside(outside, async_op)  # the second call reuses the graph
        failures += _diff(f"outside async={async_op}", eager, got)
        failures += _diff(f"outside async={async_op} values", tuple(want), got)
    frames["outside"] = counter.frame_count
    counter = CompileCounterWithBackend(backend)
    inside = torch.compile(_issue_inside, fullgraph=True, backend=counter)
    eager = run_inside(_issue_inside)
    for call in range(2):
        got = run_inside(inside)
        failures += _diff(f"inside call {call}", eager, got)
        failures += _diff(f"inside call {call} values", tuple(want * 2), got)
    frames["inside"] = counter.frame_count
    return {
        "failures": failures,
        "frames": frames,
        "queued": queued,
        "graph_breaks": _graph_breaks() - breaks,
    }


def _check_batch_ring(reports: list[dict[str, Any]]) -> None:
    for rank, report in enumerate(reports):
        assert report["failures"] == [], f"rank {rank}: {report['failures']}"
        assert report["frames"] == {"outside": 1, "inside": 1}, (rank, report["frames"])
        # the graph's sends and receives are in the batch when it returns, as after eager calls
        assert report["queued"] == [4, 4, 4, 4], (rank, report["queued"])
        assert report["graph_breaks"] == 0


# -- the default run: one fresh world of 2 with the flag set, every check above --------------------
#: Over shm: the graph of most ops and one graph for each of the other cases.  The compiled
#: layer does not depend on the transport (the kernels call the eager methods); tcp's graphs
#: are compiled in ``-m compile_matrix`` (every case, worlds 2 and 3, both transports).
SHM_NAMES = ["combined", "reduce", "broadcast", "scatter_gather", "batch", "in_place"]


def enabled_rank(ctx: RankContext) -> dict[str, Any]:
    """The compile checks that need the flag at process start, on one pair of processes.

    Over shm ``SHM_NAMES``: ``in_place`` by Inductor, the rest by ``aot_eager``; then
    autograd and the eager path's options (last: it leaves one async op unwaited on
    purpose)."""
    shm = _comm(ctx, "shm", "compile_shm")
    # Inductor lowers a graph of our ops alone in about 3 s; its first C++ kernel costs 12-18 s
    # of CPU on 2 cores, so the cases with compute run under Inductor in -m compile_matrix.
    inductor = {"in_place": "inductor"}
    out: dict[str, Any] = {"shm": compile_cases_on(shm, SHM_NAMES, inductor, "aot_eager")}
    out["batch_ring"] = batch_ring_on(shm, "aot_eager")
    out["autograd"] = autograd_on(shm)
    out["grad_cases"] = grad_cases_on(shm, "aot_eager")
    out["waits"] = waits_on(shm, "aot_eager")
    out["op_names"] = op_names()
    out["options"] = options_on(shm)
    shm.finalize()
    return out


def test_compiled_graphs_autograd_and_options_on_shm(monkeypatch: pytest.MonkeyPatch) -> None:
    _enabled(monkeypatch)
    reports = run_ranks(enabled_rank, 2, timeout=600.0, spawn=True)
    _check([r["shm"] for r in reports], SHM_NAMES)
    _check_batch_ring([r["batch_ring"] for r in reports])
    _check_autograd([r["autograd"] for r in reports])
    _check_grad_cases([r["grad_cases"] for r in reports])
    _check_waits([r["waits"] for r in reports])
    for report in reports:
        assert report["op_names"] == [], report["op_names"]
    _check_options([r["options"] for r in reports])
