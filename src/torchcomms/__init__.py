"""torchcomms in pure Python: explicit communicator objects for PyTorch.

Import-time rule: this package (and ``_comms``, ``hooks``) imports only ``torch``,
``torch._C._distributed_c10d`` and the standard library, because PyTorch imports
it while ``torch.distributed`` is half-initialised.
"""

from __future__ import annotations

# Last: with TORCHCOMMS_PATCH_FOR_COMPILE=1 this makes new communicators traceable by
# torch.compile; unset, it only defines the version helpers (torchcomms.functional).
from torchcomms import (
    functional,
    hooks,
    objcol,
)
from torchcomms._comms import (
    BatchP2POptions,
    BatchSendRecv,
    CommOptions,
    OpName,
    P2POp,
    P2POpType,
    RedOpType,
    ReduceOp,
    RemovableHandle,
    Timeout,
    TorchComm,
    TorchCommBackend,
    TorchCommWinAccessType,
    TorchCommWindow,
    TorchCommWindowAttr,
    TorchWork,
    WorkStatus,
    built_backends,
    is_backend_built,
    new_comm,
    register_backend,
)
from torchcomms._comms import (
    _is_backend_registered as _is_backend_registered,  # upstream has them; not in __all__
)
from torchcomms._comms import (
    _load_backend as _load_backend,
)
from torchcomms.errors import (
    BackendNotImplementedError,
    CollectiveMismatchError,
    CommAbortedError,
    CommError,
    CommRevokedError,
    CommStateError,
    CommTimeoutError,
    CommValidationError,
    PeerFailureError,
)
from torchcomms.types import AbortInfo, AbortReason

functional._install_if_enabled()


def __getattr__(name: str) -> object:
    """``torchcomms.distwrap`` on first use: it imports torch.distributed, so never at import."""
    if name == "distwrap":
        import importlib  # not ``from torchcomms import``: that would ask this hook again

        return importlib.import_module("torchcomms.distwrap")
    raise AttributeError(f"module 'torchcomms' has no attribute {name!r}")

__version__ = "0.1.0"

__all__ = [
    "AbortInfo",
    "AbortReason",
    "BackendNotImplementedError",
    "BatchP2POptions",
    "BatchSendRecv",
    "CollectiveMismatchError",
    "CommAbortedError",
    "CommError",
    "CommOptions",
    "CommRevokedError",
    "CommStateError",
    "CommTimeoutError",
    "CommValidationError",
    "OpName",
    "P2POp",
    "P2POpType",
    "PeerFailureError",
    "RedOpType",
    "ReduceOp",
    "RemovableHandle",
    "Timeout",
    "TorchComm",
    "TorchCommBackend",
    "TorchCommWinAccessType",
    "TorchCommWindow",
    "TorchCommWindowAttr",
    "TorchWork",
    "WorkStatus",
    "built_backends",
    "functional",
    "hooks",
    "is_backend_built",
    "new_comm",
    "objcol",
    "register_backend",
]
