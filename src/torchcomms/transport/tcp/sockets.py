"""How every data connection of the tcp transport is set up: no Nagle delay, and a bounded
life for a connection the network broke (``TORCHCOMM_TCP_USER_TIMEOUT_S``,
``TORCHCOMM_TCP_KEEPALIVE_S``); and ``LowWater``, how a reader of a large block asks to be
woken once per piece rather than per segment.

Why: a connection can fail while both processes live.  When one side's kernel gives up on
it (its packets were dropped for longer than it retries), that side's next send or poll
errs, but the other side's end stays open and, with nothing to send, waits forever.  The
user timeout bounds how long sent bytes may stay unacknowledged; keepalive probes an idle
connection, so an end whose peer vanished is reset (the peer's host answers) or given up
(after the user timeout, when nothing answers).  Either way the waiting side's ``poll``
reports the error and the op names the peer.
"""

from __future__ import annotations

import socket

from torchcomms import config

_KEEPALIVE_PROBES = 3


def data_socket(sock: socket.socket) -> socket.socket:
    """Apply the transport's options to a connected data socket; return it."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    user_timeout = config.tcp_user_timeout_s()
    if user_timeout > 0 and hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(user_timeout * 1000))
    idle = config.tcp_keepalive_s()
    if idle > 0 and hasattr(socket, "TCP_KEEPIDLE"):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, max(1, round(idle)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, round(idle / 5)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, _KEEPALIVE_PROBES)
    return sock


#: A ring step that only streams into a tensor asks to be woken once this many of the
#: block's bytes, or all that are left if fewer, are queued (``SO_RCVLOWAT``); 0 turns it
#: off.  Why: the sender's kernel wakes a waiting reader for every segment that lands,
#: and each wake-up costs both sides CPU.  A broadcast's receiver, which lags its root
#: (the root runs ahead), read a 4 MiB block in ~30 pieces, ~10 with the mark (counted
#: under strace); with the mark a two-rank broadcast of 4-64 MiB took 1.8-2.2x less time
#: over loopback, 1.2-1.8x with both cores busy and 1.1-1.4x between simulated hosts, its
#: receiver half the CPU, in alternating blocks of the same processes
#: (``benchmarks/diagnostics/tcp_low_water.py``; ``benchmarks/results/issue53/NOTES.md``,
#: step 15).  Not used for send/recv: a ping-pong waits for the whole message, and a mark
#: delays the copy of its last piece (it took 1.0-1.5x the time at 1-64 MiB).  The kernel caps the mark at half its largest receive buffer,
#: and wakes the reader anyway when that buffer is nearly full or the connection ends, so
#: a mark above what can arrive never stalls a wait.
LOW_WATER_BYTES = 4 << 20

#: Blocks with less than this left keep the default mark (a byte): one wake-up is all
#: they cost anyway.
LOW_WATER_FROM = 256 << 10


class LowWater:
    """A socket's receive low-water mark, set only when it changes.  Used by the op's
    thread that reads the socket; ``clear`` before anything else waits on it."""

    __slots__ = ("_sock", "mark")

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.mark = 1

    def wait_for(self, left: int) -> None:
        """``poll`` reports the socket readable once ``min(left, LOW_WATER_BYTES)`` bytes
        are queued (for blocks of ``LOW_WATER_FROM`` or more)."""
        self._set(min(left, LOW_WATER_BYTES) if left >= LOW_WATER_FROM else 1)

    def clear(self) -> None:
        """Back to the default: readable at the first byte."""
        if self.mark != 1:
            self._set(1)

    def _set(self, mark: int) -> None:
        if mark < 1:
            mark = 1
        if mark == self.mark:
            return
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, mark)
        except OSError:  # closed, or a platform without it: the default mark stays
            mark = 1
        self.mark = mark
