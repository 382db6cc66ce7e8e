"""Registered memory and the handles that name it: upstream's ``RdmaMemory``, its views, and
``RdmaRemoteBuffer`` (what a peer needs to reach it; picklable, so any channel carries it).

``RdmaMemory(tensor)`` registers the tensor's bytes in this process's registry and keeps the
tensor alive until the last handle on the registration is gone; dropping it deregisters the
memory (after any access in flight: ``registry``).  Registering memory that a live
registration already covers reuses that one (``reused_registration()``).
"""

from __future__ import annotations

import contextlib
from typing import Any, SupportsIndex

import torch

from torchcomms.transport.rdma.registry import Registration, registry


class RdmaRemoteBuffer:
    """A peer's registered bytes: address, length and the access key the owner checks."""

    __slots__ = ("_key", "_len", "_ptr")

    def __init__(self, ptr: int, len: int, access_key: str) -> None:
        if not isinstance(ptr, int) or not isinstance(len, int) or ptr < 0 or len < 0:
            raise TypeError(
                f"RdmaRemoteBuffer(ptr, len, access_key): ptr and len must be non-negative "
                f"ints (got ptr={ptr!r}, len={len!r})"
            )
        if not isinstance(access_key, str):
            raise TypeError(f"RdmaRemoteBuffer: access_key must be a str (got {access_key!r})")
        self._ptr, self._len, self._key = ptr, len, access_key

    @property
    def ptr(self) -> int:
        return self._ptr

    @property
    def len(self) -> int:
        return self._len

    @property
    def access_key(self) -> str:
        return self._key

    def __getstate__(self) -> tuple[int, int, str]:
        return (self._ptr, self._len, self._key)

    def __reduce__(self) -> tuple[Any, tuple[int, int, str]]:
        return (RdmaRemoteBuffer, self.__getstate__())

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, tuple[int, int, str]]:
        return self.__reduce__()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RdmaRemoteBuffer) and self.__getstate__() == other.__getstate__()

    def __hash__(self) -> int:
        return hash(self.__getstate__())

    def __repr__(self) -> str:
        return f"RdmaRemoteBuffer(ptr={self._ptr:#x}, len={self._len}, access_key={self._key!r})"


class RdmaMemoryView:
    """A read-only byte range of registered memory: the source of a ``write``."""

    __slots__ = ("length", "memory", "offset")

    def __init__(self, memory: RdmaMemory, offset: int, length: int) -> None:
        self.memory, self.offset, self.length = memory, offset, length

    def size(self) -> int:
        return self.length

    @property
    def ptr(self) -> int:
        return self.memory.ptr + self.offset

    def __repr__(self) -> str:
        return f"{type(self).__name__}(offset={self.offset}, size={self.length})"


class RdmaMemoryMutableView(RdmaMemoryView):
    """A writable byte range of registered memory: the destination of a ``read``."""

    __slots__ = ()


def _range(
    memory: RdmaMemory, offset: int | None, length: int | None, what: str
) -> tuple[int, int]:
    off = 0 if offset is None else offset
    if not isinstance(off, int) or off < 0 or off > memory.nbytes:
        raise RuntimeError(
            f"RdmaMemory.{what}: offset {offset!r} is outside the registered {memory.nbytes} bytes"
        )
    size = memory.nbytes - off if length is None else length
    if not isinstance(size, int) or size < 0 or off + size > memory.nbytes:
        raise RuntimeError(
            f"RdmaMemory.{what}: offset {off} + length {length!r} is past the end of the "
            f"registered {memory.nbytes} bytes"
        )
    return off, size


class RdmaMemory:
    """A contiguous CPU tensor's bytes, registered for one-sided access by peers."""

    def __init__(self, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"RdmaMemory(tensor): expected a torch.Tensor, got {type(tensor)}")
        if not tensor.is_contiguous():
            raise RuntimeError("RdmaMemory currently requires a contiguous tensor")
        if tensor.device.type != "cpu":
            raise RuntimeError(
                f"RdmaMemory: a {tensor.device} tensor cannot be registered: this transport "
                "moves CPU memory (upstream's ibverbs build registers device memory)"
            )
        self.tensor = tensor
        self.ptr, self.nbytes = tensor.data_ptr(), tensor.nbytes
        self._reg: Registration | None
        self._reg, self._reused = registry().register(tensor)

    @property
    def key(self) -> str:
        assert self._reg is not None
        return self._reg.key

    def to_view(self, offset: int | None = None, length: int | None = None) -> RdmaMemoryView:
        return RdmaMemoryView(self, *_range(self, offset, length, "to_view"))

    def to_mutable_view(
        self, offset: int | None = None, length: int | None = None
    ) -> RdmaMemoryMutableView:
        return RdmaMemoryMutableView(self, *_range(self, offset, length, "to_mutable_view"))

    def to_remote_buffer(self) -> RdmaRemoteBuffer:
        return RdmaRemoteBuffer(self.ptr, self.nbytes, self.key)

    def reused_registration(self) -> bool:
        return self._reused

    def _deregister(self) -> None:
        reg, self._reg = getattr(self, "_reg", None), None
        if reg is not None:
            reg.registry.release(reg)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit the registry may be gone
            self._deregister()

    def __repr__(self) -> str:
        return f"RdmaMemory(nbytes={self.nbytes}, reused_registration={self._reused})"
