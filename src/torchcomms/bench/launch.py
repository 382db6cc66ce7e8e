"""Spawn ``--nproc`` local ranks of the benchmark and supervise them.

Each rank is ``python -m torchcomms.bench --_worker ARGS`` with ``TORCHCOMM_RANK/SIZE`` and
``MASTER_ADDR/MASTER_PORT`` (a free loopback port) set; rank 0 serves the job store and
prints the report on the inherited stdout.  The launcher polls the children: when one
exits non-zero it gives the others a short grace period, kills the rest and returns that
code, so a dead rank never leaves the others hanging.  With ``--hosts H`` the ranks start
in H simulated hosts (``hosts``), which are deleted after the ranks have stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from torchcomms.bench.hosts import Layout, SimulatedHosts
from torchcomms.bench.runner import COMMAND_ENV
from torchcomms.transport import listen

GRACE_S = 3.0
_LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (rank 0 binds it next), below
    the ephemeral range (``transport.listen.free_master_port``)."""
    return listen.free_master_port()


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def spawn(argv: list[str], nproc: int, hosts: int = 1) -> int:
    """Run ``nproc`` ranks with ``argv`` (on ``hosts`` simulated hosts when more than one);
    returns the exit code for the whole run."""
    if hosts <= 1:
        return _spawn(argv, nproc, None)
    try:
        with SimulatedHosts(nproc, hosts) as layout:
            return _spawn(argv, nproc, layout)
    except KeyboardInterrupt:  # while the hosts were being built or deleted
        print("torchcomms.bench: interrupted", file=sys.stderr)
        return 130


def _spawn(argv: list[str], nproc: int, layout: Layout | None) -> int:
    port = free_port()  # on simulated hosts: host 0's namespace has every port free
    command = " ".join(["python -m torchcomms.bench", *argv])
    base = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(nproc):
            env = dict(
                base,
                TORCHCOMM_RANK=str(rank),
                TORCHCOMM_SIZE=str(nproc),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                **{COMMAND_ENV: command},
            )
            cmd = [sys.executable, "-m", "torchcomms.bench", "--_worker", *argv]
            if layout is not None:
                cmd, env = layout.command(rank, argv), layout.environment(rank, env)
            procs.append(subprocess.Popen(cmd, env=env))
        return _supervise(procs)
    except KeyboardInterrupt:
        print("torchcomms.bench: interrupted; stopping the ranks", file=sys.stderr)
        _stop(procs)
        return 130
    finally:
        _stop(procs)


def _supervise(procs: list[subprocess.Popen[bytes]]) -> int:
    while True:
        codes = [proc.poll() for proc in procs]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            rank, code = failed[0]
            deadline = time.monotonic() + GRACE_S
            while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                time.sleep(0.05)
            alive = [r for r, p in enumerate(procs) if p.poll() is None]
            stopping = f"; stopping ranks {alive}" if alive else ""
            print(
                f"torchcomms.bench: rank {rank} exited with code {code}{stopping}",
                file=sys.stderr,
            )
            _stop(procs)
            return code if code is not None and code > 0 else 1
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.05)
