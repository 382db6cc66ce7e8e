"""Window memory and its network server, below ``backends.cpu.window``.

* ``memory``: a rank's window memory (a 0600 ``/dev/shm`` segment or an anonymous mapping)
  and its signal block;
* ``tcp``: the server that answers puts, gets and signals from other hosts, and its links.

May import ``transport.shm`` (segments, futex); never ``transport.tcp`` or ``transport.gloo``.
"""
