"""Environment capture: the machine description every absolute number must carry."""

from __future__ import annotations

import datetime
import os
import platform
import socket
from collections.abc import Sequence
from typing import Any

import torch

from torchcomms import config
from torchcomms.bench import memprobe
from torchcomms.transport import placement


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
        "llc_bytes": memprobe.llc_bytes(),
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
