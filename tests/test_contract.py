"""The backend contract and the communicator state machine, in one process.

* Every backend is called through ``CommBackend``: the built-ins implement it whole, a
  plug-in written to upstream's convention is adapted (``PluginBackend``), and every CPU
  transport implements ``CpuOps`` whole.
* The state machine lives in ``TorchComm``, so a plug-in gets fail-fast after an error
  with the original cause; a method the plug-in lacks does not count as a failure.
* ``abort`` moves a comm to ``aborted`` (ops refused, ``finalize`` still works); a comm made
  with ``enable_reconfigure=True`` refuses ops until its first ``reconfigure``.
"""

from __future__ import annotations

import inspect
import itertools
from datetime import timedelta
from typing import Any

import pytest
import torch

from torchcomms import CommOptions, ReduceOp, TorchCommBackend, new_comm, register_backend
from torchcomms.backends.contract import CommBackend
from torchcomms.backends.cpu.backend import TorchCommGloo
from torchcomms.backends.cpu.hier.ops import HierOps
from torchcomms.backends.cpu.ops import CpuOps
from torchcomms.backends.cpu.shm.ops import ShmOps
from torchcomms.backends.cpu.tcp.ops import TcpOps
from torchcomms.backends.fake import TorchCommFake
from torchcomms.backends.plugin import PluginBackend
from torchcomms.errors import (
    BackendNotImplementedError,
    CommAbortedError,
    CommError,
    CommStateError,
    CommTimeoutError,
)
from torchcomms.runtime.state import CommState

CPU = torch.device("cpu")
_names = itertools.count()


def _defines(cls: type, name: str, below: tuple[type, ...]) -> bool:
    """Whether a class of ``cls``'s MRO other than ``below`` defines ``name``."""
    return any(name in vars(k) for k in cls.__mro__ if k not in below)


def test_every_backend_and_transport_implements_the_whole_interface() -> None:
    """Every op of the table reaches every backend and every CPU transport."""
    from torchcomms import optable
    from torchcomms.backends.cpu.ops import required_ops
    from torchcomms.comm import TorchComm

    bases = (CommBackend, TorchCommBackend, object)
    for cls in (TorchCommGloo, TorchCommFake, PluginBackend):
        assert issubclass(cls, CommBackend) and issubclass(cls, TorchCommBackend)
        assert not inspect.isabstract(cls), (cls, sorted(cls.__abstractmethods__))
        missing = [e.method for e in optable.OPS if not _defines(cls, e.method, bases)]
        assert missing == [] and _defines(cls, "batch_op_issue", bases), (cls, missing)
    for ops_cls in (TcpOps, ShmOps, HierOps):
        assert issubclass(ops_cls, CpuOps)
        assert not inspect.isabstract(ops_cls), (ops_cls, sorted(ops_cls.__abstractmethods__))
        missing = sorted(n for n in required_ops() if not _defines(ops_cls, n, (object,)))
        assert missing == [], (ops_cls, missing)
    # TorchComm has every op of the table, with the table's signature.
    for entry in optable.OPS:
        params = list(inspect.signature(getattr(TorchComm, entry.method)).parameters)
        assert params == ["self", *entry.names, "async_op", "hints", "timeout"], entry


class _FlakyPlugin(TorchCommBackend):
    """A plug-in (upstream convention): all_reduce fails while ``broken``; no barrier."""

    def __init__(self) -> None:
        super().__init__()
        self.name = ""
        self.broken: BaseException | None = None
        self.wait_error: BaseException | None = None
        self.calls = 0

    def init(self, device: torch.device, name: str, options: CommOptions) -> None:
        self.name = name

    def finalize(self) -> None:
        pass

    def get_rank(self) -> int:
        return 0

    def get_size(self) -> int:
        return 1

    def get_backend_name(self) -> str:
        return "flaky"

    def get_comm_name(self) -> str:
        return self.name

    def split(self, ranks: list[int], name: str, options: CommOptions) -> TorchCommBackend:
        child = _FlakyPlugin()
        child.init(CPU, name, options)
        return child

    def all_reduce(self, tensor: torch.Tensor, op: Any, async_op: bool) -> Any:
        self.calls += 1
        if self.broken is not None:
            raise self.broken
        if self.wait_error is not None:
            error = self.wait_error

            class _Failing:
                def wait(self) -> None:
                    raise error

            return _Failing()
        tensor.add_(1)
        return None


def _flaky() -> tuple[Any, _FlakyPlugin]:
    register_backend("flaky_test_contract", _FlakyPlugin)
    comm = new_comm("flaky_test_contract", CPU, name=f"flaky{next(_names)}")
    impl = comm.get_backend_impl()
    assert isinstance(impl, _FlakyPlugin)
    return comm, impl


def test_plugin_error_makes_later_ops_fail_fast_with_the_cause() -> None:
    comm, impl = _flaky()
    t = torch.zeros(2)
    # A method the plug-in lacks is not a communicator failure.
    with pytest.raises(
        BackendNotImplementedError, match=r'pure virtual function "TorchCommBackend::barrier"'
    ):
        comm.barrier(False)
    comm.all_reduce(t, ReduceOp.SUM, False)
    assert torch.equal(t, torch.ones(2))

    impl.broken = RuntimeError("link to rank 1 went down")
    with pytest.raises(RuntimeError, match="link to rank 1 went down") as first:
        comm.all_reduce(t, ReduceOp.SUM, False)
    assert type(first.value) is RuntimeError, "the op that failed raises the plug-in's own error"
    impl.broken = None
    calls = impl.calls
    for call in (
        lambda: comm.all_reduce(t, ReduceOp.SUM, False),
        lambda: comm.broadcast(t, 0, True),
        lambda: comm.split([0], "child"),
        lambda: comm.batch_op_create(),
    ):
        with pytest.raises(CommError) as info:
            call()
        text = str(info.value)
        assert "unusable after an earlier failure" in text, text
        assert "RuntimeError: link to rank 1 went down" in text, text
    assert impl.calls == calls, "no op may reach the plug-in after its failure"
    assert torch.equal(t, torch.ones(2))
    assert "error" in repr(comm)
    comm.finalize()  # finalize still works after an error
    with pytest.raises(CommStateError, match="not initialized"):
        comm.all_reduce(t, ReduceOp.SUM, False)


def test_plugin_error_in_wait_keeps_its_type_for_later_ops() -> None:
    comm, impl = _flaky()
    t = torch.zeros(2)
    impl.wait_error = CommTimeoutError("rank 1 never arrived")
    work = comm.all_reduce(t, ReduceOp.SUM, True)
    with pytest.raises(CommTimeoutError, match="rank 1 never arrived"):
        work.wait()
    with pytest.raises(CommTimeoutError, match="unusable after an earlier failure: rank 1 never"):
        comm.all_reduce(t, ReduceOp.SUM, False)
    comm.finalize()


class _BadSplitPlugin(_FlakyPlugin):
    def split(self, ranks: list[int], name: str, options: CommOptions) -> Any:
        return object()


def test_a_plugin_split_that_returns_no_backend_is_refused() -> None:
    register_backend("bad_split_test_contract", _BadSplitPlugin)
    comm = new_comm("bad_split_test_contract", CPU, name=f"badsplit{next(_names)}")
    with pytest.raises(
        TypeError,
        match=r"_BadSplitPlugin\.split returned an object whose class object must subclass "
        "TorchCommBackend",
    ):
        comm.split([0], "child")
    child = comm.split([], "nobody")
    assert child is None
    t = torch.zeros(2)
    comm.all_reduce(t, ReduceOp.SUM, False)  # a refused split is no communicator failure
    assert torch.equal(t, torch.ones(2))
    comm.finalize()


def test_abort_refuses_later_ops_but_finalize_works() -> None:
    comm = new_comm("fake", CPU, name=f"aborted{next(_names)}")
    hooks: list[str] = []
    comm.register_abort_hook(lambda: hooks.append("abort"))
    comm.abort()
    assert hooks == ["abort"]
    with pytest.raises(CommAbortedError, match=r"all_reduce: the communicator was aborted"):
        comm.all_reduce(torch.ones(2), ReduceOp.SUM, False)
    with pytest.raises(CommAbortedError):
        comm.split([0], "child")
    comm.finalize()
    with pytest.raises(CommStateError, match="already finalized"):
        comm.finalize()


def test_reconfigure_mode_is_uninitialized_until_reconfigure() -> None:
    comm = new_comm("fake", CPU, name=f"reconf{next(_names)}", enable_reconfigure=True)
    assert comm._status.state is CommState.UNINITIALIZED
    with pytest.raises(CommStateError, match=r"reconfigure\(\) has not been called yet"):
        comm.all_reduce(torch.ones(2), ReduceOp.SUM, False)
    work = comm.reconfigure(1, [comm.get_init_handle()], timeout=timedelta(seconds=5))
    assert work.is_completed()
    comm.all_reduce(torch.ones(2), ReduceOp.SUM, False)
    comm.finalize()


def test_the_backend_reports_failures_to_the_comm_state() -> None:
    comm = new_comm("fake", CPU, name=f"report{next(_names)}")
    backend = comm._backend
    assert backend.status is comm._status, "TorchComm hands its state machine to the backend"
    cause = CommTimeoutError("[fake] all_reduce: timed out after 1 s waiting for peer rank 3")
    assert backend.report_failure(cause) is cause
    assert backend.report_failure(CommError("a later failure")) is not None
    assert comm._status.cause is cause, "the first failure is the cause"
    with pytest.raises(CommTimeoutError, match="waiting for peer rank 3"):
        comm.barrier(False)
    comm.finalize()
