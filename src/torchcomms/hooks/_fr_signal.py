"""The flight recorder's SIGUSR1 handler: ``kill -USR1 <pid>`` dumps the process-wide recorder.

Taken when nothing else handles the signal (``faulthandler.register(SIGUSR1)`` or a native
handler is left alone); ``TORCHCOMM_FR_DUMP_ON_SIGUSR1=1`` takes it anyway, still calling a
Python-level previous handler, ``=0`` never takes it (``config.fr_dump_on_signal``).

Threads: ``install`` acts on the main thread only (Python's ``signal`` rule; elsewhere it
does nothing).  On delivery, Python's C-level handler writes the signal number to the
``signal.set_wakeup_fd`` pipe, which wakes a daemon watcher thread (``torchcomms-fr-signal``)
that calls ``dump``: within milliseconds even while the main thread is blocked inside a
collective.  The Python-level handler (main thread, between bytecodes) only chains to a
previous Python handler, except where the wakeup fd is already owned (asyncio): then no
watcher is started and that handler calls ``dump`` itself.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from torchcomms import config

_installed = False


def _handler_is_default(signum: int) -> bool:
    """Whether the OS-level disposition of ``signum`` is SIG_DFL (no handler of any kind).

    ``signal.getsignal`` cannot see handlers installed outside Python's ``signal`` module
    (``faulthandler.register``, native libraries), so ask the kernel through ``sigaction``.
    Anything unexpected counts as "not default".
    """
    if signal.getsignal(signum) not in (signal.SIG_DFL, None):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        old = ctypes.create_string_buffer(512)  # larger than any platform's struct sigaction
        if libc.sigaction(signum, None, old) != 0:
            return False
        # The first member of struct sigaction is the handler; SIG_DFL is 0.
        return not ctypes.c_void_p.from_buffer(old).value
    except Exception:
        return False


def install(dump: Callable[[], None]) -> bool:
    """Call ``dump`` on SIGUSR1 (see the module docstring); True if this call installed it.

    Installs at most once per process.
    """
    global _installed
    wanted = config.fr_dump_on_signal()
    if _installed or wanted is False:
        return False
    if threading.current_thread() is not threading.main_thread():
        return False
    if wanted is None and not _handler_is_default(signal.SIGUSR1):
        return False  # auto: leave an existing handler (e.g. faulthandler's) alone
    previous = signal.getsignal(signal.SIGUSR1)
    r, w = os.pipe()
    os.set_blocking(w, False)
    old_fd = -1
    try:
        old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except (ValueError, OSError):
        old_fd = -2
    watcher = old_fd == -1
    if not watcher:  # someone (asyncio) owns the wakeup fd: leave it, dump from the handler
        if old_fd >= 0:
            signal.set_wakeup_fd(old_fd)
        os.close(r)
        os.close(w)

    def handler(signum: int, frame: Any) -> None:
        if not watcher:
            dump()
        if callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGUSR1, handler)
    if watcher:

        def watch() -> None:
            while True:
                try:
                    data = os.read(r, 64)
                except OSError:
                    return
                if not data:
                    return
                if signal.SIGUSR1 in data:
                    dump()

        threading.Thread(target=watch, name="torchcomms-fr-signal", daemon=True).start()
    _installed = True
    return True
