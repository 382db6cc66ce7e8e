"""HSDP on torchcomms with torchft: 2 replica groups x 2 ranks, one rank SIGKILLed mid-run.

Each group shards the model with FSDP2 over a store-less communicator of its own; the
gradient shards are averaged across the groups by torchft's ``Manager`` over
``ProcessGroupTorchComms`` (``tests/torchft_hsdp_rank.py``).  Group 1's rank 1 is SIGKILLed
and the test, as torchrun's agent would, stops the rest of that group; group 0 goes on
committing alone (a quorum of one), then group 1 is restarted, rejoins (two participants
again) and heals: from then on each rank holds the same parameter shard as the same rank of
group 0 at every step.  Behind ``-m slow`` (about 30 s: six processes start FSDP on two
cores).
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
from torch.distributed import TCPStore

pytest.importorskip("torchft.torchcomms", reason="torchft is not installed (see the README)")

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


class _Proc:
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
        return [json.loads(x[5:]) for x in list(self.lines) if x.startswith("STEP ")]

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


def _until(what: str, cond: Callable[[], bool], timeout_s: float, procs: list[_Proc]) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name}:\n" + "\n".join(p.lines[-25:]) for p in procs)
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}\n{tails}")
        time.sleep(0.1)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _commits(p: _Proc, n: int, after: int = -1) -> list[dict[str, Any]]:
    return [s for s in p.steps() if s["commit"] and s["n"] == n and s["step"] > after]


def test_hsdp_group_rank_killed_rejoins_and_heals() -> None:
    binary = Path(sys.executable).with_name("torchft_lighthouse")
    if not binary.exists() and not shutil.which("torchft_lighthouse"):
        pytest.skip("torchft_lighthouse (shipped in the torchft wheel) is not on PATH")
    ctrl = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    lighthouse = _Proc(
        "lighthouse",
        [
            str(binary),
            "--bind",
            "[::]:0",
            "--min_replicas",
            "1",
            "--join_timeout_ms",
            "2000",
            "--quorum_tick_ms",
            "50",
            "--heartbeat_timeout_ms",
            "1500",
        ],
        dict(os.environ),
    )
    procs = [lighthouse]
    try:
        _until(
            "the lighthouse", lambda: any("listening on" in x for x in lighthouse.lines), 30, procs
        )
        address = re.search(r"listening on: (http://\S+)", "\n".join(lighthouse.lines))
        assert address is not None
        env = dict(
            os.environ,
            TORCHFT_LIGHTHOUSE=address.group(1),
            PYTHONPATH=str(REPO),
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS="1",
        )

        def start_group(group: int) -> list[_Proc]:
            port = _free_port()
            return [
                _Proc(
                    f"g{group}r{r}",
                    [
                        sys.executable,
                        "-m",
                        "tests.torchft_hsdp_rank",
                        str(group),
                        str(r),
                        str(port),
                        str(ctrl.port),
                    ],
                    env,
                )
                for r in (0, 1)
            ]

        g0, g1 = start_group(0), start_group(1)
        procs += g0 + g1
        _until(
            "3 commits of both groups on every rank",
            lambda: all(len(_commits(p, 2)) >= 3 for p in g0 + g1),
            120,
            procs,
        )
        killed_at = max(s["step"] for p in g0 + g1 for s in p.steps())
        g1[1].kill()
        # As torchrun's agent does when one of its workers dies: the group's other rank goes too
        # (torchft counts a replica group alive while its rank 0, which serves its manager,
        # heartbeats).
        g1[0].kill()
        _until(
            "3 commits of group 0 alone",
            lambda: all(len(_commits(p, 1, killed_at)) >= 3 for p in g0),
            60,
            procs,
        )
        back = max(s["step"] for p in g0 for s in p.steps())
        g1b = start_group(1)
        procs += g1b
        _until(
            "group 1 rejoined: 3 commits of both groups",
            lambda: all(len(_commits(p, 2, back)) >= 3 for p in g0 + g1b),
            120,
            procs,
        )
        ctrl.set("stop", str(max(s["step"] for p in g0 + g1b for s in p.steps()) + 2))
        for p in g0 + g1b:
            p.proc.wait(60)
            assert p.proc.returncode == 0, (p.name, p.lines[-30:])
    finally:
        for p in procs:
            p.kill()
    # After the rejoin, rank r of group 1 holds rank r of group 0's shard at every step.
    for r in (0, 1):
        ours = {s["step"]: s["shard"] for s in g0[r].steps() if s["commit"] and s["n"] == 2}
        theirs = {s["step"]: s["shard"] for s in g1b[r].steps() if s["commit"]}
        shared = sorted(set(ours) & set(theirs))
        assert len(shared) >= 3, (r, ours, theirs)
        assert all(ours[k] == theirs[k] for k in shared), (r, ours, theirs)
        first = min(theirs)
        assert first > back - 1, (r, first, back)  # healed to the survivors' step
