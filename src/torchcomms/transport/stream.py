"""``recv_exact``: fill a buffer from a stream socket, as every TCP server and client here does."""

from __future__ import annotations

import socket


def recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``sock`` (blocking, with the socket's timeout); False on EOF."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True
