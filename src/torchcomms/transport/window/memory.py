"""A window's memory on one rank: a signal block and the data, in one mapping.

Layout of the mapping (a ``/dev/shm`` segment when a same-host peer maps it, else an
anonymous shared mapping)::

    line 0            doorbell: word 0 the futex word the owner sleeps on, word 1 "asleep"
    line 1 + s        the count of signals rank ``s`` sent to the owner (word 0)
    ... padded to a page ...
    data              the registered tensor's bytes

Each counter line has exactly one writer: peer ``s`` itself (same host, through its own
mapping of the segment) or the owner's window server thread (a peer on another host).  So
a signal is a plain load-add-store, never a cross-process atomic.  The owner keeps how many
signals it consumed per source in private memory.

Ordering: a put is written (by torch copies) before the counter store that signals it,
and the waiter loads the counter before it reads the data; x86-64's total store order
keeps both in order (the backend uses shared memory only on x86-64, as the shm transport
does), and a full barrier before the counter store also drains non-temporal stores that
a large copy may end with.  The "asleep" handshake needs a full barrier (a locked instruction), see ``_fence``.

Waiting (``SignalBlock.wait``) follows the shm transport's policy (``WaitPolicy``): a short
spin when every rank has a core, yielding for ``yield_s``, then futex dozes of at most
``DOZE_S``; every ``CHECK_S`` it calls the caller's ``check`` (deadline, peer liveness),
which raises to give up.  Runs on the op's thread; ``bump`` runs on the signalling thread.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable

import torch

from torchcomms.transport.shm import futex
from torchcomms.transport.shm import segment as shm_segment
from torchcomms.transport.wait_policy import WaitPolicy

LINE = 64
PAGE = 4096
_Q = LINE // 8
_BELL, _ASLEEP = 0, 1
#: How often a waiting rank checks its deadline and the peer's liveness.
CHECK_S = 0.005

_fence_lock = threading.Lock()


def _fence() -> None:
    """A full memory barrier (taking a lock runs a locked read-modify-write)."""
    _fence_lock.acquire()
    _fence_lock.release()


def header_bytes(size: int) -> int:
    """Bytes before the data: the doorbell and one counter line per member, page-aligned."""
    return -(-(1 + size) * LINE // PAGE) * PAGE


class SignalBlock:
    """The doorbell and counters of one rank's window, seen through some mapping."""

    __slots__ = ("_base", "flags", "size")

    def __init__(self, mm: mmap.mmap, base_address: int, size: int) -> None:
        self.flags = memoryview(mm).cast("q")[: header_bytes(size) // 8]
        self._base = base_address
        self.size = size

    def count(self, src: int) -> int:
        return int(self.flags[(1 + src) * _Q])

    def bump(self, src: int) -> None:
        """One more signal from ``src`` (its only writer), then wake the owner if it sleeps."""
        flags = self.flags
        i = (1 + src) * _Q
        # A large copy may end in non-temporal stores, which store order does not cover:
        # a locked instruction drains them before the counter says the data is there.
        _fence()
        flags[i] = flags[i] + 1
        _fence()  # the counter store before the read of "asleep" (else a lost wake-up)
        if flags[_ASLEEP]:
            flags[_BELL] = (flags[_BELL] + 1) & 0x7FFF_FFFF
            futex.wake(self._base + _BELL * 8, 64)

    def wait(self, src: int, want: int, policy: WaitPolicy, check: Callable[[], None]) -> None:
        """Until ``src``'s counter reaches ``want``; ``check()`` raises to give up."""
        flags = self.flags
        i = (1 + src) * _Q
        if flags[i] >= want:
            return
        for _ in range(policy.spins):
            if flags[i] >= want:
                return
        now = time.monotonic()
        yield_until = now + policy.yield_s
        next_check = now + CHECK_S
        while flags[i] < want:
            now = time.monotonic()
            if now >= next_check:
                check()
                next_check = now + CHECK_S
            if now < yield_until:
                os.sched_yield()
                continue
            if not futex.AVAILABLE:
                time.sleep(policy.sleep_max_s)
                continue
            seen = flags[_BELL]
            flags[_ASLEEP] = 1
            _fence()  # "asleep" visible before the counter is read again
            try:
                if flags[i] < want:
                    futex.wait(self._base + _BELL * 8, seen, WaitPolicy.DOZE_S)
            finally:
                flags[_ASLEEP] = 0

    def release(self) -> None:
        self.flags.release()


class WindowMemory:
    """One rank's window mapping: signal block plus ``data`` (a uint8 tensor of the bytes).

    ``name`` is the segment's name while peers still have to attach it ("" for an
    anonymous mapping, or once unlinked).
    """

    def __init__(self, mm: mmap.mmap, size: int, nbytes: int, name: str = "") -> None:
        self.mm = mm
        self.name = name
        self.nbytes = nbytes
        self.header = header_bytes(size)
        whole = torch.frombuffer(mm, dtype=torch.uint8)
        self.data = whole[self.header : self.header + nbytes]
        self.signals = SignalBlock(mm, whole.data_ptr(), size)

    @classmethod
    def create(cls, size: int, nbytes: int, shared: bool) -> WindowMemory:
        """A fresh zeroed mapping; ``shared``: a 0600 segment that same-host peers attach."""
        total = header_bytes(size) + max(-(-nbytes // PAGE) * PAGE, PAGE)
        if not shared:
            return cls(mmap.mmap(-1, total), size, nbytes)
        name = shm_segment.new_name()
        return cls(shm_segment.create(name, total), size, nbytes, name)

    @classmethod
    def attach(cls, name: str, size: int, nbytes: int) -> WindowMemory:
        """Map a same-host peer's window segment."""
        total = header_bytes(size) + max(-(-nbytes // PAGE) * PAGE, PAGE)
        return cls(shm_segment.attach(name, total), size, nbytes)

    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        return self.data.view(dtype)

    def unlink(self) -> None:
        """Remove the segment's name (every peer has mapped it): nothing is left to sweep."""
        if self.name:
            shm_segment.unlink(self.name)
            self.name = ""

    def release(self) -> None:
        """Drop this side's references; the mapping goes with the last view of it."""
        self.unlink()
        self.signals.release()
        del self.data
