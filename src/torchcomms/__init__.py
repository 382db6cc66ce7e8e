"""torchcomms in pure Python: explicit communicator objects for PyTorch.

Import-time rule: ``_comms``, ``hooks`` and what they import use only ``torch``,
``torch._C._distributed_c10d`` and the standard library, because PyTorch imports them while
``torch.distributed`` is half-initialised.

PyTorch looks for us once, at its own import of ``torch.distributed`` (which ``import torch``
itself performs on 2.14+), and switches its ``TORCH_DISTRIBUTED_USE_TORCHCOMMS`` bridge off for
good if a name is missing.  When the user imports ``torchcomms`` first, that look runs in the
middle of this ``__init__``: the names PyTorch takes from the package itself are therefore
served by ``__getattr__`` (defined before anything imports torch) until the imports below bind
them, and the submodules it takes names from import whole on their own.  So import order never
matters (``bridge.import_guard`` covers a broken install and a late ``sys.path``).
"""

from __future__ import annotations

import importlib

from torchcomms.bridge import import_guard as _import_guard

#: The names ``distributed_c10d`` imports from this package itself (``from torchcomms import
#: ...``), with the module that defines each: what ``__getattr__`` serves while this ``__init__``
#: is still running.  Checked against each release's own import block (test_import_order).
_TORCH_LOOKS_UP_HERE = {"new_comm": "torchcomms.comm", "is_backend_built": "torchcomms.registry"}


def __getattr__(name: str) -> object:
    """PyTorch's look mid-import (above), and ``torchcomms.distwrap`` on first use (it imports
    torch.distributed, so never at import)."""
    if _import_guard.failure is not None:
        raise ImportError(_import_guard.failure)
    if name in _TORCH_LOOKS_UP_HERE:
        return getattr(importlib.import_module(_TORCH_LOOKS_UP_HERE[name]), name)
    if name == "distwrap":
        # not ``from torchcomms import``: that would ask this hook again
        return importlib.import_module("torchcomms.distwrap")
    raise AttributeError(f"module 'torchcomms' has no attribute {name!r}")


try:
    # torch first: on 2.14+ this is where PyTorch looks for us (served by __getattr__ above)
    # when the user imported torchcomms first; then what PyTorch looks up, ...
    import torch  # noqa: F401

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
        built_backends,
        is_backend_built,
        new_comm,
        register_backend,
    )

    # ... then torch.distributed itself, before anything below can import it half-way.
    importlib.import_module("torch.distributed")
    from torchcomms import functional, objcol
    from torchcomms._comms import (  # upstream re-exports every public name of _comms
        AllGatherOptions,
        AllGatherPExecOptions,
        AllGatherPHandle,
        AllGatherPInitOptions,
        AllGatherPostHookArgs,
        AllGatherPreHookArgs,
        AllGatherSingleOptions,
        AllGatherSinglePostHookArgs,
        AllGatherSinglePreHookArgs,
        AllGatherVPostHookArgs,
        AllGatherVPreHookArgs,
        AllReduceOptions,
        AllReducePostHookArgs,
        AllReducePreHookArgs,
        AllToAllOptions,
        AllToAllPostHookArgs,
        AllToAllPreHookArgs,
        AllToAllSingleOptions,
        AllToAllSinglePostHookArgs,
        AllToAllSinglePreHookArgs,
        AllToAllvSingleOptions,
        AllToAllVSinglePostHookArgs,
        AllToAllVSinglePreHookArgs,
        BarrierOptions,
        BarrierPostHookArgs,
        BarrierPreHookArgs,
        BatchOpIssuePostHookArgs,
        BatchOpIssuePreHookArgs,
        BroadcastOptions,
        BroadcastPostHookArgs,
        BroadcastPreHookArgs,
        CollectivePostHookArgs,
        FinalizePostHookArgs,
        FinalizePreHookArgs,
        GatherOptions,
        GatherPostHookArgs,
        GatherPreHookArgs,
        GatherSinglePostHookArgs,
        GatherSinglePreHookArgs,
        InitHandle,
        NewWindowPostHookArgs,
        NewWindowPreHookArgs,
        PostHookArgs,
        PreHookArgs,
        ReconfigureOptions,
        RecvOptions,
        RecvPostHookArgs,
        RecvPreHookArgs,
        ReduceOptions,
        ReducePostHookArgs,
        ReducePreHookArgs,
        ReduceScatterOptions,
        ReduceScatterPostHookArgs,
        ReduceScatterPreHookArgs,
        ReduceScatterSingleOptions,
        ReduceScatterSinglePostHookArgs,
        ReduceScatterSinglePreHookArgs,
        ReduceScatterVPostHookArgs,
        ReduceScatterVPreHookArgs,
        ScatterOptions,
        ScatterPostHookArgs,
        ScatterPreHookArgs,
        SendOptions,
        SendPostHookArgs,
        SendPreHookArgs,
        SplitPostHookArgs,
        SplitPreHookArgs,
        WorkWrapper,
        get_mem_allocator,
    )
    from torchcomms._comms import (
        _BackendWrapper as _BackendWrapper,  # PyTorch 2.13-2.15 take it from _comms
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
    from torchcomms.functional import (  # upstream's __init__ has them too; not in __all__
        is_torch_compile_supported as is_torch_compile_supported,
    )
    from torchcomms.functional import (
        is_torch_compile_supported_and_enabled as is_torch_compile_supported_and_enabled,
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
    _import_guard.redo_torch_look()


__version__ = "0.1.0"

__all__ = [
    "AbortInfo",
    "AbortReason",
    "AllGatherOptions",
    "AllGatherPExecOptions",
    "AllGatherPHandle",
    "AllGatherPInitOptions",
    "AllGatherPostHookArgs",
    "AllGatherPreHookArgs",
    "AllGatherSingleOptions",
    "AllGatherSinglePostHookArgs",
    "AllGatherSinglePreHookArgs",
    "AllGatherVPostHookArgs",
    "AllGatherVPreHookArgs",
    "AllReduceOptions",
    "AllReducePostHookArgs",
    "AllReducePreHookArgs",
    "AllToAllOptions",
    "AllToAllPostHookArgs",
    "AllToAllPreHookArgs",
    "AllToAllSingleOptions",
    "AllToAllSinglePostHookArgs",
    "AllToAllSinglePreHookArgs",
    "AllToAllVSinglePostHookArgs",
    "AllToAllVSinglePreHookArgs",
    "AllToAllvSingleOptions",
    "BackendNotImplementedError",
    "BarrierOptions",
    "BarrierPostHookArgs",
    "BarrierPreHookArgs",
    "BatchOpIssuePostHookArgs",
    "BatchOpIssuePreHookArgs",
    "BatchP2POptions",
    "BatchSendRecv",
    "BroadcastOptions",
    "BroadcastPostHookArgs",
    "BroadcastPreHookArgs",
    "CollectiveMismatchError",
    "CollectivePostHookArgs",
    "CommAbortedError",
    "CommError",
    "CommOptions",
    "CommRevokedError",
    "CommStateError",
    "CommTimeoutError",
    "CommValidationError",
    "FinalizePostHookArgs",
    "FinalizePreHookArgs",
    "GatherOptions",
    "GatherPostHookArgs",
    "GatherPreHookArgs",
    "GatherSinglePostHookArgs",
    "GatherSinglePreHookArgs",
    "InitHandle",
    "NewWindowPostHookArgs",
    "NewWindowPreHookArgs",
    "OpName",
    "P2POp",
    "P2POpType",
    "PeerFailureError",
    "PostHookArgs",
    "PreHookArgs",
    "ReconfigureOptions",
    "RecvOptions",
    "RecvPostHookArgs",
    "RecvPreHookArgs",
    "RedOpType",
    "ReduceOp",
    "ReduceOptions",
    "ReducePostHookArgs",
    "ReducePreHookArgs",
    "ReduceScatterOptions",
    "ReduceScatterPostHookArgs",
    "ReduceScatterPreHookArgs",
    "ReduceScatterSingleOptions",
    "ReduceScatterSinglePostHookArgs",
    "ReduceScatterSinglePreHookArgs",
    "ReduceScatterVPostHookArgs",
    "ReduceScatterVPreHookArgs",
    "RemovableHandle",
    "ScatterOptions",
    "ScatterPostHookArgs",
    "ScatterPreHookArgs",
    "SendOptions",
    "SendPostHookArgs",
    "SendPreHookArgs",
    "SplitPostHookArgs",
    "SplitPreHookArgs",
    "Timeout",
    "TorchComm",
    "TorchCommBackend",
    "TorchCommWinAccessType",
    "TorchCommWindow",
    "TorchCommWindowAttr",
    "TorchWork",
    "WorkStatus",
    "WorkWrapper",
    "built_backends",
    "functional",
    "get_mem_allocator",
    "hooks",
    "is_backend_built",
    "new_comm",
    "objcol",
    "register_backend",
]
