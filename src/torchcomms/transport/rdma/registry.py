"""This process's registered memory, and the table through which peers check an access.

Every registration gets a slot in a per-process table file under ``/dev/shm`` (mode 0600,
``torchcomm-rdma-<pid>-<token>``; a dead owner's table is swept when the next one is made).  A slot holds ``state, token, ptr, len`` (four ``u64``).  The access key
of a registration is ``<instance>.<slot>.<token>``: the instance names this process's table,
the token is fresh per registration, so a key of freed memory, of another process, or a
made-up one never matches a live slot.

Two kinds of accessor check a slot before touching the memory behind it:

* a peer on this host that copies with cross-memory attach (``cma``) reads the slot from the
  table file under a shared byte-range lock on it (an open-file-description lock, so each
  accessor's lock is its own, even between threads of one process), copies, then unlocks;
* this process's serving thread (``server``, for TCP peers) pins the registration in memory
  (``Registration.pin``) for the length of the copy.

Deregistration marks the slot closing (no new access is granted), then takes the slot's
exclusive lock and waits for the pins to drop; only then is the slot freed and the tensor
released, so an access never touches memory that was given back.  Where an accessor holds on
past ``_RELEASE_WAIT_S`` (a stopped peer), the tensor stays referenced in a quarantine that is
retried at the next registration: memory is kept rather than ever handed out while in use.

Threads: any user thread registers and deregisters (``Registry._lock`` guards the slots);
serving threads pin; peers' threads lock byte ranges of the file.
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import fcntl
import logging
import os
import secrets
import struct
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from torchcomms.errors import RemoteAccessError
from torchcomms.transport.shm import segment

logger = logging.getLogger("torchcomms.transport.rdma.registry")

#: One slot: state, token, ptr, len.
SLOT = struct.Struct("<QQQQ")
SLOT_BYTES = 64
FREE, LIVE, CLOSING = 0, 1, 2
#: How long a deregistration waits for accessors before it quarantines the memory.
_RELEASE_WAIT_S = 1.0
_FLOCK = "hhqqi"  # struct flock: l_type, l_whence, l_start, l_len, l_pid
#: Table files: ``torchcomm-rdma-<owner pid>-<token>`` under ``/dev/shm``.
TABLE_PREFIX = f"{segment.PREFIX}rdma-"


def range_lock(fd: int, slot: int, kind: int, blocking: bool = False) -> bool:
    """Take (``kind`` F_RDLCK / F_WRLCK) or drop (F_UNLCK) the OFD lock of ``slot``; whether
    it was granted (a non-blocking take of a held lock is refused, never waited on)."""
    cmd = fcntl.F_OFD_SETLKW if blocking else fcntl.F_OFD_SETLK
    arg = struct.pack(_FLOCK, kind, os.SEEK_SET, slot * SLOT_BYTES, SLOT_BYTES, 0)
    try:
        fcntl.fcntl(fd, cmd, arg)
    except (BlockingIOError, PermissionError):
        return False
    return True


def parse_key(key: str) -> tuple[str, int, int]:
    """``(instance, slot, token)`` of an access key; a malformed key is refused."""
    parts = key.split(".")
    try:
        if len(parts) != 3:
            raise ValueError
        return parts[0], int(parts[1]), int(parts[2], 16)
    except ValueError:
        raise RemoteAccessError(f"malformed access key {key!r}") from None


def check_slot(
    raw: bytes, key: str, slot: int, token: int, ptr: int, nbytes: int, owner: str
) -> None:
    """Refuse an access unless ``raw`` (a slot as read) is live, its token is the key's, and
    ``[ptr, ptr + nbytes)`` lies inside it."""
    state, live_token, base, length = SLOT.unpack_from(raw) if len(raw) >= SLOT.size else (0,) * 4
    if state != LIVE or live_token != token:
        raise RemoteAccessError(
            f"access key {key!r} does not name live memory of {owner}: the memory was "
            "deregistered (its RdmaMemory was dropped), or the key is wrong"
        )
    if ptr < base or ptr + nbytes > base + length:
        raise RemoteAccessError(
            f"range [{ptr:#x}, {ptr + nbytes:#x}) ({nbytes} bytes) is outside the memory of key "
            f"{key!r} on {owner}, [{base:#x}, {base + length:#x}) ({length} bytes)"
        )


class Registration:
    """One registered range: the tensor that keeps it alive, its slot, and its pins."""

    def __init__(self, registry: Registry, slot: int, tensor: torch.Tensor) -> None:
        self.registry, self.slot, self.tensor = registry, slot, tensor
        self.ptr, self.nbytes = tensor.data_ptr(), tensor.nbytes
        self.token = secrets.randbits(63)
        self.key = f"{registry.instance}.{slot}.{self.token:x}"
        self.users = 1
        self.pins = 0
        self.closing = False

    def covers(self, ptr: int, nbytes: int) -> bool:
        return self.ptr <= ptr and ptr + nbytes <= self.ptr + self.nbytes

    @contextlib.contextmanager
    def pin(self) -> Iterator[None]:
        """Hold the memory for one access by this process's serving thread."""
        with self.registry._lock:
            if self.closing:
                raise RemoteAccessError(
                    f"access key {self.key!r}: the memory is being deregistered"
                )
            self.pins += 1
        try:
            yield
        finally:
            with self.registry._lock:
                self.pins -= 1
                self.registry._unpinned.notify_all()


class Registry:
    """The process-wide registered memory (one per process, ``registry()``)."""

    def __init__(self) -> None:
        self.instance = secrets.token_hex(6)
        self._lock = threading.Lock()
        self._unpinned = threading.Condition(self._lock)
        self._slots: dict[int, Registration] = {}
        #: Live registrations by start address (sorted), to find one that covers a range.
        self._starts: list[tuple[int, int]] = []
        self._free: list[int] = []
        self._quarantine: list[Registration] = []
        self._next_slot = 0
        self._fd = -1
        self.table_path = ""
        self.pid = os.getpid()

    def _table(self) -> int:
        if self._fd < 0:
            segment.sweep_stale(TABLE_PREFIX)
            name = f"{TABLE_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
            path = os.path.join(segment.SHM_DIR, name)
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            self.table_path = path
            atexit.register(self._unlink)
        return self._fd

    def table(self) -> str:
        """The table file's path (created on first use), for the URLs of this process."""
        self._table()
        return self.table_path

    def _unlink(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.table_path)

    def _write_slot(self, slot: int, state: int, reg: Registration | None) -> None:
        values = (state, reg.token, reg.ptr, reg.nbytes) if reg is not None else (state, 0, 0, 0)
        os.pwrite(self._fd, SLOT.pack(*values).ljust(SLOT_BYTES, b"\0"), slot * SLOT_BYTES)

    def register(self, tensor: torch.Tensor) -> tuple[Registration, bool]:
        """The registration of ``tensor``'s bytes and whether an existing one was reused (a
        live registration that already covers them, e.g. the same tensor registered again)."""
        self._retry_quarantine()
        ptr, nbytes = tensor.data_ptr(), tensor.nbytes
        with self._lock:
            fd = self._table()
            # The live registration starting nearest below ``ptr`` (one nested inside a later,
            # larger one may hide that one: then this registers anew, which is still right).
            at = bisect.bisect_right(self._starts, (ptr, sys.maxsize)) - 1
            if at >= 0:
                reg = self._slots[self._starts[at][1]]
                if not reg.closing and reg.covers(ptr, nbytes):
                    reg.users += 1
                    return reg, True
            if self._free:
                slot = self._free.pop()
            else:
                slot, self._next_slot = self._next_slot, self._next_slot + 1
            reg = Registration(self, slot, tensor)
            self._slots[slot] = reg
            bisect.insort(self._starts, (reg.ptr, slot))
            if (slot + 1) * SLOT_BYTES > os.fstat(fd).st_size:
                os.ftruncate(fd, max(4096, 2 * (slot + 1) * SLOT_BYTES))
            self._write_slot(slot, LIVE, reg)
            return reg, False

    def lookup(self, key: str, ptr: int, nbytes: int) -> Registration:
        """This process's live registration of ``key`` covering ``[ptr, ptr + nbytes)``."""
        instance, slot, token = parse_key(key)
        with self._lock:
            reg = self._slots.get(slot) if instance == self.instance else None
            raw = (
                SLOT.pack(LIVE if not reg.closing else CLOSING, reg.token, reg.ptr, reg.nbytes)
                if reg is not None
                else b""
            )
        check_slot(raw, key, slot, token, ptr, nbytes, f"pid {os.getpid()}")
        assert reg is not None
        return reg

    def release(self, reg: Registration) -> None:
        """One user of ``reg`` is gone; the last one deregisters it (module docstring)."""
        with self._lock:
            reg.users -= 1
            if reg.users > 0:
                return
            reg.closing = True
            self._starts.remove((reg.ptr, reg.slot))
            self._write_slot(reg.slot, CLOSING, reg)
        if not self._free_slot(reg, time.monotonic() + _RELEASE_WAIT_S):
            with self._lock:
                self._quarantine.append(reg)
                self._slots.pop(reg.slot, None)
            logger.warning(
                "RdmaMemory %s is still being accessed by a peer after %.1f s; its memory is "
                "kept until the access ends",
                reg.key,
                _RELEASE_WAIT_S,
            )

    def _free_slot(self, reg: Registration, until: float) -> bool:
        """Wait (to ``until``) for accessors of ``reg`` to finish, then free its slot."""
        while True:
            with self._lock:
                if reg.pins == 0 and range_lock(self._fd, reg.slot, fcntl.F_WRLCK):
                    try:
                        self._write_slot(reg.slot, FREE, None)
                    finally:
                        range_lock(self._fd, reg.slot, fcntl.F_UNLCK)
                    if self._slots.get(reg.slot) is reg:
                        del self._slots[reg.slot]
                    self._free.append(reg.slot)
                    reg.tensor = torch.empty(0)
                    return True
                if time.monotonic() >= until:
                    return False
                self._unpinned.wait(0.001)

    def _retry_quarantine(self) -> None:
        with self._lock:
            waiting, self._quarantine = self._quarantine, []
        for reg in waiting:
            if not self._free_slot(reg, 0.0):
                with self._lock:
                    self._quarantine.append(reg)

    def stats(self) -> dict[str, Any]:
        """Live and quarantined registrations (for tests and leak checks)."""
        with self._lock:
            return {"live": len(self._slots), "quarantined": len(self._quarantine)}


_REGISTRY: Registry | None = None
_REGISTRY_LOCK = threading.Lock()


def registry() -> Registry:
    """This process's registry (after ``fork`` a child makes its own)."""
    global _REGISTRY
    with _REGISTRY_LOCK:
        if _REGISTRY is None or _REGISTRY.pid != os.getpid():
            _REGISTRY = Registry()
        return _REGISTRY
