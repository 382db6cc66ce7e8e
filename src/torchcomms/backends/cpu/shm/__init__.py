"""The CPU backend over shared memory (every member on this host).

* ``ops``: ``ShmOps``, every op of the backend, and opening the communicator's segment;
* ``collectives``: multi-round collective algorithms over a ``ShmChannel``;
* ``oneshot``: one-round collectives, the small-message latency path;
* ``single_copy``: large all_gather and all_to_all by cross-memory attach (one copy per byte).

May import ``backends.cpu``'s shared modules and ``transport`` (``transport.shm`` below all);
never ``backends.cpu.tcp``.
"""
