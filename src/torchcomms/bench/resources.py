"""What this process holds: file descriptors by kind, threads, memory maps, RSS, segments.

Read from ``/proc/self`` (Linux); for the churn checks (``tests/test_churn.py``,
``benchmarks/diagnostics/churn.py``), which compare a process's holdings after N
communicator life cycles with those after a warm-up.  Elsewhere every count reads 0.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from torchcomms.transport.shm import segment

#: The kinds of file descriptor counted apart (``readlink /proc/self/fd/N``).
FD_KINDS = ("socket", "pipe", "eventfd", "eventpoll", "io_uring", "other_anon", "file")


def _fd_kind(target: str) -> str:
    if target.startswith("socket:"):
        return "socket"
    if target.startswith("pipe:"):
        return "pipe"
    if target.startswith("anon_inode:"):
        name = target[len("anon_inode:") :].strip("[]")
        return name if name in ("eventfd", "eventpoll", "io_uring") else "other_anon"
    return "file"


@dataclass
class Holdings:
    """One sample of this process's resources."""

    fds: dict[str, int] = field(default_factory=dict)  # kind -> count (``FD_KINDS``)
    py_threads: int = 0  # ``threading.active_count()``
    tasks: int = 0  # every thread, native ones included (``/proc/self/task``)
    maps: int = 0  # lines of ``/proc/self/maps``
    rss_kib: int = 0
    segments: int = 0  # ``/dev/shm/torchcomm-<this pid>-*``
    thread_names: list[str] = field(default_factory=list)

    @property
    def fd_total(self) -> int:
        return sum(self.fds.values())

    def as_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["fd_total"] = self.fd_total
        return out


def sample() -> Holdings:
    """This process's holdings now."""
    kinds: Counter[str] = Counter({kind: 0 for kind in FD_KINDS})
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        fds = []
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed since
            continue
        kinds[_fd_kind(target)] += 1
    return Holdings(
        fds=dict(kinds),
        py_threads=threading.active_count(),
        tasks=_count(lambda: len(os.listdir("/proc/self/task"))),
        maps=_count(_map_lines),
        rss_kib=_count(_rss_kib),
        segments=_count(_own_segments),
        thread_names=sorted(t.name for t in threading.enumerate()),
    )


def _count(read: Callable[[], int]) -> int:
    try:
        return read()
    except (OSError, ValueError):
        return 0


def _map_lines() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _own_segments() -> int:
    mine = f"{segment.PREFIX}{os.getpid()}-"
    return sum(1 for entry in os.listdir(segment.SHM_DIR) if entry.startswith(mine))


def trim_heap() -> None:
    """Give the allocator's free memory back to the system (glibc's ``malloc_trim``; a no-op
    elsewhere), so that RSS shows what is in use: glibc keeps freed heap pages, which pile
    up as threads come and go."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def rss_kib() -> int:
    """This process's resident memory now (KiB)."""
    return _count(_rss_kib)


def growth(before: Holdings, after: Holdings) -> dict[str, int]:
    """How much each count grew from ``before`` to ``after`` (fds per kind and in all)."""
    out = {f"fd_{kind}": after.fds.get(kind, 0) - before.fds.get(kind, 0) for kind in FD_KINDS}
    out["fd_total"] = after.fd_total - before.fd_total
    out["tasks"] = after.tasks - before.tasks
    out["py_threads"] = after.py_threads - before.py_threads
    out["maps"] = after.maps - before.maps
    out["rss_kib"] = after.rss_kib - before.rss_kib
    out["segments"] = after.segments - before.segments
    return out
