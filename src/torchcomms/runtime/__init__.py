"""What an op's life shares above and below the backend interface.

``TorchComm`` and every backend use these; none of them imports ``comm``, ``backends`` or
``transport``:

* ``work``: ``TorchWork``, the handle every op returns, and how errors reach ``wait()``;
* ``executor``: issue-order execution of a communicator's async ops (one thread per comm);
* ``state``: the communicator's state machine, shared by ``TorchComm`` and its backend;
* ``deadline``: ``Deadline``, the one form of "how long may this op still wait";
* ``fingerprint``: what every rank must agree on before data is combined;
* ``oprecord`` / ``opinfo``: one issued op as observers (hooks, flight recorder, tools) see it;
* ``store_counts``: counting store requests (``TORCHCOMM_STORE_COUNTS=1``).
"""
