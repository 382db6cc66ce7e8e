"""Backends: what ``TorchComm`` calls to move bytes, one object per communicator.

* ``contract``: ``CommBackend``, the one typed interface ``TorchComm`` calls;
* ``base``: ``TorchCommBackend``, upstream's base class that plug-ins subclass;
* ``plugin``: a plug-in written to upstream's calling convention, wrapped as a ``CommBackend``;
* ``window_contract``: what ``TorchCommWindow`` asks of a backend's windows;
* ``fake``: a size-1 backend whose ops do nothing, for tests of the API layer;
* ``cpu/``: the CPU backend, registered as ``gloo``.

May import the core modules (``errors``, ``types``, ``work``, ``state``, ``deadline``,
``config``, ``ranks``, ...) and ``transport``; never ``comm``, ``hooks``, the bridge or
the tools (``tests/test_layout.py``).
"""
