"""The one-sided transport's same-host path: cross-memory attach (``transport.cma``) to a peer.

No shared mapping of the user's tensor is needed (any tensor can be registered), no socket is
on the data path and the peer's code takes no part.  ``CmaPeer.probe`` finds out at connect
whether the kernel permits it; the transport falls back to TCP where it is refused
(``docs/one-sided.md``).

Every access checks the owner's table slot under a shared lock (``registry``), so a wrong or
stale key is refused and deregistration waits for the copy.  The peer's liveness comes from a
pidfd: a copy from a peer that is gone raises ``PeerFailureError``, also when the copy itself
succeeded after its pid was reused.  Large copies (and many tensors at once) are split into
pieces shared out to up to ``_MAX_THREADS`` threads (the calls release the GIL), which is what
reaches the machine's copy bandwidth.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import select
import threading
import time
from collections.abc import Sequence

from torchcomms.errors import CommTimeoutError, PeerFailureError, RemoteAccessError
from torchcomms.transport import cma
from torchcomms.transport.procs import process_alive
from torchcomms.transport.rdma.registry import SLOT_BYTES, check_slot, parse_key, range_lock

#: A copy at least this large is shared out to several threads.
PARALLEL_MIN_BYTES = 8 << 20
#: The unit of that sharing: a piece is locked, checked and copied on its own.
_PIECE_BYTES = 4 << 20
_MAX_THREADS = 4


def _threads() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, _MAX_THREADS))


class CmaPeer:
    """A peer process of this host, reached by cross-memory attach (``probe`` first)."""

    def __init__(self, pid: int, table_path: str, instance: str, owner: str) -> None:
        self.pid, self.instance, self.owner = pid, instance, owner
        self.table_path = table_path
        self._pidfd = -1
        self._fds: list[int] = []
        self._fds_lock = threading.Lock()
        self.closed = False

    def probe(self, addr: int, expect: bytes) -> str | None:
        """Open the peer's table and pidfd and read ``expect``'s bytes at ``addr`` in the peer;
        ``None`` when that works, else why not (then the caller takes TCP)."""
        if not cma.available():
            return "process_vm_readv is not available"
        try:
            self._pidfd = os.pidfd_open(self.pid) if hasattr(os, "pidfd_open") else -1
        except OSError as exc:
            return f"pidfd_open({self.pid}): {exc}"
        try:
            os.close(self._fd_take())  # the table opens (same /dev/shm)
        except OSError as exc:
            return f"the peer's registration table is not reachable: {exc}"
        got = ctypes.create_string_buffer(len(expect))
        _, err = cma.copy(False, self.pid, ctypes.addressof(got), addr, len(expect))
        if err:
            return f"process_vm_readv refused: {os.strerror(err)}"
        if got.raw != expect:
            return "the pid names another process (another pid namespace)"
        return None

    def _fd_take(self) -> int:
        with self._fds_lock:
            if self._fds:
                return self._fds.pop()
        return os.open(self.table_path, os.O_RDWR)

    def _fd_give(self, fd: int) -> None:
        with self._fds_lock:
            if not self.closed:
                self._fds.append(fd)
                return
        os.close(fd)

    def alive(self) -> bool:
        if self._pidfd >= 0:
            return not select.select([self._pidfd], [], [], 0)[0]
        return process_alive(self.pid)

    def dead_error(self, what: str) -> PeerFailureError:
        return PeerFailureError(f"{what}: the peer process {self.owner} is gone")

    def copy_many(
        self, write: bool, items: Sequence[tuple[int, str, int, int]], deadline: float
    ) -> None:
        """Move each ``(local, key, remote, nbytes)`` between ``local`` (this process) and
        ``remote`` (the peer's memory of ``key``): into the peer when ``write``, out of it
        otherwise.  Pieces of at most ``_PIECE_BYTES`` are shared out to up to ``_threads()``
        threads once the total is ``PARALLEL_MIN_BYTES``."""
        total = sum(item[3] for item in items)
        what = f"RdmaTransport.{'write' if write else 'read'} of {total} bytes"
        pieces: list[tuple[int, str, int, int, int, int]] = []
        for local, key, remote, nbytes in items:
            instance, slot, token = parse_key(key)
            if instance != self.instance:
                raise RemoteAccessError(
                    f"{what}: access key {key!r} is not of the connected peer {self.owner} "
                    "(a buffer of another process)"
                )
            for off in range(0, max(nbytes, 1), _PIECE_BYTES):
                n = min(_PIECE_BYTES, nbytes - off)
                pieces.append((local + off, key, slot, token, remote + off, n))
        workers = min(_threads(), len(pieces)) if total >= PARALLEL_MIN_BYTES else 1
        errors: list[BaseException] = []
        next_piece = iter(pieces)
        take = threading.Lock()

        def run() -> None:
            try:
                while not errors:
                    with take:
                        piece = next(next_piece, None)
                    if piece is None:
                        return
                    self._copy_part(write, *piece, deadline, what)
            except BaseException as exc:  # re-raised on the calling thread below
                errors.append(exc)

        threads = [
            threading.Thread(target=run, name="torchcomms-rdma-cma") for _ in range(workers - 1)
        ]
        for t in threads:
            t.start()
        run()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        if not self.alive():
            raise self.dead_error(what)

    def _copy_part(
        self,
        write: bool,
        local: int,
        key: str,
        slot: int,
        token: int,
        remote: int,
        nbytes: int,
        deadline: float,
        what: str,
    ) -> None:
        try:
            fd = self._fd_take()
        except OSError as exc:
            if not self.alive():
                raise self.dead_error(what) from None
            raise RemoteAccessError(f"{what}: the table of {self.owner} is gone: {exc}") from None
        try:
            while not range_lock(fd, slot, fcntl.F_RDLCK):
                # Held only while the owner frees this slot (a moment), unless it stopped.
                if time.monotonic() >= deadline:
                    raise CommTimeoutError(f"{what}: the owner {self.owner} holds key {key!r}")
                time.sleep(0.0002)
            try:
                raw = os.pread(fd, SLOT_BYTES, slot * SLOT_BYTES)
                try:
                    check_slot(raw, key, slot, token, remote, nbytes, self.owner)
                except RemoteAccessError as exc:
                    raise RemoteAccessError(f"{what}: {exc}") from None
                self._syscalls(write, local, remote, nbytes, what)
            finally:
                range_lock(fd, slot, fcntl.F_UNLCK)
        finally:
            self._fd_give(fd)

    def _syscalls(self, write: bool, local: int, remote: int, nbytes: int, what: str) -> None:
        done, err = cma.copy(write, self.pid, local, remote, nbytes)
        if err:
            if err == errno.ESRCH or not self.alive():
                raise self.dead_error(what)
            raise RemoteAccessError(
                f"{what}: process_vm_{'writev' if write else 'readv'} failed after "
                f"{done} bytes: {os.strerror(err)}"
            )

    def close(self) -> None:
        with self._fds_lock:
            self.closed = True
            fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
