"""The bridge's helpers: what ``_backend_wrapper`` (c10d's ``ProcessGroup`` over a ``TorchComm``) uses.

* ``args``: c10d's calling conventions (options objects, op lists) into ``TorchComm`` calls;
* ``work``: the c10d ``Work`` returned for a ``TorchWork``;
* ``shrink``: ``dist.shrink_group``, a c10d gloo backend over the survivors;
* ``monitored_barrier``: c10d's monitored barrier, naming the ranks that never arrived;
* ``dispatch``: c10d calls shown to PyTorch's dispatch modes (``CommDebugMode``) while one is
  active.

Imported while ``torch.distributed`` is half-initialised: at module level these import only
``torch``, ``torch._C._distributed_c10d``, the standard library and ``torchcomms`` modules
that obey the same rule (``shrink`` imports ``torch.distributed`` inside its function).  May
import ``comm`` and below; nothing below ``TorchComm`` imports this package.
"""
