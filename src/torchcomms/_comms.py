"""Compatibility module: upstream's core extension module, and the ``fake`` backend's entry point.

Upstream tests and PyTorch import names from ``torchcomms._comms``; importing it
registers the ``fake`` backend.  Only ``torch`` and the standard library are
imported here (PyTorch imports this while ``torch.distributed`` is half-initialised).
"""

from __future__ import annotations

from torchcomms._backend_wrapper import _BackendWrapper
from torchcomms.backends.base import TorchCommBackend
from torchcomms.backends.fake import TorchCommFake
from torchcomms.comm import BatchSendRecv, RemovableHandle, TorchComm, new_comm
from torchcomms.hook_args import *  # noqa: F403 - upstream exposes every hook-args class here
from torchcomms.registry import (
    _is_backend_registered,
    _load_backend,
    built_backends,
    is_backend_built,
    register_backend,
)
from torchcomms.types import (
    BatchP2POptions,
    CommOptions,
    OpName,
    P2POp,
    P2POpType,
    RedOpType,
    ReduceOp,
    Timeout,
    TorchCommWinAccessType,
    TorchCommWindowAttr,
)
from torchcomms.window import TorchCommWindow
from torchcomms.work import TorchWork, WorkStatus

register_backend("fake", TorchCommFake)

__all__ = [
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
