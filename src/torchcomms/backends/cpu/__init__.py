"""The CPU backend, registered as ``gloo``: one transport per communicator, chosen at connect.

Top level (what every transport shares):

* ``backend``: ``TorchCommGloo``, the ``CommBackend``: store, identities, executor, errors;
* ``bootstrap``: rank/size discovery, stores, host identity (also read by ``bench`` and
  ``utils``);
* ``dispatch``: every op as one call on the connected ``CpuOps``;
* ``ops``: ``CpuOps``, what one transport implements;
* ``select``: which transport a communicator uses, and connecting it;
* ``connect``: connect-time waits that name who is missing;
* ``errors``: a transport error as a typed error naming comm, op and peers;
* ``staging``, ``host_arrays``, ``reductions``: dtypes and host staging, numpy views of
  small payloads, reductions of rows of contributions.

Sub-packages, one per transport or capability: ``shm/`` (every member on this host), ``tcp/``
(direct sockets, gloo for the rest), ``hier/`` (the host hierarchy: ``HierOps``, shm inside
each host and tcp between, the one ops class that delegates to both transports; meeting
through host leaders; who the members are), ``window/`` (one-sided windows), ``recovery/``
(reconfigure, the survivors' agreement).  ``shm`` and ``tcp`` never import each other;
``window`` and ``recovery`` import neither; only ``backend``, ``select`` and
``hier.ops`` reach into several (``tests/test_layout.py``).
"""
