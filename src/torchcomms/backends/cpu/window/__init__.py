"""One-sided windows of the CPU backend: shared memory to same-host peers, TCP to the rest.

* ``window``: ``CpuWindow``, registration and every window op;
* ``net``: ``WindowNet``, the communicator's window server and its links to other hosts.

May import ``backends.window_contract``, ``backends.cpu.ops`` and ``transport``
(``transport.window`` below all); never the shm or tcp op packages.
"""
