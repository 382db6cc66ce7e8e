"""The CPU backend over TCP: direct sockets for collectives and point-to-point, gloo for the rest.

* ``ops``: ``TcpOps``, every op over TCP;
* ``exchange``: the header every collective starts with (mismatch check), small ops' payload;
* ``ring_ops``: large collectives on the lane's ring;
* ``waits``: ``TcpWaiter``, every wait (gloo works, the lane, p2p) with a deadline and a name;
* ``mismatch``: the whole picture of a mismatch one rank saw only in part;
* ``liveness``: who is gone and who never entered a timed-out op (also used by ``hier.ops``);
* ``probe``: asks a remote member's liveness listener whether it lives.

May import ``backends.cpu``'s shared modules and ``transport`` (``transport.tcp``,
``transport.gloo``); never ``backends.cpu.shm``.
"""
