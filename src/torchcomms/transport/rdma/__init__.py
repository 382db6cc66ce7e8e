"""The one-sided point-to-point transport behind ``torchcomms._transport`` (upstream's
``RdmaTransport``), on CPU: no RDMA hardware, the same names and semantics.

* ``registry``: this process's registered memory and the table peers check an access in;
* ``memory``: ``RdmaMemory``, its views, ``RdmaRemoteBuffer``;
* ``cma``: same-host copies by cross-memory attach (``process_vm_readv``/``writev``);
* ``tcp``: the serving thread of a transport and its clients (other hosts);
* ``transport``: ``RdmaTransport`` (bind, connect, read, write).

May import ``transport.shm`` (segment names and sweeping) and ``torchcomms.errors`` (it
raises the typed errors itself: nothing sits between it and the user).
"""
