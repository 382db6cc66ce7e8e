"""``probe``: is a remote member's process alive?  Asked of its liveness listener.

A connection that ends without a goodbye usually means the peer's process is gone, but
not always: a process that closed or lost its connections while it lives (a cut socket,
a confused peer) ends them the same way, and a rank whose own connections were all cut
believes everyone it lost is dead.  So before a remote member is declared dead, on the
failure path only, ``probe`` connects to its liveness listener (``cpu.tcp.liveness``) and
says ``PING``:

* refused, reset or closed: nothing listens there any more, the process is gone (a
  firewall that rejects the port reads the same: the ring's own connections prove it was
  reachable when the communicator was built);
* ``PONG``, or the connection held open in silence (a stopped or busy process: its
  kernel still holds the listener): alive;
* no connection at all (a cut link, an unreachable host): unknown.

A dying process may close its connections a moment before its listener, so an accepted
connection counts only once it has not been reset within ``timeout_s``.  Runs on
whichever thread asks (the liveness watcher, or an op thread in ``cpu.tcp.waits``); bounded
by about twice ``timeout_s``.
"""

from __future__ import annotations

import socket

#: How long a probe waits to connect, and then for an answer.
PROBE_S = 0.25


def probe(address: tuple[str, int], timeout_s: float = PROBE_S) -> bool | None:
    """True: alive; False: gone; None: unreachable (see the module docstring)."""
    try:
        sock = socket.create_connection(address, timeout=timeout_s)
    except ConnectionRefusedError:
        return False
    except OSError:
        return None
    with sock:
        try:
            sock.sendall(b"PING\n")
            data = sock.recv(64)
        except TimeoutError:
            return True  # held open, silent: stopped or busy, but there
        except OSError:
            return False  # reset
        return bool(data)  # b"": the listener's process closed it
