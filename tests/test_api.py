"""Single-process tests of the public API surface (reference §1, §2, §3, §5, §7.1).

Covers the value types (``ReduceOp``, ``RedOpType``, ``OpName``, ``WorkStatus``, ``Timeout``,
option structs, ``P2POp``), environment configuration (``TORCHCOMM_TIMEOUT_SECONDS``,
``TORCHCOMM_ABORT_ON_ERROR``) and rank/size discovery, the ``fake`` backend driven through
``TorchComm`` (getters, copy semantics, lifecycle), hooks, Python plug-in backends
(``register_backend``), the backend registry, the compatibility modules ``torchcomms._comms``
and ``torchcomms._comms_gloo``, and a 1-rank ``gloo`` communicator bootstrapped from the
environment alone.  Nothing here spawns ranks; two tests run a fresh interpreter.
"""

from __future__ import annotations

import copy
import gc
import itertools
import os
import pickle
import subprocess
import sys
import textwrap
from datetime import timedelta
from typing import Any

import pytest
import torch

import torchcomms
from torchcomms import (
    BatchP2POptions,
    CommOptions,
    OpName,
    P2POp,
    P2POpType,
    RedOpType,
    ReduceOp,
    RemovableHandle,
    Timeout,
    TorchComm,
    TorchCommBackend,
    TorchWork,
    WorkStatus,
    config,
    new_comm,
    register_backend,
)
from torchcomms.backends.cpu import bootstrap
from torchcomms.backends.fake import TorchCommFake
from torchcomms.optable import hook_args

CPU = torch.device("cpu")
FINALIZE_OP_ID = 2**64 - 1

RANKSIZE_VARS = (
    "TORCHCOMM_RANK",
    "TORCHCOMM_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "PALS_RANKID",
    "PALS_SIZE",
    "RANK",
    "WORLD_SIZE",
    "TORCHCOMM_BOOTSTRAP_RANKSIZE_QUERY_METHOD",
)

_comm_counter = iter(range(1_000_000))


def _fake(name: str | None = None, **kwargs: Any) -> TorchComm:
    """A fresh ``fake`` communicator with a unique name."""
    return new_comm("fake", CPU, name=name or f"fake{next(_comm_counter)}", **kwargs)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Remove every variable that rank/size discovery and comm options read."""
    for var in (*RANKSIZE_VARS, "TORCHCOMM_TIMEOUT_SECONDS", "TORCHCOMM_ABORT_ON_ERROR"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


# ============================================================================ value types


def test_reduce_op_singletons_and_types() -> None:
    expected = {
        "SUM": RedOpType.SUM,
        "PRODUCT": RedOpType.PRODUCT,
        "MIN": RedOpType.MIN,
        "MAX": RedOpType.MAX,
        "BAND": RedOpType.BAND,
        "BOR": RedOpType.BOR,
        "BXOR": RedOpType.BXOR,
        "AVG": RedOpType.AVG,
    }
    for name, red_type in expected.items():
        op = getattr(ReduceOp, name)
        assert isinstance(op, ReduceOp), name
        assert getattr(ReduceOp, name) is op, f"ReduceOp.{name} must be a singleton"
        assert op == getattr(ReduceOp, name), name
        assert op.type is red_type, name
        assert ReduceOp(red_type) == op, f"ReduceOp(RedOpType.{name}) must equal ReduceOp.{name}"
    assert ReduceOp.SUM is ReduceOp.SUM
    assert ReduceOp.SUM != ReduceOp.MAX
    assert ReduceOp.SUM.factor is None
    assert len({ReduceOp.SUM, ReduceOp(RedOpType.SUM), ReduceOp.MAX}) == 2  # hash follows ==


def test_reduce_op_premul_sum() -> None:
    op = ReduceOp.PREMUL_SUM(2.0)
    assert isinstance(op, ReduceOp)
    assert op.type is RedOpType.PREMUL_SUM
    assert op.factor == 2.0
    assert ReduceOp.PREMUL_SUM(3).factor == 3.0 and isinstance(ReduceOp.PREMUL_SUM(3).factor, float)

    factor = torch.tensor([0.5], dtype=torch.bfloat16)
    tensor_op = ReduceOp.PREMUL_SUM(factor)
    assert tensor_op.type is RedOpType.PREMUL_SUM
    assert isinstance(tensor_op.factor, torch.Tensor)
    assert torch.equal(tensor_op.factor, factor)
    assert tensor_op.factor_value() == 0.5
    assert ReduceOp.PREMUL_SUM(2.0) is not ReduceOp.PREMUL_SUM(2.0)  # a new op each call
    assert ReduceOp.PREMUL_SUM(2.0).factor_value() == 2.0
    assert ReduceOp.SUM.factor is None
    with pytest.raises(RuntimeError, match=r"ReduceOp\.SUM has no factor"):
        ReduceOp.SUM.factor_value()


def test_reduce_op_bad_factors_and_constructor() -> None:
    with pytest.raises(TypeError, match="factor must be a float or a tensor, got str"):
        ReduceOp.PREMUL_SUM("2.0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="factor must be a float or a tensor, got bool"):
        ReduceOp.PREMUL_SUM(True)
    with pytest.raises(TypeError, match="factor must be a float or a tensor, got NoneType"):
        ReduceOp.PREMUL_SUM(None)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"factor tensor must have one element \(got 2\)"):
        ReduceOp.PREMUL_SUM(torch.ones(2))
    with pytest.raises(RuntimeError, match="PREMUL_SUM needs a factor"):
        ReduceOp(RedOpType.PREMUL_SUM)
    with pytest.raises(TypeError, match="ReduceOp expects a RedOpType, got str"):
        ReduceOp("SUM")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"ReduceOp\.SUM takes no factor"):
        ReduceOp(RedOpType.SUM, 2.0)


def test_reduce_op_copy_deepcopy_and_pickle() -> None:
    for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PREMUL_SUM(2.0)):
        shallow = copy.copy(op)
        assert shallow.type is op.type, repr(op)
        assert shallow.factor == op.factor, repr(op)

        memo: dict[int, Any] = {}
        deep = copy.deepcopy(op, memo)
        assert deep.type is op.type, repr(op)
        assert deep.factor == op.factor, repr(op)
        assert id(op) in memo and memo[id(op)] is deep, f"deepcopy must fill memo for {op!r}"

        sentinel = ReduceOp.MAX
        assert copy.deepcopy(op, {id(op): sentinel}) is sentinel, f"memo ignored for {op!r}"

        restored = pickle.loads(pickle.dumps(op))
        assert isinstance(restored, ReduceOp)
        assert restored.type is op.type, repr(op)
        assert restored.factor == op.factor, repr(op)
        if op.type is not RedOpType.PREMUL_SUM:
            assert restored == op, repr(op)

    tensor_op = ReduceOp.PREMUL_SUM(torch.tensor([1.5]))
    deep = copy.deepcopy(tensor_op)
    assert isinstance(deep.factor, torch.Tensor) and isinstance(tensor_op.factor, torch.Tensor)
    assert torch.equal(deep.factor, tensor_op.factor)
    assert deep.factor.data_ptr() != tensor_op.factor.data_ptr(), "deepcopy must copy the tensor"
    restored = pickle.loads(pickle.dumps(tensor_op))
    assert isinstance(restored.factor, torch.Tensor)
    assert torch.equal(restored.factor, torch.tensor([1.5]))


def test_red_op_type_values_in_upstream_order() -> None:
    names = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM", "AVG"]
    assert [t.name for t in RedOpType] == names
    assert [t.value for t in RedOpType] == list(range(9))


def test_op_name_members_and_str() -> None:
    upstream = [
        "send",
        "recv",
        "broadcast",
        "all_reduce",
        "reduce",
        "all_gather",
        "all_gather_v",
        "all_gather_single",
        "reduce_scatter",
        "reduce_scatter_v",
        "reduce_scatter_single",
        "all_to_all_single",
        "all_to_all_v_single",
        "all_to_all",
        "barrier",
        "scatter",
        "gather",
        "gather_single",
        "split",
        "new_window",
        "finalize",
    ]
    members = [m.name for m in OpName]
    assert members[: len(upstream)] == upstream
    assert "batch_op_issue" in members
    assert str(OpName.all_reduce) == "OpName.all_reduce"
    assert OpName["broadcast"] is OpName.broadcast


def test_work_status_and_python_created_work() -> None:
    assert [s.name for s in WorkStatus] == [
        "NOT_STARTED",
        "INPROGRESS",
        "COMPLETED",
        "TIMEDOUT",
        "ERROR",
    ]
    comm = _fake()
    work = comm.barrier(False)
    assert work.is_completed()
    with pytest.raises(RuntimeError, match="_set_status is only supported on Python-created work"):
        work._set_status(WorkStatus.ERROR)
    comm.finalize()


def test_timeout_and_option_structs() -> None:
    t = Timeout(seconds=5)
    assert isinstance(t, timedelta)
    assert issubclass(Timeout, timedelta)
    assert t.total_seconds() == 5.0

    opts = CommOptions()
    assert opts.timeout == timedelta(seconds=600)
    assert opts.abort_process_on_timeout_or_error is True
    assert opts.hints == {}
    assert opts.store is None
    assert opts.enable_reconfigure is False
    text = repr(opts)
    assert text.startswith("CommOptions(")
    for piece in ("abort_process_on_timeout_or_error=True", "timeout=600.0s", "hints={}"):
        assert piece in text, f"{piece!r} missing from {text!r}"
    opts.hints = {"k": "v"}
    opts.timeout = timedelta(seconds=3)
    assert "hints={'k': 'v'}" in repr(opts) and "timeout=3.0s" in repr(opts)
    assert CommOptions().hints == {}, "hints must not be shared between instances"

    batch = BatchP2POptions()
    assert batch.hints == {}
    assert batch.timeout == timedelta(0)


def test_p2p_op_attributes() -> None:
    assert [t.name for t in P2POpType] == ["SEND", "RECV"]
    tensor = torch.zeros(3)
    op = P2POp(P2POpType.SEND, tensor, 2)
    assert op.type is P2POpType.SEND
    assert op.tensor is tensor
    assert op.peer == 2
    op.type, op.peer = P2POpType.RECV, 1
    assert op.type is P2POpType.RECV and op.peer == 1
    assert "peer=1" in repr(op)


# ============================================================================ configuration


@pytest.mark.parametrize(("raw", "seconds"), [("30", 30), (" 45 ", 45), ("1", 1), ("1200", 1200)])
def test_timeout_env_valid(clean_env: pytest.MonkeyPatch, raw: str, seconds: int) -> None:
    clean_env.setenv("TORCHCOMM_TIMEOUT_SECONDS", raw)
    assert config.default_timeout() == timedelta(seconds=seconds)
    comm = _fake()
    assert comm.get_options().timeout == timedelta(seconds=seconds)
    comm.finalize()


@pytest.mark.parametrize("raw", ["abc", "1.5", "-5", "10s", "0"])
def test_timeout_env_invalid(clean_env: pytest.MonkeyPatch, raw: str) -> None:
    clean_env.setenv("TORCHCOMM_TIMEOUT_SECONDS", raw)
    with pytest.raises(RuntimeError, match="TORCHCOMM_TIMEOUT_SECONDS"):
        config.default_timeout()
    with pytest.raises(RuntimeError, match="TORCHCOMM_TIMEOUT_SECONDS"):
        _fake()


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("1", True),
        ("true", True),
        ("TRUE", True),
        (" Yes ", True),
        ("y", True),
        ("Y\t", True),
        ("0", False),
        ("false", False),
        ("False", False),
        ("no", False),
        (" NO", False),
        ("n", False),
    ],
)
def test_abort_on_error_env_valid(clean_env: pytest.MonkeyPatch, raw: str, expected: bool) -> None:
    clean_env.setenv("TORCHCOMM_ABORT_ON_ERROR", raw)
    assert config.default_abort_on_error() is expected
    comm = _fake()
    assert comm.get_options().abort_process_on_timeout_or_error is expected
    comm.finalize()


@pytest.mark.parametrize("raw", ["maybe", "2", "truee", "-1", "on", "off"])
def test_abort_on_error_env_invalid(clean_env: pytest.MonkeyPatch, raw: str) -> None:
    clean_env.setenv("TORCHCOMM_ABORT_ON_ERROR", raw)
    with pytest.raises(RuntimeError, match="TORCHCOMM_ABORT_ON_ERROR"):
        config.default_abort_on_error()
    with pytest.raises(RuntimeError, match="TORCHCOMM_ABORT_ON_ERROR"):
        _fake()


def test_new_comm_defaults_and_explicit_kwargs_override_env(
    clean_env: pytest.MonkeyPatch,
) -> None:
    comm = _fake()
    opts = comm.get_options()
    assert opts.timeout == timedelta(seconds=600)
    assert opts.abort_process_on_timeout_or_error is True
    assert opts.hints == {}
    comm.finalize()

    clean_env.setenv("TORCHCOMM_TIMEOUT_SECONDS", "30")
    clean_env.setenv("TORCHCOMM_ABORT_ON_ERROR", "no")
    comm = _fake()
    assert comm.get_options().timeout == timedelta(seconds=30)
    assert comm.get_options().abort_process_on_timeout_or_error is False
    comm.finalize()

    comm = _fake(
        timeout=timedelta(seconds=7),
        abort_process_on_timeout_or_error=True,
        hints={"hint_key": "hint_value"},
    )
    opts = comm.get_options()
    assert opts.timeout == timedelta(seconds=7)
    assert opts.abort_process_on_timeout_or_error is True
    assert opts.hints == {"hint_key": "hint_value"}
    comm.finalize()

    # None keeps the (env-derived) default, as upstream's binding does.
    comm = _fake(timeout=None, abort_process_on_timeout_or_error=None, store=None)
    assert comm.get_options().timeout == timedelta(seconds=30)
    assert comm.get_options().abort_process_on_timeout_or_error is False
    comm.finalize()


# ============================================================================ rank/size discovery

_FULL = {
    "TORCHCOMM_RANK": "1",
    "TORCHCOMM_SIZE": "4",
    "OMPI_COMM_WORLD_RANK": "2",
    "OMPI_COMM_WORLD_SIZE": "5",
    "PMI_RANK": "3",
    "PMI_SIZE": "6",
    "PALS_RANKID": "0",
    "PALS_SIZE": "7",
    "RANK": "1",
    "WORLD_SIZE": "8",
}


def _without(*names: str) -> dict[str, str]:
    return {k: v for k, v in _FULL.items() if k not in names}


_TC = ("TORCHCOMM_RANK", "TORCHCOMM_SIZE")
_OMPI = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")
_PMI = ("PMI_RANK", "PMI_SIZE")
_PALS = ("PALS_RANKID", "PALS_SIZE")


@pytest.mark.parametrize(
    ("env", "method", "expected"),
    [
        pytest.param(_FULL, None, (1, 4), id="torchcomm-vars-first"),
        pytest.param(_without(*_TC), None, (2, 5), id="ompi-before-pmi"),
        pytest.param(_without(*_TC, *_OMPI), None, (3, 6), id="pmi-before-pals"),
        pytest.param(_without(*_TC, *_OMPI, *_PMI), None, (0, 7), id="pals-before-torchrun"),
        pytest.param({"PALS_RANKID": "2", "PMI_SIZE": "6"}, None, (2, 6), id="pals-size-pmi"),
        pytest.param(
            {"PALS_RANKID": "2", "OMPI_COMM_WORLD_SIZE": "5"}, None, (2, 5), id="pals-size-ompi"
        ),
        pytest.param({"PALS_RANKID": "2", "WORLD_SIZE": "8"}, None, (2, 8), id="pals-size-world"),
        pytest.param(
            {"PALS_RANKID": "2", "PALS_SIZE": "3", "PMI_SIZE": "6", "WORLD_SIZE": "8"},
            None,
            (2, 3),
            id="pals-size-prefers-pals",
        ),
        pytest.param({"RANK": "1", "WORLD_SIZE": "8"}, None, (1, 8), id="torchrun-last"),
        pytest.param(
            {"TORCHCOMM_RANK": "1", "RANK": "2", "WORLD_SIZE": "8"},
            None,
            (2, 8),
            id="torchcomm-rank-without-size-skipped",
        ),
        pytest.param(_FULL, "auto", (1, 4), id="auto-explicit"),
        pytest.param(_FULL, "torchrun", (1, 4), id="torchrun-still-honours-torchcomm"),
        pytest.param(_without(*_TC), "torchrun", (1, 8), id="torchrun-skips-mpi-pals"),
        pytest.param(_without(*_TC), "TorchRun", (1, 8), id="torchrun-case-insensitive"),
        pytest.param(_without(*_TC, *_OMPI), "mpi", (3, 6), id="mpi-uses-pmi"),
        pytest.param(_without(*_TC), "MPI", (2, 5), id="mpi-case-insensitive"),
        pytest.param(_without(*_TC, *_OMPI), "pals", (0, 7), id="pals-skips-mpi"),
        pytest.param(
            {"PALS_RANKID": "1", "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "5"},
            "Pals",
            (1, 5),
            id="pals-size-fallback-under-pals",
        ),
    ],
)
def test_query_ranksize_order(
    clean_env: pytest.MonkeyPatch,
    env: dict[str, str],
    method: str | None,
    expected: tuple[int, int],
) -> None:
    for key, value in env.items():
        clean_env.setenv(key, value)
    if method is not None:
        clean_env.setenv("TORCHCOMM_BOOTSTRAP_RANKSIZE_QUERY_METHOD", method)
    assert bootstrap.query_ranksize() == expected


@pytest.mark.parametrize(
    ("env", "method"),
    [
        pytest.param({}, None, id="nothing-set"),
        pytest.param({"TORCHCOMM_RANK": "0"}, None, id="rank-without-size"),
        pytest.param({"RANK": "0", "WORLD_SIZE": "0"}, None, id="size-zero"),
        pytest.param({"RANK": "-1", "WORLD_SIZE": "2"}, None, id="negative-rank"),
        pytest.param({"RANK": "0", "WORLD_SIZE": "2", "PALS_RANKID": "x"}, "mpi", id="mpi-only"),
        pytest.param(_without(*_TC, *_PALS), "pals", id="pals-only"),
    ],
)
def test_query_ranksize_nothing_found(
    clean_env: pytest.MonkeyPatch, env: dict[str, str], method: str | None
) -> None:
    for key, value in env.items():
        clean_env.setenv(key, value)
    if method is not None:
        clean_env.setenv("TORCHCOMM_BOOTSTRAP_RANKSIZE_QUERY_METHOD", method)
    with pytest.raises(RuntimeError) as info:
        bootstrap.query_ranksize()
    assert str(info.value) == (
        "Unable to determine rank and size from environment variables. Please set "
        "TORCHCOMM_RANK and TORCHCOMM_SIZE, or ensure you are running in a supported "
        "environment (Torchrun, MPI, or PALS)."
    )


def test_query_ranksize_rank_beyond_size(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("TORCHCOMM_RANK", "4")
    clean_env.setenv("TORCHCOMM_SIZE", "4")
    with pytest.raises(
        RuntimeError, match="Rank 4 from TORCHCOMM_RANK is out of range for world size 4"
    ):
        bootstrap.query_ranksize()


def test_query_ranksize_invalid_selector(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("TORCHCOMM_RANK", "0")
    clean_env.setenv("TORCHCOMM_SIZE", "1")
    clean_env.setenv("TORCHCOMM_BOOTSTRAP_RANKSIZE_QUERY_METHOD", "slurm")
    with pytest.raises(RuntimeError, match=r"TORCHCOMM_BOOTSTRAP_RANKSIZE_QUERY_METHOD.*slurm"):
        bootstrap.query_ranksize()


# ============================================================================ fake backend


def _every_collective(comm: TorchComm) -> dict[str, TorchWork]:
    """Issue every collective once on a size-1 communicator; return the works by op name."""
    t = torch.arange(4, dtype=torch.float32)
    out = torch.zeros(4)
    return {
        "broadcast": comm.broadcast(t, 0, False),
        "all_reduce": comm.all_reduce(t, ReduceOp.SUM, False),
        "all_reduce_async": comm.all_reduce(t, ReduceOp.PREMUL_SUM(2.0), True),
        "reduce": comm.reduce(t, 0, ReduceOp.MAX, False),
        "all_gather": comm.all_gather([out], t, False),
        "all_gather_v": comm.all_gather_v([out], t, True),
        "all_gather_single": comm.all_gather_single(out, t, False),
        "reduce_scatter": comm.reduce_scatter(out, [t], ReduceOp.SUM, False),
        "reduce_scatter_v": comm.reduce_scatter_v(out, [t], ReduceOp.AVG, False),
        "reduce_scatter_single": comm.reduce_scatter_single(out, t, ReduceOp.MIN, True),
        "all_to_all_single": comm.all_to_all_single(out, t, False),
        "all_to_all_v_single": comm.all_to_all_v_single(out, t, [4], [4], False),
        "all_to_all": comm.all_to_all([out], [t], False),
        "barrier": comm.barrier(False),
        "barrier_async": comm.barrier(True),
        "scatter": comm.scatter(out, [t], 0, False),
        "gather": comm.gather([out], t, 0, False),
        "gather_single": comm.gather_single(out, t, 0, True),
    }


def test_fake_backend_ops_return_completed_works() -> None:
    comm = _fake("fake_ops")
    impl = comm.get_backend_impl()
    assert isinstance(impl, TorchCommFake)
    assert comm.get_rank() == 0 and comm.get_size() == 1
    for op, work in _every_collective(comm).items():
        assert isinstance(work, TorchWork), op
        assert work.is_completed(), op
        work.wait()
        work.wait()  # a second wait is a no-op
        work.wait_blocking()  # no-op on a completed work
        assert work.is_completed(), op
    assert impl.last_op is not None and impl.last_op[0] == "gather_single"
    comm.finalize()


def test_fake_getters() -> None:
    comm = _fake("fake_getters", hints={"a": "b"})
    assert comm.get_name() == "fake_getters"
    assert comm.get_backend() == "fake"
    assert comm.get_device() == CPU
    assert isinstance(comm.get_options(), CommOptions)
    assert comm.get_options().hints == {"a": "b"}
    impl = comm.get_backend_impl()
    assert isinstance(impl, TorchCommBackend)
    assert comm.get_backend_impl() is impl
    with pytest.warns(DeprecationWarning, match="unsafe_get_backend"):
        assert comm.unsafe_get_backend() is impl
    assert comm.get_backend_version() == "fake"
    assert isinstance(comm.get_init_handle(), str) and comm.get_init_handle()
    assert comm.is_abort_supported() is False
    comm.set_timeout(timedelta(seconds=12))
    assert comm.get_options().timeout == timedelta(seconds=12)
    with pytest.raises(TypeError, match="timeout must be a timedelta"):
        comm.set_timeout(12)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout must be positive"):
        comm.set_timeout(timedelta(0))
    name = comm.get_name()
    with pytest.raises(RuntimeError, match=f"new_window not implemented for communicator:{name}"):
        comm.new_window()
    with pytest.raises(
        RuntimeError, match=f"tensor_register not implemented for communicator:{name}"
    ):
        comm.tensor_register(torch.ones(2))
    with pytest.raises(RuntimeError, match="tensor_deregister not implemented"):
        comm.tensor_deregister(torch.ones(2))
    assert "fake_getters" in repr(comm)
    comm.finalize()


def test_fake_split() -> None:
    comm = _fake("fake_parent")
    child = comm.split([0], "x")
    assert isinstance(child, TorchComm)
    assert child.get_size() == 1 and child.get_rank() == 0
    assert child.get_name() == "x"
    assert child.get_backend() == "fake"
    assert child.all_reduce(torch.ones(2), ReduceOp.SUM, False).is_completed()
    assert comm.split([], "y") is None
    with pytest.raises(RuntimeError, match=r"Invalid rank 1 in ranks\. Valid ranks are 0 to 0"):
        comm.split([1], "z")
    with pytest.raises(RuntimeError, match="Duplicate ranks found in ranks list"):
        comm.split([0, 0], "z")
    child.finalize()
    comm.finalize()


def test_comm_copy_returns_same_object() -> None:
    comm = _fake()
    assert copy.copy(comm) is comm
    memo: dict[int, Any] = {}
    assert copy.deepcopy(comm, memo) is comm
    assert memo[id(comm)] is comm
    holder = copy.deepcopy({"comm": comm, "data": [1, 2]})
    assert holder["comm"] is comm
    comm.finalize()


def test_finalize_lifecycle() -> None:
    comm = _fake("fake_final")
    comm.finalize()
    with pytest.raises(RuntimeError, match="already finalized"):
        comm.finalize()
    t = torch.ones(2)
    after_finalize = {
        "all_reduce": lambda: comm.all_reduce(t, ReduceOp.SUM, False),
        "broadcast": lambda: comm.broadcast(t, 0, False),
        "barrier": lambda: comm.barrier(False),
        "all_gather_single": lambda: comm.all_gather_single(t, t, False),
        "split": lambda: comm.split([0], "child"),
        "batch_op_create": lambda: comm.batch_op_create(),
    }
    for op, call in after_finalize.items():
        with pytest.raises(RuntimeError, match="not initialized") as info:
            call()
        assert isinstance(info.value, torchcomms.CommStateError), op
        assert op in str(info.value), f"{op}: {info.value}"


def test_deleting_unfinalized_comm_does_not_crash() -> None:
    comm = _fake("fake_leak")
    comm.all_reduce(torch.ones(2), ReduceOp.SUM, False)
    del comm
    gc.collect()
    # The process (and the registry) still work afterwards.
    again = _fake("fake_leak")
    assert again.get_name() == "fake_leak"
    again.finalize()


# ============================================================================ hooks


class _Recorder:
    """Collects hook calls as tuples, tagged so that several recorders can share one log."""

    def __init__(self, log: list[tuple[Any, ...]] | None = None, tag: str = "") -> None:
        self.log: list[tuple[Any, ...]] = [] if log is None else log
        self.tag = tag

    def pre(self, name: OpName, op_id: int, args: Any) -> None:
        self.log.append(("pre", self.tag, name, op_id, args))

    def post(self, op_id: int, args: Any) -> None:
        self.log.append(("post", self.tag, op_id, args))


def test_hook_registration_and_arguments() -> None:
    comm = _fake()
    rec = _Recorder()
    pre_handle = comm.register_pre_hook(rec.pre)
    post_handle = comm.register_post_hook(rec.post)
    assert isinstance(pre_handle, RemovableHandle)
    assert isinstance(post_handle, RemovableHandle)

    t = torch.ones(10)
    work = comm.all_reduce(t, ReduceOp.SUM, True)
    (kind, _, name, op_id, args), (post_kind, _, post_id, post_args) = rec.log
    assert (kind, post_kind) == ("pre", "post")
    assert name is OpName.all_reduce
    assert isinstance(op_id, int)
    assert isinstance(args, hook_args.AllReducePreHookArgs)
    assert args.tensor is t and args.tensor.numel() == 10
    assert args.async_op is True
    assert post_id == op_id, "pre and post hooks of one op share the op_id"
    assert isinstance(post_args, hook_args.CollectivePostHookArgs)
    assert post_args.work is work

    rec.log.clear()
    comm.broadcast(t, 0, False)
    _, _, name, _, args = rec.log[0]
    assert name is OpName.broadcast
    assert isinstance(args, hook_args.BroadcastPreHookArgs)
    assert args.root == 0 and args.async_op is False and args.tensor is t

    with pytest.raises(TypeError, match="hook must be callable"):
        comm.register_pre_hook(42)  # type: ignore[arg-type]
    comm.finalize()


def test_hook_op_ids_increase_across_ops_and_comms() -> None:
    a, b = _fake(), _fake()
    ids: list[tuple[str, int]] = []
    a.register_pre_hook(lambda name, op_id, args: ids.append(("a", op_id)))
    b.register_pre_hook(lambda name, op_id, args: ids.append(("b", op_id)))
    t = torch.ones(3)
    a.all_reduce(t, ReduceOp.SUM, False)
    a.barrier(False)
    b.all_reduce(t, ReduceOp.SUM, False)
    a.broadcast(t, 0, False)
    b.barrier(True)
    assert [who for who, _ in ids] == ["a", "a", "b", "a", "b"]
    values = [op_id for _, op_id in ids]
    assert all(x < y for x, y in itertools.pairwise(values)), values
    a.finalize()
    b.finalize()


def test_hook_removal_and_order() -> None:
    comm = _fake()
    log: list[tuple[Any, ...]] = []
    first, second, third = (_Recorder(log, tag) for tag in ("first", "second", "third"))
    h1 = comm.register_pre_hook(first.pre)
    comm.register_pre_hook(second.pre)
    h3 = comm.register_pre_hook(third.pre)
    p1 = comm.register_post_hook(first.post)
    comm.register_post_hook(second.post)

    comm.barrier(False)
    assert [(e[0], e[1]) for e in log] == [
        ("pre", "first"),
        ("pre", "second"),
        ("pre", "third"),
        ("post", "first"),
        ("post", "second"),
    ]

    log.clear()
    h1.remove()
    h1.remove()  # a second remove is a no-op
    p1.remove()
    comm.barrier(False)
    assert [(e[0], e[1]) for e in log] == [("pre", "second"), ("pre", "third"), ("post", "second")]

    log.clear()
    h3.remove()
    h4 = comm.register_pre_hook(first.pre)  # re-registered hooks go last
    comm.barrier(False)
    assert [(e[0], e[1]) for e in log] == [("pre", "second"), ("pre", "first"), ("post", "second")]
    h4.remove()
    comm.finalize()


class _HookFailure(Exception):
    pass


def test_raising_pre_hook_stops_the_op() -> None:
    comm = _fake()
    impl = comm.get_backend_impl()
    assert isinstance(impl, TorchCommFake)
    impl.last_op = None
    posts: list[int] = []
    seen: list[int] = []

    def bad(name: OpName, op_id: int, args: Any) -> None:
        seen.append(op_id)
        raise _HookFailure(f"refused {name}")

    handle = comm.register_pre_hook(bad)
    comm.register_post_hook(lambda op_id, args: posts.append(op_id))
    with pytest.raises(_HookFailure, match=r"refused OpName\.all_reduce"):
        comm.all_reduce(torch.ones(2), ReduceOp.SUM, False)
    assert posts == [], "the post-hook must not run when a pre-hook raised"
    assert impl.last_op is None, "the backend op must not run when a pre-hook raised"

    handle.remove()
    comm.all_reduce(torch.ones(2), ReduceOp.SUM, False)
    assert impl.last_op is not None
    op, options = impl.last_op
    assert op == "all_reduce"
    assert options.op_id is not None and options.op_id > seen[0]
    assert posts == [options.op_id]
    comm.finalize()


def test_finalize_and_split_hooks() -> None:
    comm = _fake("hooked_parent")
    rec = _Recorder()
    comm.register_pre_hook(rec.pre)
    comm.register_post_hook(rec.post)

    child = comm.split([0], "child")
    (_, _, name, op_id, args), (_, _, post_id, post_args) = rec.log
    assert name is OpName.split
    assert isinstance(args, hook_args.SplitPreHookArgs)
    assert args.ranks == [0] and args.name == "child"
    assert post_id == op_id
    assert isinstance(post_args, hook_args.SplitPostHookArgs)
    assert post_args.new_comm is child

    rec.log.clear()
    assert comm.split([], "nobody") is None
    assert [e[0] for e in rec.log] == ["pre"], "split([]) fires no post-hook"
    assert rec.log[0][2] is OpName.split and rec.log[0][4].ranks == []

    rec.log.clear()
    comm.finalize()
    (_, _, name, op_id, args), (_, _, post_id, post_args) = rec.log
    assert name is OpName.finalize
    assert op_id == FINALIZE_OP_ID and post_id == FINALIZE_OP_ID
    assert isinstance(args, hook_args.FinalizePreHookArgs)
    assert isinstance(post_args, hook_args.FinalizePostHookArgs)
    child.finalize()


class _TwoRankFake(TorchCommFake):
    """The fake backend claiming size 2, so that point-to-point ops have a peer (rank 1)."""

    def get_size(self) -> int:
        return 2


def test_p2p_and_batch_issue_hooks() -> None:
    register_backend("fake2_test_api", _TwoRankFake)
    comm = new_comm("fake2_test_api", CPU, name="fake2")
    impl = comm.get_backend_impl()
    assert isinstance(impl, _TwoRankFake)
    rec = _Recorder()
    comm.register_pre_hook(rec.pre)
    comm.register_post_hook(rec.post)
    t = torch.ones(4)

    assert comm.send(t, 1, False).is_completed()
    assert comm.recv(t, 1, True).is_completed()
    (_, _, send_name, _, send_args), _, (_, _, recv_name, _, recv_args), _ = rec.log
    assert send_name is OpName.send and isinstance(send_args, hook_args.SendPreHookArgs)
    assert send_args.peer == 1 and send_args.tensor is t and send_args.async_op is False
    assert recv_name is OpName.recv and isinstance(recv_args, hook_args.RecvPreHookArgs)
    assert recv_args.peer == 1 and recv_args.async_op is True

    rec.log.clear()
    batch = comm.batch_op_create()
    batch.send(t, 1)
    batch.recv(torch.zeros(4), 1)
    assert [op.type for op in batch.ops] == [P2POpType.SEND, P2POpType.RECV]
    work = batch.issue(False)
    assert work.is_completed()
    (_, _, name, op_id, args), (_, _, post_id, post_args) = rec.log
    assert name is OpName.batch_op_issue
    assert isinstance(args, hook_args.BatchOpIssuePreHookArgs)
    assert args.num_ops == 2 and args.async_op is False
    assert post_id == op_id
    assert isinstance(post_args, hook_args.BatchOpIssuePostHookArgs) and post_args.work is work
    assert impl.last_op is not None and impl.last_op[0] == "batch_op_issue"
    assert impl.last_op[1].op_id == op_id

    with pytest.raises(RuntimeError, match="Cannot issue empty batch operation"):
        comm.batch_op_create().issue(False)
    # Only gloo refuses a peer equal to the caller; the fake backend accepts it (a size-1 ring).
    selfish = comm.batch_op_create()
    selfish.send(t, 0)
    selfish.recv(t, 0)
    assert selfish.issue(False).is_completed()
    solo = _fake()
    solo.send(t, 0, False).wait()
    solo.recv(t, 0, True).wait()
    solo.finalize()
    comm.finalize()


def test_abort_hooks() -> None:
    comm = _fake()
    calls: list[str] = []
    comm.register_abort_hook(lambda: calls.append("one"))
    h2 = comm.register_abort_hook(lambda: calls.append("two"))
    comm.register_abort_hook(lambda: calls.append("three"))
    assert isinstance(h2, RemovableHandle)
    h2.remove()
    h2.remove()  # a second remove is a no-op
    comm.abort()
    assert calls == ["one", "three"]  # registration order, removed hook skipped
    comm.abort()  # a second abort is a no-op: the hooks run once
    assert calls == ["one", "three"]
    comm.finalize()


# ============================================================================ plug-in backends


class _Waitable:
    """What a plug-in op may return: anything with ``wait()``."""

    def __init__(self) -> None:
        self.waits = 0

    def wait(self) -> None:
        self.waits += 1


class DummyPyBackend(TorchCommBackend):
    """A Python plug-in backend: rank 0 of 2, records calls, has no ``barrier`` override."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.next_result: Any = None
        self.name = ""
        self.timeout: timedelta | None = None

    def init(self, device: torch.device, name: str, options: CommOptions) -> None:
        self.calls.append(("init", (device, name, options), {}))
        self.name = name

    def finalize(self) -> None:
        self.calls.append(("finalize", (), {}))

    def get_rank(self) -> int:
        return 0

    def get_size(self) -> int:
        return 2

    def get_backend_name(self) -> str:
        return "dummy_impl"

    def get_comm_name(self) -> str:
        return self.name

    def split(self, ranks: list[int], name: str, options: CommOptions) -> TorchCommBackend:
        child = DummyPyBackend()
        child.init(CPU, name, options)
        return child

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeout = timeout

    def all_reduce(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(("all_reduce", args, kwargs))
        return self.next_result

    def gather(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(("gather", args, kwargs))
        output_tensor_list, input_tensor, _root, _async_op = args
        for i, out in enumerate(output_tensor_list):
            out.copy_(input_tensor + 10 * i)
        return None

    def send(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(("send", args, kwargs))
        return None


class OtherPyBackend(DummyPyBackend):
    pass


def _dummy() -> tuple[TorchComm, DummyPyBackend]:
    register_backend("dummy_py", DummyPyBackend)
    comm = new_comm("dummy_py", CPU, name=f"dummy{next(_comm_counter)}")
    impl = comm.get_backend_impl()
    assert isinstance(impl, DummyPyBackend)
    return comm, impl


def test_plugin_backend_dispatch() -> None:
    comm, impl = _dummy()
    assert comm.get_backend() == "dummy_py", "get_backend() is the name given to new_comm"
    assert comm.get_backend_impl() is impl
    assert comm.get_rank() == 0 and comm.get_size() == 2
    assert comm.get_device() == CPU
    assert impl.calls[0][0] == "init" and impl.calls[0][1][1] == comm.get_name()

    t = torch.ones(3)
    op = ReduceOp.MAX
    work = comm.all_reduce(t, op, True, hints={"ignored": "yes"}, timeout=timedelta(seconds=5))
    name, args, kwargs = impl.calls[-1]
    assert name == "all_reduce"
    assert kwargs == {}, "plug-ins get positional args only"
    assert len(args) == 3 and args[0] is t and args[1] is op and args[2] is True
    assert work.is_completed(), "returning None means completed"
    work._set_status(WorkStatus.ERROR)  # allowed on Python-created works
    assert work.is_completed() and work.status() is WorkStatus.ERROR  # failed is finished
    work._set_status(WorkStatus.INPROGRESS)
    assert not work.is_completed()

    waitable = _Waitable()
    impl.next_result = waitable
    work = comm.all_reduce(t, ReduceOp.SUM, True)
    assert not work.is_completed(), "a returned waitable is in progress until wait()"
    assert waitable.waits == 0
    work.wait()
    assert waitable.waits == 1 and work.is_completed()
    work.wait()
    assert waitable.waits == 1, "wait() calls the plug-in's wait() once"

    impl.next_result = 42
    with pytest.raises(TypeError, match="must return None or an object with wait"):
        comm.all_reduce(t, ReduceOp.SUM, False)

    comm.set_timeout(timedelta(seconds=9))
    assert impl.timeout == timedelta(seconds=9)

    with pytest.raises(
        RuntimeError, match=r'Tried to call pure virtual function "TorchCommBackend::barrier"'
    ):
        comm.barrier(False)
    with pytest.raises(
        RuntimeError, match=r'Tried to call pure virtual function "TorchCommBackend::broadcast"'
    ):
        comm.broadcast(t, 0, False)
    with pytest.raises(RuntimeError, match="setHints not implemented"):
        comm.set_hints({"a": "b"})

    batch = comm.batch_op_create()
    batch.send(t, 1)
    with pytest.raises(RuntimeError, match="batch_op_issue not implemented for Python backends"):
        batch.issue(False)
    assert all(call[0] != "send" for call in impl.calls), "batch ops must not reach the backend"

    comm.finalize()
    assert impl.calls[-1][0] == "finalize"


class _OwnGatherSingle(DummyPyBackend):
    """A plug-in with its own ``gather_single``: upstream calls it, not the default."""

    def gather_single(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("gather_single", args, kwargs))


def test_plugin_own_gather_single_is_called() -> None:
    register_backend("own_gather_single", _OwnGatherSingle)
    comm = new_comm("own_gather_single", CPU, name=f"own{next(_comm_counter)}")
    impl = comm.get_backend_impl()
    assert isinstance(impl, _OwnGatherSingle)
    out, inp = torch.zeros(6), torch.ones(3)
    comm.gather_single(out, inp, 0, False)
    name, args, _ = impl.calls[-1]
    assert name == "gather_single" and args[0] is out and args[1] is inp and args[2:] == (0, False)
    comm.finalize()


def test_plugin_gather_single_goes_through_gather() -> None:
    comm, impl = _dummy()
    inp = torch.tensor([1.0, 2.0, 3.0])
    out = torch.zeros(6)
    work = comm.gather_single(out, inp, 0, False)
    assert work.is_completed()
    name, args, kwargs = impl.calls[-1]
    assert name == "gather" and kwargs == {}
    outputs, given_input, root, async_op = args
    assert given_input is inp and root == 0 and async_op is False
    assert len(outputs) == 2
    for chunk in outputs:
        assert chunk.numel() == 3
        assert chunk.untyped_storage().data_ptr() == out.untyped_storage().data_ptr(), (
            "chunks must be views of the root's output"
        )
    assert torch.equal(out, torch.tensor([1.0, 2.0, 3.0, 11.0, 12.0, 13.0]))
    comm.finalize()


def test_register_backend_rules() -> None:
    register_backend("dummy_py", DummyPyBackend)
    register_backend("dummy_py", DummyPyBackend)  # the same class again: no-op
    with pytest.raises(RuntimeError, match="'dummy_py' is already registered"):
        register_backend("dummy_py", OtherPyBackend)
    comm, _ = _dummy()
    assert type(comm.get_backend_impl()) is DummyPyBackend
    comm.finalize()

    assert torchcomms._is_backend_registered("dummy_py")
    assert torchcomms._is_backend_registered("fake")
    assert not torchcomms._is_backend_registered("no_such_backend")
    assert not torchcomms.is_backend_built("dummy_py"), "built means shipped, not registered"

    with pytest.raises(ModuleNotFoundError, match="failed to find backend"):
        new_comm("no_such_backend", CPU, name="nope")
    with pytest.raises(TypeError, match="must be a class"):
        register_backend("not_a_class", DummyPyBackend())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="name must be a non-empty str"):
        register_backend("", DummyPyBackend)

    class NotABackend:
        pass

    register_backend("not_a_backend_test_api", NotABackend)
    with pytest.raises(TypeError, match="class NotABackend must subclass TorchCommBackend"):
        new_comm("not_a_backend_test_api", CPU, name="nope")


def test_built_backends_and_reconfigure_support() -> None:
    assert torchcomms.is_backend_built("gloo")
    assert torchcomms.is_backend_built("fake")
    assert not torchcomms.is_backend_built("no_such_backend")
    built = torchcomms.built_backends()
    assert "fake" in built and "gloo" in built
    # gloo supports reconfigure: the comm waits, unconnected, for its first reconfigure.
    gloo_comm = new_comm("gloo", CPU, name="reconf", enable_reconfigure=True)
    assert gloo_comm.get_init_handle().startswith("gloo:-1:-1:127.0.0.1:")
    with pytest.raises(torchcomms.CommStateError, match=r"reconfigure\(\) has not been called yet"):
        gloo_comm.barrier(False)
    gloo_comm.reconfigure(0, [gloo_comm.get_init_handle()])
    assert (gloo_comm.get_rank(), gloo_comm.get_size()) == (0, 1)
    gloo_comm.barrier(False)
    gloo_comm.finalize()
    register_backend("dummy_py", DummyPyBackend)
    with pytest.raises(RuntimeError, match="enable_reconfigure=true is not supported"):
        new_comm("dummy_py", CPU, name="reconf", enable_reconfigure=True)
    comm = _fake(enable_reconfigure=True)  # the fake backend supports reconfigure
    assert comm.get_options().enable_reconfigure is True
    comm.finalize()


# ============================================================================ compat modules


def test_compat_modules_expose_upstream_names() -> None:
    from torchcomms import _comms, _comms_gloo

    for name in (
        "ReduceOp",
        "OpName",
        "TorchCommBackend",
        "RemovableHandle",
        "AllReducePreHookArgs",
        "BroadcastPreHookArgs",
        "new_comm",
    ):
        assert hasattr(_comms, name), f"torchcomms._comms.{name} missing"
    assert _comms.ReduceOp is ReduceOp
    assert _comms.OpName is OpName
    assert _comms.TorchCommBackend is TorchCommBackend
    assert _comms.new_comm is new_comm
    assert _comms.AllReducePreHookArgs is hook_args.AllReducePreHookArgs
    assert issubclass(_comms_gloo.TorchCommGloo, TorchCommBackend)
    assert torchcomms.objcol.all_gather_object is not None


def test_gloo_single_rank_from_env(clean_env: pytest.MonkeyPatch) -> None:
    """As upstream's test_factory: a 1-rank gloo comm with only env (MASTER_PORT=0) and no store."""
    from torchcomms._comms_gloo import TorchCommGloo

    for key, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "localhost",
        "MASTER_PORT": "0",
        "TORCHCOMM_GLOO_HOSTNAME": "localhost",
    }.items():
        clean_env.setenv(key, value)
    for name in ("factory_a", "factory_b"):  # back to back: the bootstrap port is released
        comm = new_comm("gloo", CPU, name=name)
        assert isinstance(comm.get_backend_impl(), TorchCommGloo)
        assert comm.get_backend() == "gloo"
        assert comm.get_rank() == 0 and comm.get_size() == 1
        assert comm.get_name() == name

        t = torch.arange(6, dtype=torch.float32)
        comm.all_reduce(t, ReduceOp.SUM, False).wait()
        torch.testing.assert_close(t, torch.arange(6, dtype=torch.float32), rtol=0, atol=0)
        comm.all_reduce(t, ReduceOp.PREMUL_SUM(2.0), False).wait()
        torch.testing.assert_close(t, 2 * torch.arange(6, dtype=torch.float32), rtol=0, atol=0)
        ints = torch.tensor([5, 7, 9], dtype=torch.int32)
        work = comm.all_reduce(ints, ReduceOp.AVG, True)
        work.wait()
        assert torch.equal(ints, torch.tensor([5, 7, 9], dtype=torch.int32))
        comm.finalize()
        with pytest.raises(RuntimeError, match="TorchCommGloo already finalized"):
            comm.finalize()
        with pytest.raises(RuntimeError, match="TorchCommGloo not initialized"):
            comm.all_reduce(t, ReduceOp.SUM, False)


_FRESH_IMPORT_SCRIPT = textwrap.dedent(
    """
    import gc, os, sys
    import torch
    import torch.distributed as dist
    assert dist.is_available()
    import torchcomms
    from torchcomms import ReduceOp, new_comm
    assert dist.init_process_group is not None and torchcomms.new_comm is new_comm
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="localhost", MASTER_PORT="0")
    for var in ("TORCHCOMM_RANK", "TORCHCOMM_SIZE"):
        os.environ.pop(var, None)
    comm = new_comm("gloo", torch.device("cpu"), name="leaked")
    t = torch.ones(3)
    comm.all_reduce(t, ReduceOp.SUM, True).wait()
    assert t.tolist() == [1.0, 1.0, 1.0]
    del comm  # never finalized: must only log, not crash or hang at exit
    gc.collect()
    print("FRESH-IMPORT-OK")
    """
)


def test_import_after_torch_distributed_in_fresh_interpreter() -> None:
    """``import torch.distributed`` then ``import torchcomms`` (and an unfinalized gloo comm)."""
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", _FRESH_IMPORT_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, (
        f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    assert "FRESH-IMPORT-OK" in proc.stdout


def test_every_op_has_its_pre_hook_class() -> None:
    """``hook_args.pre_hook_class``: each op's class (upstream's name), a field per pre-hook
    argument then ``async_op``; an op without one is refused, naming what it needs."""
    import dataclasses
    from types import SimpleNamespace

    from torchcomms import optable
    from torchcomms.optable import hook_args

    all_reduce = optable.BY_NAME[optable.OpName.all_reduce]
    assert hook_args.pre_hook_class(all_reduce) is hook_args.AllReducePreHookArgs
    for entry in optable.OPS:
        cls = hook_args.pre_hook_class(entry)
        assert cls.__name__ == entry.hook_class_name
        assert [f.name for f in dataclasses.fields(cls)][-1] == "async_op", entry.method
    missing = SimpleNamespace(
        method="scatter_single",
        hook_class_name="ScatterSinglePreHookArgs",
        hook=("input", "output", "root"),
    )
    with pytest.raises(RuntimeError, match=r"needs hook_args\.ScatterSinglePreHookArgs"):
        hook_args.pre_hook_class(missing)  # type: ignore[arg-type]
    short = SimpleNamespace(
        method="all_reduce", hook_class_name="AllReducePreHookArgs", hook=("tensor", "op")
    )
    with pytest.raises(RuntimeError, match="a field per pre-hook argument"):
        hook_args.pre_hook_class(short)  # type: ignore[arg-type]
