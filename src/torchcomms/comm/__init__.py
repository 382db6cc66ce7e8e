"""The communicator users hold: ``TorchComm`` and ``new_comm``.

``TorchComm`` validates arguments, takes the process-global ``op_id``, runs hooks, resolves
timeouts, owns the state machine and forwards each op to its backend; it never touches
bytes.  Modules:

* ``communicator``: ``TorchComm`` (lifecycle, ``split``, getters) and ``new_comm``;
* ``core``: ``CommCore``, the one path every op takes (checks, hooks, the sync lane, issue);
* ``ops``: ``CommOps`` (the ops, from ``optable.methods``) and ``BatchSendRecv``;
* ``persistent``: the persistent all-gather;
* ``window``: ``TorchCommWindow``, one-sided windows validated once above a backend;
* ``validation``: the argument checker every op uses (the reference's error texts);
* ``allocator``: ``get_mem_allocator``.

Layering: imports ``runtime``, ``optable``, ``backends`` and the vocabulary at the top
(``types``, ``errors``, ``config``, ``registry``); nothing in ``backends`` or ``transport``
imports this package.
"""

from torchcomms.comm.communicator import (
    FINALIZE_OP_ID,
    BatchSendRecv,
    RemovableHandle,
    TorchComm,
    add_default_observer,
    new_comm,
)

__all__ = [
    "FINALIZE_OP_ID",
    "BatchSendRecv",
    "RemovableHandle",
    "TorchComm",
    "add_default_observer",
    "new_comm",
]
