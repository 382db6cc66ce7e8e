"""Shared by the distwrap tests: named cases run in one task per world, each read by a test.

A test module registers cases (``cases.case(name)``); its rank function calls ``run_all`` on
each rank, which runs every case in registration order and records ``"ok"`` or the case's
traceback, so one failing case neither hides the others nor costs a second spawn.  The
task runs once per session (``Cases.results``); each ``test_*`` then asserts one case on
every rank.  Every case must leave no process group behind: ``clean`` destroys whatever
is left and restores torch's torchcomms switch.  ``DISTWRAP_CASE_TIMES=1`` (with ``-s``)
prints each case's time on each rank.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from tests.harness import RankContext, run_ranks

Case = Callable[[RankContext], Any]


def clean() -> None:
    """Destroy a leftover world and reset distwrap's mode (after a case that failed midway)."""
    from torchcomms.distwrap.new_comm import _reset_state

    if dist.is_initialized():
        dist.destroy_process_group()
    _reset_state()
    dist.config.use_torchcomms = False


class Cases:
    """An ordered registry of cases, and the cached outcome of running them on ``world`` ranks."""

    def __init__(self) -> None:
        self.cases: dict[str, Case] = {}
        self._results: list[dict[str, Any]] | BaseException | None = None

    def case(self, name: str) -> Callable[[Case], Case]:
        def register(fn: Case) -> Case:
            assert name not in self.cases, name
            self.cases[name] = fn
            return fn

        return register

    def run_all(self, ctx: RankContext) -> dict[str, Any]:
        outcomes: dict[str, Any] = {}
        for name, fn in self.cases.items():
            started = time.monotonic()
            try:
                value = fn(ctx)
                outcomes[name] = "ok" if value is None else value
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException:  # pytest.raises' Failed too
                outcomes[name] = f"rank {ctx.rank}, case {name}:\n{traceback.format_exc()}"
            finally:
                try:
                    clean()
                except Exception:
                    outcomes[name] = f"{outcomes[name]}\ncleanup: {traceback.format_exc()}"
            if os.environ.get("DISTWRAP_CASE_TIMES"):
                print(f"rank {ctx.rank} {name}: {time.monotonic() - started:.2f} s", flush=True)
        return outcomes

    def results(self, fn: Callable[..., Any], world: int, timeout: float) -> list[dict[str, Any]]:
        """Every rank's outcomes; the task runs once (a failure is re-raised by every test)."""
        if self._results is None:
            try:
                self._results = run_ranks(fn, world, timeout=timeout, fresh=True)
            except BaseException as exc:
                self._results = exc
        if isinstance(self._results, BaseException):
            raise self._results
        return self._results

    def check(self, fn: Callable[..., Any], world: int, name: str, timeout: float = 120) -> None:
        outcomes = [r[name] for r in self.results(fn, world, timeout)]
        broken = [o for o in outcomes if o != "ok"]
        assert not broken, "\n".join(str(b) for b in broken)
