"""Compatibility module: upstream's core extension module, and the ``fake`` backend's entry point.

Upstream tests and PyTorch import names from ``torchcomms._comms``; importing it
registers the ``fake`` backend.  Only ``torch`` and the standard library are
imported here (PyTorch imports this while ``torch.distributed`` is half-initialised).
"""

from __future__ import annotations

import importlib
import types

from torchcomms._backend_wrapper import _BackendWrapper, _BackendWrapperOptions
from torchcomms.backends.base import TorchCommBackend
from torchcomms.backends.fake import TorchCommFake
from torchcomms.bridge.c10d_work import _WorkWrapper
from torchcomms.comm import BatchSendRecv, RemovableHandle, TorchComm, new_comm
from torchcomms.comm.allocator import get_mem_allocator
from torchcomms.comm.persistent import AllGatherPHandle
from torchcomms.comm.window import TorchCommWindow
from torchcomms.optable import OpName, hook_args
from torchcomms.optable.hook_args import *  # noqa: F403 - upstream exposes every hook-args class here
from torchcomms.registry import (
    _is_backend_registered,
    _load_backend,
    built_backends,
    is_backend_built,
    register_backend,
)
from torchcomms.runtime.work import TorchWork, WorkStatus
from torchcomms.types import (
    AllGatherOptions,
    AllGatherPExecOptions,
    AllGatherPInitOptions,
    AllGatherSingleOptions,
    AllReduceOptions,
    AllToAllOptions,
    AllToAllSingleOptions,
    AllToAllvSingleOptions,
    BarrierOptions,
    BatchP2POptions,
    BroadcastOptions,
    CommOptions,
    GatherOptions,
    InitHandle,
    P2POp,
    P2POpType,
    ReconfigureOptions,
    RecvOptions,
    RedOpType,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
    ReduceScatterSingleOptions,
    ScatterOptions,
    SendOptions,
    Timeout,
    TorchCommWinAccessType,
    TorchCommWindowAttr,
)

register_backend("fake", TorchCommFake)


def _module(name: str, **members: object) -> types.ModuleType:
    module = types.ModuleType(f"{__name__}.{name}")
    module.__dict__.update(members)
    return module


def __getattr__(name: str) -> types.ModuleType:
    """``hooks``: upstream's extension submodules ``_comms.hooks.fr`` / ``_comms.hooks.clog``
    (its ``torchcomms.hooks`` reads its classes there), holding ``torchcomms.hooks``' classes.
    Built on first use: PyTorch imports this module while ``torchcomms.hooks`` may still be
    half-initialised."""
    if name != "hooks":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    package = importlib.import_module("torchcomms.hooks")
    fr = _module("hooks.fr", FlightRecorderHook=package.FlightRecorderHook)
    namespace = _module("hooks", fr=fr, clog=_module("hooks.clog", clog=package.clog))
    globals()["hooks"] = namespace
    return namespace


#: Upstream's ``WorkWrapper``: the c10d ``Work`` the bridge (``_BackendWrapper``) returns;
#: ``exception()`` is ``None`` or the op's error (every communicator error is a
#: ``RuntimeError``).
WorkWrapper = _WorkWrapper

__all__ = [
    *hook_args.__all__,
    "AllGatherOptions",
    "AllGatherPExecOptions",
    "AllGatherPHandle",
    "AllGatherPInitOptions",
    "AllGatherSingleOptions",
    "AllReduceOptions",
    "AllToAllOptions",
    "AllToAllSingleOptions",
    "AllToAllvSingleOptions",
    "BarrierOptions",
    "BroadcastOptions",
    "GatherOptions",
    "InitHandle",
    "ReconfigureOptions",
    "RecvOptions",
    "ReduceOptions",
    "ReduceScatterOptions",
    "ReduceScatterSingleOptions",
    "ScatterOptions",
    "SendOptions",
    "WorkWrapper",
    "_BackendWrapperOptions",
    "get_mem_allocator",
    "BatchP2POptions",
    "BatchSendRecv",
    "CommOptions",
    "OpName",
    "P2POp",
    "P2POpType",
    "RedOpType",
    "ReduceOp",
    "RemovableHandle",
    "Timeout",
    "TorchComm",
    "TorchCommBackend",
    "TorchCommFake",
    "TorchCommWinAccessType",
    "TorchCommWindow",
    "TorchCommWindowAttr",
    "TorchWork",
    "WorkStatus",
    "_BackendWrapper",
    "_is_backend_registered",
    "_load_backend",
    "built_backends",
    "is_backend_built",
    "new_comm",
    "register_backend",
]
