"""``process_alive``: whether a process of this host runs, as every liveness check asks it;
``host_identity``: which host this is, for every locality decision.

Used by the shm transport (sweeping stale segments, waits), the tcp path (a local peer
whose connection ended) and windows; it reads only ``/proc`` and signals, never a peer.
"""

from __future__ import annotations

import os
import socket

from torchcomms import config


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs on this host (a zombie, killed but not yet reaped, counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def host_identity() -> str:
    """This host's identity for locality decisions (``TORCHCOMM_HOST_ID`` overrides it)."""
    override = config.env_str("TORCHCOMM_HOST_ID")
    if override:
        return override
    boot_id = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        pass
    return f"{socket.gethostname()}/{boot_id}"
