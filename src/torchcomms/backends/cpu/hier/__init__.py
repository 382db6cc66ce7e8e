"""The CPU backend's host hierarchy: who sits on which host, and the ops that use it.

* ``ops``: ``HierOps``, shm inside each host and tcp between: the one ops class that
  delegates to both transports (it may import ``cpu.shm`` and ``cpu.tcp``);
* ``leaders``: meeting through host leaders: identities and the rendezvous, O(hosts) for
  rank 0;
* ``members``: who the members are: the O(1) bundle (placement, rank 0's pid).

``leaders`` and ``members`` serve every transport (``cpu.backend``, ``cpu.select`` and
``cpu.connect`` import them) and import none of the CPU backend's sub-packages; they may
import the core modules, ``transport`` and the CPU backend's top level
(``tests/test_layout.py``).  Importing this package imports none of its modules.
"""
