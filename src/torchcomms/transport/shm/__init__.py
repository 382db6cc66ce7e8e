"""Shared memory between the processes of one host.

* ``segment``: segment files (create 0600, attach, unlink, sweep stale ones);
* ``layout``: where flags and slots sit in a communicator's segment;
* ``channel``: a communicator's sequence flags, rounds and waits;
* ``p2p``: point-to-point, a two-slot ring per ordered pair;
* ``futex``: Linux futex wait/wake on shared memory (the doorbell).

Never imports ``transport.tcp`` or ``transport.gloo``.
"""
