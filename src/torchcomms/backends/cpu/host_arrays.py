"""numpy views for small payloads: where a torch kernel's dispatch costs more than the bytes.

On a small tensor a torch call costs 1-2.5 us of dispatch (a copy, a ``torch.sum``), a
numpy ufunc on the same memory 0.1-0.5 us; numpy stays ahead up to about 64 KiB on one
thread (``benchmarks/diagnostics/latency_breakdown.py``).  The shm transport's one-shot
all_reduce uses these views up to ``MAX_BYTES``:

* ``numpy_dtype`` says which payloads numpy may copy (float32/64, int8/32/64, uint8);
* ``ufunc_for`` maps a reduction to the numpy ufunc that gives torch's result bit for bit
  (SUM, MAX, MIN) on the integer dtypes only: on floats numpy reports overflow and NaN
  through ``RuntimeWarning`` (an error under ``-W error``), and silencing it per call
  (``np.errstate``) costs 1.5 us, more than torch's kernel; float16 and bfloat16 stay
  with torch throughout;
* ``UserArrays`` hands out non-owning numpy views of the caller's tensors, cached by
  address.  A view is used only for a tensor whose ``data_ptr``, length and dtype match
  the cached entry, so it always covers exactly that live tensor's memory; it never keeps
  memory alive (a cached address whose tensor was freed is simply never dereferenced);
* ``UserBytes`` does the same for byte views (``memoryview``), what sockets read into
  and send from: 0.3 us against 1.6 us for ``tensor.numpy().data.cast("B")``.  A view
  does not keep its tensor alive: whoever keeps the view past the call keeps the tensor;
* ``mark_written`` bumps the tensor's autograd version, as an in-place torch op would.

Everything runs on the thread that runs the op.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from torchcomms.types import RedOpType

#: Largest payload reduced with numpy (above it torch's vectorised kernels catch up).
MAX_BYTES = 64 << 10

_NUMPY_DTYPES: dict[torch.dtype, type[np.generic]] = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
}
_UFUNCS: dict[RedOpType, np.ufunc] = {
    RedOpType.SUM: np.add,
    RedOpType.MAX: np.maximum,
    RedOpType.MIN: np.minimum,
}
_CACHE_ENTRIES = 64


def numpy_dtype(dtype: torch.dtype) -> type[np.generic] | None:
    return _NUMPY_DTYPES.get(dtype)


def ufunc_for(dtype: torch.dtype, op: RedOpType, nbytes: int) -> np.ufunc | None:
    """The numpy ufunc reducing this payload exactly and silently as torch would, or None
    (use torch): integer dtypes only (floats warn on overflow, see the module docstring)."""
    if nbytes > MAX_BYTES or dtype not in _NUMPY_DTYPES or dtype.is_floating_point:
        return None
    return _UFUNCS.get(op)


def segment_array(t: torch.Tensor) -> np.ndarray:
    """numpy's view of a (strided) view of a shared segment; it keeps ``t`` alive."""
    return t.numpy()


class UserArrays:
    """Non-owning numpy views of caller tensors of one length and dtype, by address."""

    __slots__ = ("_dtype", "_nbytes", "_views")

    def __init__(self, dtype: torch.dtype, numel: int) -> None:
        np_dtype = _NUMPY_DTYPES.get(dtype)
        if np_dtype is None:
            raise ValueError(f"numpy has no dtype for {dtype}")
        self._dtype = np_dtype
        self._nbytes = numel * dtype.itemsize
        self._views: dict[int, np.ndarray] = {}

    def of(self, t: torch.Tensor) -> np.ndarray:
        """The view of ``t``: a contiguous CPU tensor of this length and dtype."""
        ptr = t.data_ptr()
        view = self._views.get(ptr)
        if view is None:
            raw = (ctypes.c_char * self._nbytes).from_address(ptr)
            view = np.frombuffer(memoryview(raw).cast("B"), dtype=self._dtype)
            if len(self._views) >= _CACHE_ENTRIES:
                self._views.clear()
            self._views[ptr] = view
        return view


class UserBytes:
    """Non-owning byte views of contiguous CPU tensors, by address and length."""

    __slots__ = ("_views",)

    def __init__(self) -> None:
        self._views: dict[int, memoryview] = {}

    def of(self, t: torch.Tensor) -> memoryview:
        """The bytes of ``t``, a contiguous CPU tensor, valid while ``t`` lives."""
        ptr, nbytes = t.data_ptr(), t.nbytes
        view = self._views.get(ptr)
        if view is None or len(view) != nbytes:
            view = memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B")
            if len(self._views) >= _CACHE_ENTRIES:
                self._views.clear()
            self._views[ptr] = view
        return view


#: After writing a tensor through a numpy view: what an in-place torch op does to autograd.
mark_written = torch._C._increment_version
