"""Shared-memory segment files: create (mode 0600), attach, unlink, and sweep stale ones.

A segment is a file under ``/dev/shm`` named ``torchcomm-<owner pid>-<random token>``.
The token is fresh per communicator (never derived from ``MASTER_PORT``, which collides
across jobs); the owner's pid in the name lets any later process sweep the segments of
owners that died before unlinking.  Segments are mapped with ``mmap`` and the file
descriptor is closed at once, so a live mapping is the only thing that holds one.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets

from torchcomms.transport.procs import process_alive

SHM_DIR = "/dev/shm"
PREFIX = "torchcomm-"


def available() -> bool:
    """Whether this host has a writable tmpfs at ``/dev/shm``."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK | os.X_OK)


def new_name() -> str:
    return f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"


def _path(name: str) -> str:
    if "/" in name or not name.startswith(PREFIX):
        raise ValueError(f"not a torchcomms segment name: {name!r}")
    return os.path.join(SHM_DIR, name)


def create(name: str, nbytes: int) -> mmap.mmap:
    """Create and map a new segment of ``nbytes`` (zero-filled; pages are allocated on touch)."""
    fd = os.open(_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes)
    except BaseException:
        os.unlink(_path(name))
        raise
    finally:
        os.close(fd)


def attach(name: str, nbytes: int) -> mmap.mmap:
    """Map an existing segment; its size must be exactly ``nbytes``."""
    fd = os.open(_path(name), os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if size != nbytes:
            raise RuntimeError(f"shared-memory segment {name} has {size} bytes, expected {nbytes}")
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_path(name))


def sweep_stale(prefix: str = PREFIX) -> list[str]:
    """Unlink this user's files named ``<prefix><owner pid>-...`` whose owner process is gone
    (segments by default; the one-sided transport's tables pass theirs); return their names."""
    removed: list[str] = []
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return removed
    uid = os.getuid()
    for entry in entries:
        if not entry.startswith(prefix):
            continue
        pid_text = entry[len(prefix) :].partition("-")[0]
        if not pid_text.isdigit() or process_alive(int(pid_text)):
            continue
        try:
            if os.stat(os.path.join(SHM_DIR, entry)).st_uid != uid:
                continue
            os.unlink(os.path.join(SHM_DIR, entry))
            removed.append(entry)
        except OSError:
            continue
    return removed
