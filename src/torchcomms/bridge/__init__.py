"""The ``torch.distributed`` bridge's parts: c10d's ``ProcessGroup`` on a ``TorchComm``.

PyTorch imports ``torchcomms._backend_wrapper._BackendWrapper`` (the process group) and
``torchcomms._comms`` by those paths, so they stay at the top; this package holds the rest:

* ``import_guard``: PyTorch's one look for torchcomms, redone when it ran too early;
* ``c10d_caller``: what c10d gave a group (explicit ranks, timeout, reconfigure mode), read
  from c10d's creating frame (the one module here that code below ``TorchComm`` reads);
* ``args``: c10d's calling conventions (options objects, op lists) into ``TorchComm`` calls;
* ``c10d_work``: the c10d ``Work`` returned for one or more ``TorchWork``;
* ``shrink``: ``dist.shrink_group``;
* ``monitored_barrier``: c10d's monitored barrier, naming the ranks that never arrived;
* ``dispatch``: c10d calls shown to dispatch modes (``CommDebugMode``) while one is active.

Imported while ``torch.distributed`` is half-initialised: at module level these import only
``torch``, ``torch._C._distributed_c10d``, the standard library and ``torchcomms`` modules
that obey the same rule.  May import ``comm`` and below; only ``c10d_caller`` is imported
from below ``TorchComm``.
"""
