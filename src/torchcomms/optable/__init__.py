"""The op table: every communicator op declared once, everything per-op derived from it.

An op is one method of ``OpMethods``: its typed signature and the code ``TorchComm`` runs
for it (``TorchComm`` inherits the method), under an ``@op(...)`` that states what the signature cannot:
each argument's kind (read, written, a list, a rank, a reduce op, split sizes), which
arguments are the op's input and output sides and how the flight recorder shows them,
the pre-hook arguments' order, whether sizes differ per rank by design, whether the op has
a sync fast path (the lane); beside it, the function that validates its arguments
(``checks.check_<op>``, upstream's error texts).  ``OPS`` lists the ops in declaration order.

Derived from it, elsewhere: the backend contract and the CPU, fake and plug-in backends' cold
ops (``backends.contract.fill_ops``), the compile layer's custom ops and autograd
(``functional.table``), what observers read off an op (``opinfo``: shapes, inputs and
outputs, key tensor), clog's signature, the collective check's fingerprint and the flight
recorder tool's rank-dependent ops.  Adding an op is one method here (``methods``), its
check (``checks``), its hook arguments (``hook_args``) and a member of ``OpName``
(``spec``), then its algorithm in the CPU backend's ops objects (``CpuOps``).

Modules: ``spec`` (names, kinds, the ``Op`` entry, ``@op``), ``checks``, ``methods`` (the
ops), ``hook_args`` (the typed pre- and post-hook arguments, upstream's names).  At run time
the package imports nothing else from ``torchcomms``; the methods reach ``CommCore`` through
``self`` and the types in their signatures are annotations only.
"""

from torchcomms.optable.methods import OpMethods
from torchcomms.optable.spec import *  # noqa: F403  (the vocabulary: names, kinds, the entries)
from torchcomms.optable.spec import __all__ as _vocabulary

__all__ = ["OpMethods", *_vocabulary]
