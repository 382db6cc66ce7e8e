"""torchcomms in pure Python: explicit communicator objects for PyTorch.

Import-time rule: ``_comms``, ``hooks`` and what they import use only ``torch``,
``torch._C._distributed_c10d`` and the standard library, because PyTorch imports them while
``torch.distributed`` is half-initialised.  This ``__init__`` binds them first and imports
``torch.distributed`` itself right after, so import order never matters (``_import_guard``).
"""

from __future__ import annotations

import importlib

from torchcomms import _import_guard

try:
    # The three names torch.distributed looks up in us at its import come first, so its look
    # succeeds whichever of the two the user imported first ...
    from torchcomms import hooks
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
        _BackendWrapper,
        built_backends,
        is_backend_built,
        new_comm,
        register_backend,
    )

    # ... then torch.distributed itself, before anything below can import it half-way.
    importlib.import_module("torch.distributed")
    from torchcomms import functional, objcol
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
except ImportError as exc:
    if not _import_guard.torch_is_looking():
        raise
    _import_guard.stand_in(globals(), exc)
else:
    # With TORCHCOMMS_PATCH_FOR_COMPILE=1 this makes new communicators traceable by
    # torch.compile; unset, it only defines the version helpers (torchcomms.functional).
    functional._install_if_enabled()
    _import_guard.redo_torch_look(new_comm, _BackendWrapper, hooks.FlightRecorderHook)


def __getattr__(name: str) -> object:
    """``torchcomms.distwrap`` on first use: it imports torch.distributed, so never at import."""
    if _import_guard.failure is not None:
        raise ImportError(_import_guard.failure)
    if name == "distwrap":
        # not ``from torchcomms import``: that would ask this hook again
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
