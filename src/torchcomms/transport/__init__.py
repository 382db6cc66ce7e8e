"""Transports below the CPU backend: how bytes move between the members of one communicator.

Top level (shared by every transport): ``errors`` (``WaitError``, its ranks kept as data),
``procs`` (``process_alive``), ``wait_policy`` (how a rank
waits, from how many ranks share the cores), ``placement`` (opt-in core pinning), ``listen``
(where a server listens).

Sub-packages: ``shm/`` (segments, channel, pair rings, futex), ``tcp/`` (lane, ring,
point-to-point engine, wire format), ``gloo/`` (``ProcessGroupGloo`` construction and its
rendezvous), ``window/`` (window memory, shared memory; the TCP window server).

Never imports ``backends`` or anything above it; may import the leaf core modules
(``config``, ``deadline``, ``fingerprint``, ``ranks``, ``types``).  ``shm``, ``tcp`` and
``gloo`` never import each other; ``window`` builds on ``shm`` (``tests/test_layout.py``).
"""
