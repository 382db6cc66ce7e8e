"""How every data connection of the tcp transport is set up: no Nagle delay, and a bounded
life for a connection the network broke (``TORCHCOMM_TCP_USER_TIMEOUT_S``,
``TORCHCOMM_TCP_KEEPALIVE_S``).

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
