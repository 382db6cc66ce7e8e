"""What the multi-process torchft tests share: child processes whose output is read line by
line (a reader thread each), waits with a deadline that show every process's last lines,
and torchft's lighthouse (the ``torchft_lighthouse`` binary shipped in the wheel).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent


class Proc:
    """A child process (its own session) whose output lines a reader thread collects."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def steps(self) -> list[dict[str, Any]]:
        """The ``STEP {json}`` lines the process printed so far."""
        return [json.loads(line[5:]) for line in list(self.lines) if line.startswith("STEP ")]

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


def until(what: str, cond: Callable[[], bool], timeout_s: float, procs: list[Proc]) -> None:
    """Wait for ``cond``; past ``timeout_s``, fail with every process's last lines."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name}:\n" + "\n".join(p.lines[-25:]) for p in procs)
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}\n{tails}")
        time.sleep(0.1)


def start_lighthouse(min_replicas: int, join_timeout_ms: int) -> tuple[Proc, str]:
    """torchft's lighthouse on a free port, and its address (skips where it is missing)."""
    beside = Path(sys.executable).with_name("torchft_lighthouse")
    binary = str(beside) if beside.exists() else shutil.which("torchft_lighthouse")
    if not binary:
        pytest.skip("torchft_lighthouse (shipped in the torchft wheel) is not on PATH")
    argv = [binary, "--bind", "[::]:0", "--min_replicas", str(min_replicas)]
    argv += ["--join_timeout_ms", str(join_timeout_ms), "--quorum_tick_ms", "50"]
    argv += ["--heartbeat_timeout_ms", "1500"]
    lighthouse = Proc("lighthouse", argv, dict(os.environ))
    try:
        until(
            "the lighthouse",
            lambda: any("listening on" in x for x in lighthouse.lines),
            30,
            [lighthouse],
        )
    except BaseException:
        lighthouse.kill()
        raise
    found = re.search(r"listening on: (http://\S+)", "\n".join(lighthouse.lines))
    assert found, lighthouse.lines
    return lighthouse, found.group(1)


def commits(proc: Proc, n: int, after_step: int = -1) -> list[dict[str, Any]]:
    """The committed steps of ``n`` participants after ``after_step``."""
    return [s for s in proc.steps() if s["commit"] and s["n"] == n and s["step"] > after_step]
