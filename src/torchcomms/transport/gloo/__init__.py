"""Where gloo itself runs: torch's ``ProcessGroupGloo``.

* ``process_group``: building process groups, network device choice, reduce-op mapping;
* ``rendezvous``: gloo's eager full-mesh rendezvous in O(1) store round trips per rank.

Never imports ``transport.shm`` or ``transport.tcp``.
"""
