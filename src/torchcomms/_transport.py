"""``torchcomms._transport``: upstream's one-sided point-to-point transport, on CPU.

``RdmaTransport`` links two processes; each side registers tensors as ``RdmaMemory`` and hands
the other an ``RdmaRemoteBuffer`` (picklable) by any channel; ``read`` and ``write`` then move
bytes without the owner's code taking part.  On one host the copy is a single cross-memory
attach; across hosts a serving thread per transport answers over TCP.  See
``docs/windows.md`` (windows vs transport) and ``torchcomms.transport.rdma``.
"""

from __future__ import annotations

from typing import Any

from torchcomms.transport.rdma.memory import (
    RdmaMemory,
    RdmaMemoryMutableView,
    RdmaMemoryView,
    RdmaRemoteBuffer,
)
from torchcomms.transport.rdma.transport import RdmaTransport

__all__ = [
    "RdmaMemory",
    "RdmaMemoryMutableView",
    "RdmaMemoryView",
    "RdmaRemoteBuffer",
    "RdmaTransport",
    "attach_rdma_memory_hook",
]


def attach_rdma_memory_hook(reg: Any, dereg: Any) -> None:
    """Upstream forwards CUDA caching-allocator segments to registration callbacks; CPU memory
    has no such allocator here, so this is refused rather than silently ignored."""
    raise RuntimeError(
        "attach_rdma_memory_hook: hooks the CUDA caching allocator's segments, which the CPU "
        "transport does not have; register tensors with RdmaMemory(tensor) instead"
    )
