"""Environment capture: the machine description every absolute number must carry."""

from __future__ import annotations

import datetime
import os
import platform
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import torch

from torchcomms import config
from torchcomms.bench import ceilings
from torchcomms.transport import placement

#: One core kept busy, until told or until the process that started it is gone (it checks
#: its parent between a million-step loops, about every 30 ms).
_SPIN = """
import os, sys
parent = int(sys.argv[1])
while os.getppid() == parent:
    for _ in range(1_000_000):
        pass
"""


class Load:
    """``--load N``: N processes that keep a core busy each, beside the ranks, as compute
    and data loading do while a training job communicates.  Started by rank 0, whatever
    launched the job; they end with ``stop`` or, should rank 0 die, by themselves."""

    def __init__(self, n: int) -> None:
        self._procs = [
            subprocess.Popen(
                [sys.executable, "-c", _SPIN, str(os.getpid())], stdin=subprocess.DEVNULL
            )
            for _ in range(n)
        ]

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def stop(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        for p in self._procs:
            p.wait()


def cpu_model() -> str:
    """``model name`` from /proc/cpuinfo (falls back to ``platform.processor()``)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def usable_cores(pids: Sequence[int] = ()) -> int:
    """Cores this host's ranks (``pids``) run on: what placement spread them over, else the
    union of their affinities (``transport.placement``)."""
    return placement.usable_cores(pids)


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def capture(
    command: str,
    world_size: int,
    transport: str,
    baseline_transport: str | None,
    local_pids: Sequence[int] = (),
) -> dict[str, Any]:
    """Everything that explains an absolute time: CPU, cores, load, versions, transport.
    ``local_pids``: the ranks on this host, whose affinities together give the usable cores."""
    usable = usable_cores(local_pids)
    try:
        affinity = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = []
    return {
        "hostname": socket.gethostname(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "usable_cores": usable,
        "affinity": affinity,
        "llc_bytes": ceilings.llc_bytes(),
        "load_average_start": load_average(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "world_size": world_size,
        "oversubscribed": (len(local_pids) or world_size) > usable,
        "transport": transport,
        "baseline_transport": baseline_transport,
        "fr_buffer_size_env": os.environ.get("TORCHCOMM_FR_BUFFER_SIZE"),
        "cpu_affinity": config.cpu_affinity(None),
        "placed_core": placement.placed_core(),
    }
