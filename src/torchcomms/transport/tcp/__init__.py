"""Direct TCP connections, driven on the op's own thread (no gloo thread hand-offs).

* ``lane``: small all_gathers over direct connections;
* ``posted``: two ranks: the peer's frames still owed for ops this rank only sent;
* ``meet``: connecting a lane, each rank told only its successor's address;
* ``ring``: large collectives over the lane's round-0 connections;
* ``p2p``: point-to-point messages, connections dialled on first use;
* ``wire``: ``p2p``'s frame format and per-connection records.

Never imports ``transport.shm`` or ``transport.gloo``.
"""
