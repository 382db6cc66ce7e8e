"""Cross-memory attach: a single copy between this process and another of this host.

``process_vm_readv`` / ``process_vm_writev`` copy straight between two address spaces; the
kernel walks the other process's pages, so neither side needs a shared mapping and the other
side's code takes no part.  The kernel allows it where this process may ptrace the other
(same user and Yama's ``ptrace_scope`` 0, or root); ``copy`` reports a refusal as its errno.

Used by the one-sided transport (``transport.rdma``) and by the shared-memory collectives for
large all_gather, all_to_all, broadcast and two-rank reductions (``backends.cpu.shm``).  The
calls release the GIL.
"""

from __future__ import annotations

import ctypes
import errno
from collections.abc import Callable

#: The most bytes one system call moves (the kernel caps a call near 2 GiB).
_CALL_MAX_BYTES = 1 << 30


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc_call(name: str) -> Callable[..., int] | None:
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    return fn


_READV = _libc_call("process_vm_readv")
_WRITEV = _libc_call("process_vm_writev")


def available() -> bool:
    """Whether this libc has the calls (Linux 3.2+); the kernel may still refuse them."""
    return _READV is not None and _WRITEV is not None


def copy(write: bool, pid: int, local: int, remote: int, nbytes: int) -> tuple[int, int]:
    """Move ``nbytes`` between ``local`` (this process) and ``remote`` (process ``pid``): into
    it when ``write``, out of it otherwise.  Returns ``(bytes moved, errno)``; errno is 0 when
    every byte moved (``ESRCH``: the process is gone; ``EPERM``: not permitted)."""
    call = _WRITEV if write else _READV
    if call is None:
        return 0, errno.ENOSYS
    done = 0
    while done < nbytes:
        n = min(nbytes - done, _CALL_MAX_BYTES)
        liov = _Iovec(local + done, n)
        riov = _Iovec(remote + done, n)
        got = call(pid, ctypes.byref(liov), 1, ctypes.byref(riov), 1, 0)
        if got <= 0:
            return done, ctypes.get_errno() or errno.EIO
        done += got
    return done, 0
