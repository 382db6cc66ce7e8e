"""Every argument-validation error of the public API, and that a comm survives all of them.

Each case checks the exception type (``CommValidationError``, a ``RuntimeError`` subclass, for
bad values; ``TypeError`` for wrong argument types), a substring with upstream's wording (§2,
§3, §3.1, §3.2 of the reference) and that the message names the communicator, the rank and
the op (``"[TorchCommGloo comm=<name> rank=<r>] <op>: ..."``). Validation runs before any hook
or byte moves, so after every rank hit every error the communicator must still work: the rank
function ends with a real all_reduce, and asserts that no pre-hook ever fired for a rejected
call. The rank function runs on 2 and on 3 ranks (list-length errors depend on the size).
``new_comm``'s own argument errors are raised before any networking and are checked in-process.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.harness import RankContext, run_ranks
from torchcomms import (
    BatchP2POptions,
    CommStateError,
    CommValidationError,
    P2POp,
    P2POpType,
    ReduceOp,
    TorchComm,
    new_comm,
)

CPU = torch.device("cpu")
NAME = "val"
V = CommValidationError
T = TypeError


class _Cases:
    """Runs rejected calls, each checked for type, comm/rank/op prefix and upstream text."""

    def __init__(self, comm: TorchComm) -> None:
        self.comm = comm
        self.rank = comm.get_rank()
        self.checked: list[str] = []

    def expect(self, exc: type[Exception], op: str, text: str, call: Callable[[], Any]) -> None:
        prefix = f"[TorchCommGloo comm={NAME} rank={self.rank}] {op}: "
        pattern = re.escape(prefix) + ".*" + re.escape(text)
        label = f"{op}: {text}"
        try:
            with pytest.raises(exc, match=pattern) as info:
                call()
        except BaseException as failure:
            raise AssertionError(f"case {label!r}: {failure}") from failure
        if exc is V:
            assert isinstance(info.value, RuntimeError), label
        self.checked.append(label)


def _f(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.float32)


def _i(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.int64)


def _validation(ctx: RankContext) -> list[str]:
    r, n = ctx.rank, ctx.world_size
    other = (r + 1) % n
    comm = new_comm("gloo", CPU, name=NAME, store=ctx.store)
    fired: list[Any] = []
    comm.register_pre_hook(lambda name, op_id, args: fired.append(name))
    c = _Cases(comm)
    SUM = ReduceOp.SUM
    rng = f"must be in range [0, {n}), but got"

    # -- ranks: root / dst / src ---------------------------------------------------------------
    for bad in (n, -1, n + 5):
        c.expect(V, "send", f"dst {rng} {bad}", lambda b=bad: comm.send(_f(2), b, False))
        c.expect(V, "recv", f"src {rng} {bad}", lambda b=bad: comm.recv(_f(2), b, True))
        c.expect(V, "broadcast", f"root {rng} {bad}", lambda b=bad: comm.broadcast(_f(2), b, False))
        c.expect(V, "reduce", f"root {rng} {bad}", lambda b=bad: comm.reduce(_f(2), b, SUM, False))
        c.expect(V, "scatter", f"root {rng} {bad}", lambda b=bad: comm.scatter(_f(1), [], b, False))
        c.expect(V, "gather", f"root {rng} {bad}", lambda b=bad: comm.gather([], _f(1), b, False))
        c.expect(
            V,
            "gather_single",
            f"root {rng} {bad}",
            lambda b=bad: comm.gather_single(_f(n), _f(1), b, False),
        )
    c.expect(V, "send", "Cannot send to self", lambda: comm.send(_f(2), r, False))
    c.expect(V, "recv", "Cannot recv from self", lambda: comm.recv(_f(2), r, True))
    c.expect(T, "send", "dst must be an int, got str", lambda: comm.send(_f(2), "1", False))
    c.expect(T, "recv", "src must be an int, got bool", lambda: comm.recv(_f(2), True, False))
    c.expect(
        T, "broadcast", "root must be an int, got float", lambda: comm.broadcast(_f(2), 0.0, False)
    )

    # -- async_op and non-tensor arguments -------------------------------------------------------
    c.expect(
        T, "all_reduce", "async_op must be a bool, got int", lambda: comm.all_reduce(_f(2), SUM, 1)
    )
    c.expect(T, "barrier", "async_op must be a bool, got str", lambda: comm.barrier("no"))
    c.expect(
        T, "send", "async_op must be a bool, got NoneType", lambda: comm.send(_f(2), other, None)
    )
    c.expect(
        T,
        "all_reduce",
        "tensor must be a torch.Tensor, got list",
        lambda: comm.all_reduce([1.0], SUM, False),
    )
    c.expect(
        T,
        "all_gather_single",
        "input must be a torch.Tensor, got int",
        lambda: comm.all_gather_single(_f(n), 3, False),
    )
    c.expect(
        T,
        "all_gather",
        "tensor_list must be a list of tensors, got Tensor",
        lambda: comm.all_gather(_f(n), _f(1), False),
    )
    c.expect(
        T,
        "all_gather",
        "tensor_list[1] must be a torch.Tensor, got str",
        lambda: comm.all_gather([_f(1), "x"] + [_f(1)] * (n - 2), _f(1), False),
    )
    c.expect(
        T,
        "all_reduce",
        "op must be a ReduceOp, got str",
        lambda: comm.all_reduce(_f(2), "sum", False),
    )
    dist_sum = dist.ReduceOp.SUM
    c.expect(
        T, "all_reduce", "op must be a ReduceOp", lambda: comm.all_reduce(_f(2), dist_sum, False)
    )

    # -- reduction ops vs dtypes ---------------------------------------------------------------
    for op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        text = f"Cannot use ReduceOp.{op.type.name} with non-integral dtype"
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            t = torch.ones(4, dtype=dtype)
            c.expect(V, "all_reduce", text, lambda t=t, op=op: comm.all_reduce(t, op, False))
        c.expect(V, "reduce", text, lambda op=op: comm.reduce(_f(4), 0, op, False))
        c.expect(
            V,
            "reduce_scatter_single",
            text,
            lambda op=op: comm.reduce_scatter_single(_f(1), _f(n), op, True),
        )
        c.expect(
            V,
            "reduce_scatter",
            text,
            lambda op=op: comm.reduce_scatter(_f(1), [_f(1)] * n, op, False),
        )
    for dtype in (torch.int32, torch.int64, torch.int8, torch.uint8, torch.bool):
        t = torch.ones(4, dtype=dtype)
        c.expect(
            V,
            "all_reduce",
            "ReduceOp.PREMUL_SUM requires a floating-point dtype",
            lambda t=t: comm.all_reduce(t, ReduceOp.PREMUL_SUM(2.0), False),
        )
    c.expect(
        V,
        "all_reduce",
        "ReduceOp.AVG is not supported for dtype torch.bool",
        lambda: comm.all_reduce(torch.ones(4, dtype=torch.bool), ReduceOp.AVG, False),
    )
    c.expect(
        V,
        "reduce",
        "ReduceOp.AVG is not supported for dtype torch.bool",
        lambda: comm.reduce(torch.ones(4, dtype=torch.bool), 0, ReduceOp.AVG, False),
    )

    # -- tensor properties: contiguity, dtype, device, dtype agreement --------------------------
    strided = torch.arange(8.0).view(2, 4).t()
    assert not strided.is_contiguous()
    contig = "Tensor must be contiguous"
    c.expect(V, "all_reduce", contig, lambda: comm.all_reduce(strided, SUM, False))
    c.expect(V, "send", contig, lambda: comm.send(strided, other, False))
    c.expect(V, "broadcast", contig, lambda: comm.broadcast(strided, 0, True))
    c.expect(
        V,
        "all_gather_single",
        contig,
        lambda: comm.all_gather_single(torch.zeros(8 * n, 2)[:, 0], _f(8), False),
    )
    c.expect(V, "all_gather", contig, lambda: comm.all_gather([strided] * n, strided, False))
    for dtype in (torch.complex64, torch.int16, torch.complex128):
        bad = torch.zeros(4, dtype=dtype)
        text = f"Invalid scalar type {dtype}"
        c.expect(V, "all_reduce", text, lambda b=bad: comm.all_reduce(b, SUM, False))
        c.expect(V, "send", text, lambda b=bad: comm.send(b, other, False))
        c.expect(V, "broadcast", text, lambda b=bad: comm.broadcast(b, 0, False))
    meta = torch.zeros(4, device="meta")
    c.expect(V, "all_reduce", "is on device meta", lambda: comm.all_reduce(meta, SUM, False))
    c.expect(V, "recv", "is on device meta", lambda: comm.recv(meta, other, True))
    c.expect(
        V,
        "all_gather_single",
        "All tensors must have the same dtype (got torch.int64, expected torch.float32)",
        lambda: comm.all_gather_single(_i(n), _f(1), False),
    )
    c.expect(
        V,
        "all_gather",
        "All tensors must have the same dtype",
        lambda: comm.all_gather([_f(1)] * (n - 1) + [_i(1)], _f(1), False),
    )
    c.expect(
        V,
        "reduce_scatter",
        "All tensors must have the same dtype",
        lambda: comm.reduce_scatter(_f(1), [_i(1)] * n, SUM, False),
    )
    c.expect(
        V,
        "all_to_all_single",
        "All tensors must have the same dtype",
        lambda: comm.all_to_all_single(_i(n), _f(n), False),
    )
    c.expect(
        V,
        "all_to_all",
        "All tensors must have the same dtype",
        lambda: comm.all_to_all([_i(1)] * n, [_f(1)] * n, False),
    )

    # -- list lengths and element sizes --------------------------------------------------------
    for length in (n - 1, n + 1, 0):
        got = f"(got {length}, expected {n})"
        c.expect(
            V,
            "all_gather",
            f"tensor_list size must equal comm_size for all_gather {got}",
            lambda k=length: comm.all_gather([_f(2)] * k, _f(2), False),
        )
        c.expect(
            V,
            "all_gather_v",
            f"tensor_list size must equal comm_size for all_gather_v {got}",
            lambda k=length: comm.all_gather_v([_f(2)] * k, _f(2), False),
        )
        c.expect(
            V,
            "reduce_scatter",
            f"input_list size must equal comm_size for reduce_scatter {got}",
            lambda k=length: comm.reduce_scatter(_f(2), [_f(2)] * k, SUM, False),
        )
        c.expect(
            V,
            "reduce_scatter_v",
            f"input_list size must equal comm_size for reduce_scatter_v {got}",
            lambda k=length: comm.reduce_scatter_v(_f(2), [_f(2)] * k, SUM, False),
        )
        c.expect(
            V,
            "all_to_all",
            "Tensor list sizes must equal comm_size for all_to_all",
            lambda k=length: comm.all_to_all([_f(1)] * k, [_f(1)] * n, False),
        )
        c.expect(
            V,
            "all_to_all",
            "Tensor list sizes must equal comm_size for all_to_all",
            lambda k=length: comm.all_to_all([_f(1)] * n, [_f(1)] * k, False),
        )
        # This rank is the root of its own bad call: nothing reaches the wire.
        c.expect(
            V,
            "scatter",
            f"input_tensor_list size must equal comm_size for scatter {got}",
            lambda k=length: comm.scatter(_f(2), [_f(2)] * k, r, False),
        )
        c.expect(
            V,
            "gather",
            f"output_tensor_list size must equal comm_size for gather {got}",
            lambda k=length: comm.gather([_f(2)] * k, _f(2), r, False),
        )
        c.expect(
            V,
            "all_to_all_v_single",
            f"output_split_sizes length must equal comm_size for all_to_all_v_single {got}",
            lambda k=length: comm.all_to_all_v_single(_f(8), _f(8), [1] * k, [1] * n, False),
        )
        c.expect(
            V,
            "all_to_all_v_single",
            f"input_split_sizes length must equal comm_size for all_to_all_v_single {got}",
            lambda k=length: comm.all_to_all_v_single(_f(8), _f(8), [1] * n, [1] * k, False),
        )
    c.expect(
        V,
        "all_gather",
        "All tensors in tensor_list must have same size as input tensor (got 3, expected 2)",
        lambda: comm.all_gather([_f(2)] * (n - 1) + [_f(3)], _f(2), False),
    )
    c.expect(
        V,
        "all_gather_v",
        f"tensor_list[{r}] must have the same size as this rank's input tensor",
        lambda: comm.all_gather_v([_f(5)] * n, _f(2), False),
    )
    c.expect(
        V,
        "all_gather_single",
        f"Output tensor size must be input_size * comm_size for all_gather_single "
        f"(got {2 * n + 1}, expected {2 * n})",
        lambda: comm.all_gather_single(_f(2 * n + 1), _f(2), False),
    )
    c.expect(
        V,
        "reduce_scatter",
        "All input tensors must have same size as output tensor",
        lambda: comm.reduce_scatter(_f(2), [_f(2)] * (n - 1) + [_f(1)], SUM, False),
    )
    c.expect(
        V,
        "reduce_scatter_v",
        f"input_list[{r}] must have the same size as this rank's output tensor",
        lambda: comm.reduce_scatter_v(_f(2), [_f(3)] * n, SUM, False),
    )
    c.expect(
        V,
        "reduce_scatter_single",
        "Input tensor size must be output_size * comm_size for reduce_scatter_single",
        lambda: comm.reduce_scatter_single(_f(2), _f(2 * n - 1), SUM, False),
    )
    c.expect(
        V,
        "all_to_all_single",
        "Input and output tensors must have same size for all_to_all_single",
        lambda: comm.all_to_all_single(_f(2 * n), _f(n), False),
    )
    c.expect(
        V,
        "all_to_all_single",
        "Tensor size must be divisible by comm_size for all_to_all_single",
        lambda: comm.all_to_all_single(_f(n + 1), _f(n + 1), False),
    )
    c.expect(
        V,
        "all_to_all_v_single",
        "input_split_sizes must not contain negative sizes",
        lambda: comm.all_to_all_v_single(_f(8), _f(8), [1] * n, [-1] + [1] * (n - 1), False),
    )
    c.expect(
        V,
        "all_to_all_v_single",
        "output_split_sizes must not contain negative sizes",
        lambda: comm.all_to_all_v_single(_f(8), _f(8), [2, -1] + [0] * (n - 2), [1] * n, False),
    )
    c.expect(
        V,
        "all_to_all_v_single",
        f"sum of input_split_sizes ({3 * n}) exceeds the tensor's dim-0 size (4)",
        lambda: comm.all_to_all_v_single(_f(8, 2), _f(4, 2), [1] * n, [3] * n, False),
    )
    c.expect(
        V,
        "all_to_all_v_single",
        f"sum of output_split_sizes ({9 * n}) exceeds the tensor's dim-0 size (8)",
        lambda: comm.all_to_all_v_single(_f(8), _f(8), [9] * n, [1] * n, False),
    )
    c.expect(
        V,
        "all_to_all_v_single",
        "input and output rows must have the same number of elements",
        lambda: comm.all_to_all_v_single(_f(4, 3), _f(4, 2), [1] * n, [1] * n, False),
    )
    c.expect(
        T,
        "all_to_all_v_single",
        "input_split_sizes must be a list of ints",
        lambda: comm.all_to_all_v_single(_f(8), _f(8), [1] * n, [1.0] * n, False),
    )
    c.expect(
        V,
        "scatter",
        "All input tensors must have same size as output tensor for scatter",
        lambda: comm.scatter(_f(2), [_f(2)] * (n - 1) + [_f(4)], r, False),
    )
    c.expect(
        V,
        "gather",
        "All output tensors must have same size as input tensor for gather",
        lambda: comm.gather([_f(1)] * n, _f(2), r, False),
    )
    c.expect(
        V,
        "gather_single",
        f"Output tensor size must be input_size * comm_size for gather_single "
        f"(got {2 * n - 1}, expected {2 * n})",
        lambda: comm.gather_single(_f(2 * n - 1), _f(2), r, False),
    )

    # -- per-op timeout / hints types ----------------------------------------------------------
    c.expect(
        T,
        "all_reduce",
        "timeout must be a timedelta, got int",
        lambda: comm.all_reduce(_f(2), SUM, False, timeout=5),
    )
    c.expect(
        T,
        "broadcast",
        "hints must be a dict[str, str], got list",
        lambda: comm.broadcast(_f(2), 0, False, hints=[("k", "v")]),
    )

    # -- split ---------------------------------------------------------------------------------
    c.expect(V, "split", "Duplicate ranks found in ranks list", lambda: comm.split([r, r], "d"))
    c.expect(
        V,
        "split",
        "Duplicate ranks found in ranks list",
        lambda: comm.split([*range(n), other], "d"),
    )
    for bad in (n, -1):
        c.expect(
            V,
            "split",
            f"Invalid rank {bad} in ranks. Valid ranks are 0 to {n - 1}",
            lambda b=bad: comm.split([r, b], "oor"),
        )
    c.expect(
        V, "split", f"Current rank {r} is not in the ranks list", lambda: comm.split([other], "x")
    )
    c.expect(T, "split", "ranks must be a list of ints", lambda: comm.split(r, "x"))
    c.expect(T, "split", "ranks must be a list of ints", lambda: comm.split([str(r)], "x"))
    c.expect(T, "split", "name must be a non-empty str", lambda: comm.split([r], ""))
    c.expect(T, "split", "name must be a non-empty str", lambda: comm.split([r], 7))
    c.expect(
        T,
        "split",
        "timeout must be a timedelta, got float",
        lambda: comm.split([r], "t", timeout=1.5),
    )

    # -- batch send/recv -----------------------------------------------------------------------
    batch = comm.batch_op_create()
    c.expect(V, "batch_op_issue", "Cannot issue empty batch operation", lambda: batch.issue(False))
    c.expect(V, "batch send", "Cannot send to self", lambda: batch.send(_f(2), r))
    c.expect(V, "batch recv", "Cannot recv from self", lambda: batch.recv(_f(2), r))
    c.expect(V, "batch send", f"dst {rng} {n}", lambda: batch.send(_f(2), n))
    c.expect(V, "batch recv", f"src {rng} -1", lambda: batch.recv(_f(2), -1))
    c.expect(V, "batch send", contig, lambda: batch.send(strided, other))
    c.expect(T, "batch recv", "tensor must be a torch.Tensor", lambda: batch.recv(None, other))
    assert batch.ops == [], "a rejected batch op must not be recorded"
    batch.ops.append(P2POp(P2POpType.SEND, _f(2), r))  # ops is writable: issue re-checks it
    c.expect(V, "batch_op_issue", "Cannot send to self", lambda: batch.issue(True))
    batch.ops[:] = [P2POp(P2POpType.RECV, _f(2), n)]
    c.expect(V, "batch_op_issue", f"peer {rng} {n}", lambda: batch.issue(False))
    batch.ops[:] = [P2POp(P2POpType.SEND, _f(2), other)]
    c.expect(T, "batch_op_issue", "async_op must be a bool", lambda: batch.issue("yes"))
    bad_opts = BatchP2POptions()
    bad_opts.timeout = 3  # type: ignore[assignment]
    c.expect(
        T, "batch_op_issue", "timeout must be a timedelta", lambda: batch.issue(False, bad_opts)
    )

    assert fired == [], f"pre-hooks ran for rejected calls: {fired}"

    # -- what is *not* an error: non-root ranks may pass anything for root-only arguments ------
    root = 0
    out = torch.full((2,), -1, dtype=torch.int64)
    if r == root:
        ins = [torch.full((2,), 10 + i, dtype=torch.int64) for i in range(n)]
    else:
        ins = [] if r % 2 else [_f(7)]  # ignored off the root, even when malformed
    comm.scatter(out, ins, root, False)
    assert out.tolist() == [10 + r] * 2
    outs = [torch.full((1,), -1, dtype=torch.int64) for _ in range(n)] if r == root else []
    comm.gather(outs, torch.tensor([r]), root, False)
    if r == root:
        assert [t.item() for t in outs] == list(range(n))
    single = torch.full((n,), -1, dtype=torch.int64) if r == root else torch.empty(0)
    comm.gather_single(single, torch.tensor([r]), root, False)
    if r == root:
        assert single.tolist() == list(range(n))
    assert len(fired) == 3

    # -- the communicator is intact: nothing was left half-done by the errors --------------------
    t = torch.tensor([r + 1], dtype=torch.int64)
    comm.all_reduce(t, SUM, False)
    assert t.item() == n * (n + 1) // 2
    batch = comm.batch_op_create()
    got = torch.zeros(1, dtype=torch.int64)
    batch.send(torch.tensor([r]), (r + 1) % n)
    batch.recv(got, (r - 1) % n)
    batch.issue(False)
    assert got.item() == (r - 1) % n

    # -- state errors after finalize -------------------------------------------------------------
    comm.finalize()
    with pytest.raises(CommStateError, match=r"all_reduce: .*not initialized"):
        comm.all_reduce(_f(1), SUM, False)
    with pytest.raises(CommStateError, match="already finalized"):
        comm.finalize()
    return c.checked


@pytest.mark.parametrize("world_size", [2, 3])
def test_validation_errors_leave_comm_usable(world_size: int) -> None:
    """Every validation error on every rank, then the comm still works."""
    checked = run_ranks(_validation, world_size, timeout=120.0)
    # Labels embed the rank in a few messages; every rank must have run every case.
    assert len({len(labels) for labels in checked}) == 1
    assert len(checked[0]) > 150, len(checked[0])


def test_new_comm_argument_errors() -> None:
    """new_comm rejects bad argument types before it touches the network."""
    cases: list[tuple[type[Exception], str, Callable[[], Any]]] = [
        (T, "new_comm: name must be a non-empty str", lambda: new_comm("gloo", CPU, name="")),
        (T, "new_comm: name must be a non-empty str", lambda: new_comm("gloo", CPU, None)),
        (T, "new_comm: backend must be a non-empty str", lambda: new_comm(5, CPU, name="x")),
        (T, "new_comm: backend must be a non-empty str", lambda: new_comm("", CPU, name="x")),
        (
            T,
            "new_comm: timeout must be a timedelta, got int",
            lambda: new_comm("gloo", CPU, name="x", timeout=30),
        ),
        (
            ValueError,
            "new_comm: timeout must be positive",
            lambda: new_comm("gloo", CPU, name="x", timeout=timedelta(0)),
        ),
        (
            T,
            "new_comm: hints must be a dict[str, str], got list",
            lambda: new_comm("gloo", CPU, name="x", hints=["a"]),
        ),
        (
            T,
            "new_comm: device must be a torch.device, got int",
            lambda: new_comm("gloo", 0, name="x"),
        ),
        (
            ModuleNotFoundError,
            "failed to find backend no_such_backend",
            lambda: new_comm("no_such_backend", CPU, name="x", timeout=timedelta(seconds=1)),
        ),
    ]
    for exc, text, call in cases:
        with pytest.raises(exc, match=re.escape(text)):
            call()
