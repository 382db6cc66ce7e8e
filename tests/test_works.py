"""Works and entry points, in one process: how a failed work reports itself, per-op timeouts,
sparse tensors, devices ``new_comm`` refuses, ``abort()`` on the API layer and the
executor, and ``abort_process_on_timeout_or_error`` (with the process exit stubbed out).

The same guarantees over real ranks and transports are in ``test_abort.py``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch

from torchcomms import (
    BatchP2POptions,
    CollectiveMismatchError,
    CommAbortedError,
    CommStateError,
    CommTimeoutError,
    CommValidationError,
    PeerFailureError,
    ReduceOp,
    TorchComm,
    TorchCommBackend,
    WorkStatus,
    new_comm,
    register_backend,
)
from torchcomms.backends.fake import TorchCommFake
from torchcomms.comm import core as comm_core
from torchcomms.runtime.executor import Completion, OpExecutor
from torchcomms.runtime.work import AsyncWork, PythonBackendWork
from torchcomms.types import AbortInfo, AbortReason

CPU = torch.device("cpu")
SUM = ReduceOp.SUM
_names = itertools.count()


@pytest.fixture(autouse=True)
def _fr_dumps_in_tmp(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Aborts and failures make the always-on flight recorder dump: keep it out of /tmp."""
    monkeypatch.setenv("TORCHCOMM_FR_DUMP_TEMP_FILE", str(tmp_path / "fr_"))


def _fake(**kwargs: Any) -> TorchComm:
    return new_comm("fake", CPU, name=f"works{next(_names)}", **kwargs)


class _OpFailed(RuntimeError):
    """A plain error raised by an op body."""


def _work(timeout_s: float = 5.0) -> AsyncWork:
    return AsyncWork("[test comm=w rank=0] all_reduce op_id=1", timeout_s)


# ============================================================================ work status


def test_failed_async_work_is_completed_and_reraises_the_same_error() -> None:
    ex = OpExecutor("status")
    boom = _OpFailed("peer said no")
    late = CommTimeoutError("late")
    bad = ex.submit(lambda: (_ for _ in ()).throw(boom), _work())
    timed_out = ex.submit(lambda: (_ for _ in ()).throw(late), _work())
    good = ex.submit(lambda: None, _work())
    good.wait()
    assert good.is_completed() and good.status() is WorkStatus.COMPLETED
    assert good.exception() is None
    cases = ((bad, boom, WorkStatus.ERROR), (timed_out, late, WorkStatus.TIMEDOUT))
    for work, error, status in cases:
        for _ in range(3):  # every wait() raises the original error object
            with pytest.raises(type(error)) as info:
                work.wait()
            assert info.value is error
        assert work.is_completed() and work.status() is status
        assert work.exception() is error
    ex.close(5.0)


def test_failed_completion_is_completed_and_sticks() -> None:
    ex = OpExecutor("completion")
    calls: list[str] = []
    error = CommTimeoutError("recv timed out")

    def post() -> Completion:
        def complete() -> None:
            calls.append("ran")
            raise error

        return complete

    work = ex.submit(post, _work())
    ex.drain(5.0)
    assert not work.is_completed() and work.status() is WorkStatus.INPROGRESS
    for _ in range(2):
        with pytest.raises(CommTimeoutError) as info:
            work.wait()
        assert info.value is error
    assert calls == ["ran"], "the completion runs once"
    assert work.is_completed() and work.status() is WorkStatus.TIMEDOUT
    ex.close(5.0)


def test_stuck_wait_finishes_the_work_as_timed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(AsyncWork, "STUCK_GRACE_S", 0.2)
    ex = OpExecutor("stuck")
    release = threading.Event()
    ex.submit(lambda: release.wait(10) and None, _work())
    behind = ex.submit(lambda: None, _work(timeout_s=0.05))
    with pytest.raises(CommTimeoutError, match="work did not complete within") as info:
        behind.wait()
    first = info.value
    assert behind.is_completed() and behind.status() is WorkStatus.TIMEDOUT
    release.set()
    ex.drain(5.0)  # the op ran after all: too late, the work already failed
    with pytest.raises(CommTimeoutError) as info:
        behind.wait()
    assert info.value is first and behind.status() is WorkStatus.TIMEDOUT
    ex.close(5.0)


def test_python_backend_work_error_sticks() -> None:
    class _Inner:
        waits = 0

        def wait(self) -> None:
            self.waits += 1
            raise ValueError("plug-in failed")

    inner = _Inner()
    seen: list[BaseException] = []
    work = PythonBackendWork(inner, on_error=seen.append)
    assert not work.is_completed() and work.status() is WorkStatus.INPROGRESS
    errors = []
    for _ in range(2):
        with pytest.raises(ValueError, match="plug-in failed") as info:
            work.wait()
        errors.append(info.value)
    assert errors[0] is errors[1] and inner.waits == 1 and len(seen) == 1
    assert work.is_completed() and work.status() is WorkStatus.ERROR


# ============================================================================ validation


def _last_timeout(comm: TorchComm) -> timedelta:
    impl = comm.get_backend_impl()
    assert isinstance(impl, TorchCommFake) and impl.last_op is not None
    return impl.last_op[1].timeout


def _every_op(comm: TorchComm, **kw: Any) -> dict[str, Callable[[], Any]]:
    t, out = torch.ones(4), torch.zeros(4)
    batch_ops = comm.batch_op_create()
    batch_ops.send(t, 0)
    opts = BatchP2POptions()
    if "timeout" in kw:
        opts.timeout = kw["timeout"]
    return {
        "send": lambda: comm.send(t, 0, False, **kw),
        "recv": lambda: comm.recv(t, 0, True, **kw),
        "broadcast": lambda: comm.broadcast(t, 0, False, **kw),
        "all_reduce": lambda: comm.all_reduce(t, SUM, True, **kw),
        "reduce": lambda: comm.reduce(t, 0, SUM, False, **kw),
        "all_gather": lambda: comm.all_gather([out], t, False, **kw),
        "all_gather_v": lambda: comm.all_gather_v([out], t, False, **kw),
        "all_gather_single": lambda: comm.all_gather_single(out, t, False, **kw),
        "reduce_scatter": lambda: comm.reduce_scatter(out, [t], SUM, False, **kw),
        "reduce_scatter_v": lambda: comm.reduce_scatter_v(out, [t], SUM, False, **kw),
        "reduce_scatter_single": lambda: comm.reduce_scatter_single(out, t, SUM, False, **kw),
        "all_to_all_single": lambda: comm.all_to_all_single(out, t, False, **kw),
        "all_to_all_v_single": lambda: comm.all_to_all_v_single(out, t, [4], [4], False, **kw),
        "all_to_all": lambda: comm.all_to_all([out], [t], False, **kw),
        "barrier": lambda: comm.barrier(False, **kw),
        "scatter": lambda: comm.scatter(out, [t], 0, False, **kw),
        "gather": lambda: comm.gather([out], t, 0, False, **kw),
        "gather_single": lambda: comm.gather_single(out, t, 0, True, **kw),
        "split": lambda: comm.split([0], f"child{next(_names)}", **kw),
        "batch_op_issue": lambda: batch_ops.issue(False, opts),
    }


@pytest.mark.parametrize(
    "bad", [timedelta(0), timedelta(seconds=-1), timedelta(microseconds=-1)], ids=str
)
def test_per_op_timeout_must_be_positive(bad: timedelta) -> None:
    comm = _fake()
    fired: list[Any] = []
    comm.register_pre_hook(lambda name, op_id, args: fired.append(name))
    prefix = f"[TorchCommFake comm={comm.get_name()} rank=0]"
    for op, call in _every_op(comm, timeout=bad).items():
        with pytest.raises(ValueError) as info:
            call()
        assert str(info.value) == f"{prefix} {op}: timeout must be positive, got {bad}", op
    assert fired == [], "a refused timeout stops the op before any hook"
    # Positive per-op timeouts, and no timeout (the comm's), still work.
    for call in _every_op(comm, timeout=timedelta(milliseconds=1)).values():
        call()
    for call in _every_op(comm).values():
        call()
    assert _last_timeout(comm) == comm.get_options().timeout
    comm.finalize()


def test_batch_options_default_timeout_means_the_comms() -> None:
    comm = _fake(timeout=timedelta(seconds=7))
    batch = comm.batch_op_create()
    batch.send(torch.ones(2), 0)
    opts = BatchP2POptions()
    assert opts.timeout == timedelta(0)  # upstream's value for "unset"
    batch.issue(False, opts)
    assert _last_timeout(comm) == timedelta(seconds=7)
    opts.timeout = timedelta(seconds=3)
    batch.issue(False, opts)
    assert _last_timeout(comm) == timedelta(seconds=3)
    comm.finalize()


def test_sparse_tensors_are_told_they_are_sparse() -> None:
    comm = _fake()
    prefix = f"[TorchCommFake comm={comm.get_name()} rank=0]"
    coo = torch.zeros(4).to_sparse()
    with pytest.warns(UserWarning, match="Sparse CSR"):
        csr = torch.zeros(2, 2).to_sparse_csr()
    cases: list[tuple[str, str, Callable[[], Any]]] = [
        ("all_reduce", "tensor", lambda: comm.all_reduce(coo, SUM, False)),
        ("send", "tensor", lambda: comm.send(coo, 0, True)),
        ("broadcast", "tensor", lambda: comm.broadcast(csr, 0, False)),
        ("all_gather", "tensor_list[0]", lambda: comm.all_gather([coo], torch.zeros(4), False)),
        ("all_gather_single", "output", lambda: comm.all_gather_single(coo, torch.ones(4), False)),
    ]
    for op, what, call in cases:
        with pytest.raises(CommValidationError) as info:
            call()
        layout = "torch.sparse_csr" if op == "broadcast" else "torch.sparse_coo"
        expected = f"{prefix} {op}: {what} must be dense (got a sparse tensor, layout {layout})"
        assert str(info.value) == expected
        assert isinstance(info.value, RuntimeError)
    # A strided, non-contiguous tensor still gets the contiguity message.
    with pytest.raises(CommValidationError, match="Tensor must be contiguous"):
        comm.all_reduce(torch.zeros(2, 4).t(), SUM, False)
    comm.finalize()


def test_new_comm_refuses_devices_the_backend_cannot_serve() -> None:
    meta = torch.device("meta")
    with pytest.raises(CommValidationError) as info:
        new_comm("gloo", meta, name="meta_comm")
    assert str(info.value) == (
        "new_comm: backend gloo cannot serve device meta (it serves cpu, and cuda when CUDA "
        "is available)"
    )
    if torch.cuda.is_available():
        beyond = torch.device("cuda", torch.cuda.device_count())
        with pytest.raises(CommValidationError, match=f"device {beyond} is not available"):
            new_comm("gloo", beyond, name="cuda_comm")
    else:
        with pytest.raises(CommValidationError) as info:
            new_comm("gloo", torch.device("cuda"), name="cuda_comm")
        assert str(info.value).startswith(
            "new_comm: device cuda is not available: torch.cuda.is_available() is False"
        )
    # The fake backend never touches data: any device is fine.
    comm = new_comm("fake", meta, name=f"meta{next(_names)}")
    assert comm.get_device() == meta
    comm.finalize()


# ============================================================================ abort (API layer)


def test_abort_on_the_fake_backend() -> None:
    comm = _fake()
    calls: list[str] = []
    comm.register_abort_hook(lambda: calls.append("hook"))

    def raising_hook() -> None:
        raise RuntimeError("a broken hook")

    comm.register_abort_hook(raising_hook)  # logged, does not stop the abort
    assert comm.is_aborted() is False and comm.get_abort_info() is None
    comm.abort(AbortReason.INTERNAL_ERROR, "from the test")
    assert comm.is_aborted() is True and calls == ["hook"]
    info = comm.get_abort_info()
    assert isinstance(info, AbortInfo)
    assert info.reason is AbortReason.INTERNAL_ERROR and info.context == "from the test"
    comm.abort()  # no-op: the hooks do not rerun, the first reason stays
    assert calls == ["hook"] and comm.get_abort_info() is info
    name = comm.get_name()
    with pytest.raises(CommAbortedError, match=rf"comm={name} .*all_reduce: .*aborted"):
        comm.all_reduce(torch.ones(2), SUM, True)
    comm.finalize()  # quiet after abort
    assert comm.is_aborted() is True
    with pytest.raises(CommStateError, match="already finalized"):
        comm.finalize()
    with pytest.raises(TypeError, match="reason must be an AbortReason"):
        _fake().abort("now")  # type: ignore[arg-type]


class _AbortLess(TorchCommBackend):
    """A plug-in without abort (upstream's default raises), and an all_reduce that can fail."""

    fail_with: BaseException | None = None

    def init(self, device: torch.device, name: str, options: Any) -> None:
        self._name = name

    def finalize(self) -> None:
        pass

    def get_rank(self) -> int:
        return 0

    def get_size(self) -> int:
        return 1

    def get_backend_name(self) -> str:
        return "abortless"

    def get_comm_name(self) -> str:
        return self._name

    def all_reduce(self, *args: Any) -> None:
        error = type(self).fail_with
        if error is not None:
            raise error


register_backend("abortless_test_works", _AbortLess)


def test_abort_unsupported_by_a_plugin_leaves_the_comm_usable() -> None:
    comm = new_comm("abortless_test_works", CPU, name=f"pl{next(_names)}")
    calls: list[str] = []
    comm.register_abort_hook(lambda: calls.append("hook"))
    assert comm.is_abort_supported() is False
    for _ in range(2):
        with pytest.raises(RuntimeError, match="abort not implemented for communicator"):
            comm.abort()
    assert calls == ["hook"], "the hooks run once, even when the backend cannot abort"
    assert comm.is_aborted() is False and comm.get_abort_info() is None
    comm.all_reduce(torch.ones(2), SUM, False)  # still usable
    comm.finalize()


# ============================================================================ abort (executor)


def test_executor_abort_fails_running_and_queued_works_at_once(timeout_scale: float) -> None:
    ex = OpExecutor("abort")
    started, release = threading.Event(), threading.Event()
    gone = RuntimeError("the transport gave up")

    def stuck() -> None:
        started.set()
        release.wait(10)
        raise gone  # surfaces after the abort: must not replace CommAbortedError

    running = ex.submit(stuck, _work())
    queued = [ex.submit(lambda: None, _work()) for _ in range(3)]
    assert started.wait(5)
    outcomes: list[tuple[str, float]] = []

    def waiter(work: AsyncWork) -> None:
        t0 = time.monotonic()
        try:
            work.wait()
            outcomes.append(("returned", time.monotonic() - t0))
        except BaseException as exc:
            outcomes.append((type(exc).__name__, time.monotonic() - t0))

    threads = [threading.Thread(target=waiter, args=(w,)) for w in [running, *queued]]
    for t in threads:
        t.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    ex.abort()
    ex.abort()  # idempotent
    abort_s = time.monotonic() - t0
    for t in threads:
        t.join(5)
    assert abort_s < 0.1 * timeout_scale, abort_s
    assert [name for name, _ in outcomes] == ["CommAbortedError"] * 4, outcomes
    assert all(elapsed < 1.0 * timeout_scale for _, elapsed in outcomes), outcomes
    for w in [running, *queued]:
        assert w.is_completed() and w.status() is WorkStatus.ERROR
        err = w.exception()
        assert isinstance(err, CommAbortedError)
        assert "comm=w rank=0] all_reduce op_id=1: the communicator was aborted" in str(err)
    with pytest.raises(CommAbortedError, match="communicator abort was aborted"):
        ex.submit(lambda: None, _work())
    ex.drain(5.0)  # returns at once: nothing will run any more
    t0 = time.monotonic()
    ex.close(30.0)  # does not join the stuck op thread
    assert time.monotonic() - t0 < 0.5
    release.set()


def test_abort_skips_a_pending_completion_and_wraps_a_running_ones_error() -> None:
    ex = OpExecutor("abort-completion")
    in_completion, release = threading.Event(), threading.Event()
    ran: list[str] = []

    def never_waited() -> Completion:
        return lambda: ran.append("should not run")

    def waited() -> Completion:
        def complete() -> None:
            in_completion.set()
            release.wait(10)
            raise RuntimeError("connection reset by peer")

        return complete

    pending = ex.submit(never_waited, _work())
    running = ex.submit(waited, _work())
    ex.drain(5.0)
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            running.wait()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    assert in_completion.wait(5)
    ex.abort()
    with pytest.raises(CommAbortedError, match="aborted while this op was pending"):
        pending.wait()
    assert ran == [] and pending.is_completed() and pending.status() is WorkStatus.ERROR
    release.set()  # the completion's transport error surfaces after the abort
    thread.join(5)
    assert len(errors) == 1 and isinstance(errors[0], CommAbortedError), errors
    assert isinstance(errors[0].__cause__, RuntimeError)
    assert running.is_completed() and running.status() is WorkStatus.ERROR


# ============================================================================ abort on error


class _Exited(BaseException):
    """Raised by the stubbed process exit."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _raise_exit(code: int) -> None:
    raise _Exited(code)


@pytest.mark.parametrize(
    "error",
    [
        CommTimeoutError("[Plug comm=x rank=0] all_reduce op_id=3: timed out after 1 s"),
        PeerFailureError("[Plug comm=x rank=0] all_reduce op_id=3: peer rank 1 died"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_abort_on_error_ends_the_process(
    error: BaseException, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(comm_core, "_exit_process", _raise_exit)
    monkeypatch.setattr(_AbortLess, "fail_with", error)
    comm = new_comm(
        "abortless_test_works",
        CPU,
        name=f"fatal{next(_names)}",
        abort_process_on_timeout_or_error=True,
    )
    hooks: list[str] = []
    comm.register_abort_hook(lambda: hooks.append("abort hook"))
    with (
        caplog.at_level(logging.CRITICAL, logger="torchcomms.comm.core"),
        pytest.raises(_Exited) as info,
    ):
        comm.all_reduce(torch.ones(2), SUM, False)
    assert info.value.code == comm_core.ABORT_EXIT_CODE == 86
    assert hooks == ["abort hook"]
    (record,) = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    text = record.getMessage()
    for part in (comm.get_name(), "rank 0", "all_reduce", "exit code 86", str(error)):
        assert part in text, (part, text)
    fields = (record.comm, record.rank, record.op)  # type: ignore[attr-defined]
    assert fields == (comm.get_name(), 0, "all_reduce")
    abort_info = comm.get_abort_info()
    assert abort_info is not None
    expected = (
        AbortReason.TIMED_OUT if isinstance(error, CommTimeoutError) else AbortReason.NETWORK_ERROR
    )
    assert abort_info.reason is expected and abort_info.context == str(error)


@pytest.mark.parametrize(
    ("option", "error"),
    [
        (False, CommTimeoutError("[Plug comm=x rank=0] all_reduce: timed out")),
        (False, PeerFailureError("[Plug comm=x rank=0] all_reduce: peer rank 1 failed")),
        (True, CollectiveMismatchError("[Plug comm=x rank=0] all_reduce: mismatch")),
        (True, CommValidationError("[Plug comm=x rank=0] all_reduce: bad size")),
        (True, ValueError("not a communicator failure")),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else f"option={v}",
)
def test_errors_that_do_not_end_the_process(
    option: bool, error: BaseException, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(comm_core, "_exit_process", _raise_exit)
    monkeypatch.setattr(_AbortLess, "fail_with", error)
    comm = new_comm(
        "abortless_test_works",
        CPU,
        name=f"survive{next(_names)}",
        abort_process_on_timeout_or_error=option,
    )
    hooks: list[str] = []
    comm.register_abort_hook(lambda: hooks.append("abort hook"))
    with pytest.raises(type(error)) as info:
        comm.all_reduce(torch.ones(2), SUM, False)
    assert info.value is error and hooks == [] and comm.get_abort_info() is None
