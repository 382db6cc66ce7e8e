"""``get_mem_allocator``: upstream's per-backend memory allocator, which no CPU backend has.

Upstream returns a CUDA allocator (symmetric, VMM-backed memory for windows and persistent
collectives) registered by its GPU backends, and raises "No allocator factory registered
for backend: X" for the others.  Every backend here registers ordinary tensors, so the
answer is always that error, with the reason.
"""

from __future__ import annotations

from typing import Any

from torchcomms.errors import BackendNotImplementedError


def get_mem_allocator(backend: str) -> Any:
    """The global memory allocator of ``backend``; raises: no backend here has one."""
    if not isinstance(backend, str):
        raise TypeError(f"get_mem_allocator: backend must be a str, got {type(backend).__name__}")
    raise BackendNotImplementedError(
        f"No allocator factory registered for backend: {backend} (a communicator memory "
        "allocator is a CUDA allocator for symmetric GPU memory; CPU communicators, windows "
        "and persistent all-gathers use ordinary tensors)"
    )
