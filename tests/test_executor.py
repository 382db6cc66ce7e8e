"""``OpExecutor`` and ``AsyncWork`` on their own: issue order, how errors travel to ``wait()``,
completions, bounded drains and closing. Single process, no transport: these are the
mechanisms every backend op runs through."""

from __future__ import annotations

import threading
import time

import pytest

from torchcomms.errors import CommTimeoutError
from torchcomms.runtime.executor import Completion, OpExecutor
from torchcomms.runtime.work import AsyncWork, WorkStatus


def _work() -> AsyncWork:
    return AsyncWork("[test] op", timeout_s=5.0)


def test_ops_run_in_issue_order_and_sync_waits_for_them() -> None:
    ex = OpExecutor("order")
    seen: list[int] = []
    gate = threading.Event()

    def first() -> None:
        gate.wait(5)
        seen.append(0)

    works = [ex.submit(first, _work())]
    works += [ex.submit(lambda i=i: seen.append(i), _work()) for i in range(1, 6)]
    assert seen == [] and not works[-1].is_completed()
    gate.set()
    ex.drain(5.0)  # what a sync op does before running inline
    assert seen == [0, 1, 2, 3, 4, 5]
    for w in works:
        w.wait()
        assert w.is_completed() and w.status() is WorkStatus.COMPLETED
    ex.close(5.0)


def test_error_is_captured_and_reraised_by_wait() -> None:
    ex = OpExecutor("errors")
    boom = ValueError("gloo said no")

    def fail() -> None:
        raise boom

    bad = ex.submit(fail, _work())
    good = ex.submit(lambda: None, _work())  # a failed op does not stop later ones
    with pytest.raises(ValueError, match="gloo said no"):
        bad.wait()
    assert bad.exception() is boom and bad.status() is WorkStatus.ERROR
    assert bad.is_completed(), "a failed work is completed (status() says how)"
    good.wait()
    assert good.is_completed()
    timed_out = ex.submit(lambda: (_ for _ in ()).throw(CommTimeoutError("late")), _work())
    with pytest.raises(CommTimeoutError, match="late"):
        timed_out.wait()
    assert timed_out.status() is WorkStatus.TIMEDOUT
    ex.close(5.0)


def test_completion_runs_once_at_wait_without_blocking_the_queue() -> None:
    ex = OpExecutor("completion")
    calls: list[str] = []
    arrived = threading.Event()

    def post_receive() -> Completion:
        calls.append("posted")

        def complete() -> None:
            assert arrived.wait(5), "the next queued op must run before this completion"
            calls.append("completed")

        return complete

    recv = ex.submit(post_receive, _work())
    send = ex.submit(lambda: arrived.set(), _work())  # queued behind the posted receive
    send.wait()
    assert calls == ["posted"] and not recv.is_completed()
    recv.wait()
    recv.wait()  # a second wait is a no-op
    assert calls == ["posted", "completed"] and recv.is_completed()
    ex.close(5.0)


def test_failing_completion_reports_through_wait() -> None:
    ex = OpExecutor("completion-error")

    def post() -> Completion:
        def complete() -> None:
            raise CommTimeoutError("recv timed out")

        return complete

    work = ex.submit(post, _work())
    with pytest.raises(CommTimeoutError, match="recv timed out"):
        work.wait()
    assert work.status() is WorkStatus.TIMEDOUT and work.is_completed()
    with pytest.raises(CommTimeoutError, match="recv timed out"):
        work.wait()  # the error sticks
    ex.close(5.0)


def test_drain_is_bounded_and_close_refuses_new_ops() -> None:
    ex = OpExecutor("bounded")
    release = threading.Event()
    stuck = ex.submit(lambda: release.wait(10) and None, _work())
    start = time.monotonic()
    with pytest.raises(CommTimeoutError, match=r"communicator bounded: 1 earlier async op\(s\)"):
        ex.drain(0.2)
    assert time.monotonic() - start < 5
    release.set()
    stuck.wait()
    ex.close(5.0)
    with pytest.raises(RuntimeError, match="communicator bounded is finalized"):
        ex.submit(lambda: None, _work())


def test_wait_on_a_stuck_executor_has_a_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(AsyncWork, "STUCK_GRACE_S", 0.3)
    ex = OpExecutor("stuck")
    release = threading.Event()
    ex.submit(lambda: release.wait(10) and None, _work())
    behind = ex.submit(lambda: None, AsyncWork("[test] behind", timeout_s=0.1))
    with pytest.raises(CommTimeoutError, match=r"\[test\] behind: work did not complete within"):
        behind.wait()  # bound: 2 x 0.1 s + 0.3 s, while the op ahead of it is stuck
    assert behind.status() is WorkStatus.TIMEDOUT
    release.set()
    ex.close(5.0)
