"""What the CPU backend's transports share: its dtypes, host staging, AVG's final division."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torchcomms.runtime import fingerprint as F
from torchcomms.types import RedOpType, ReduceOp

#: The dtypes the CPU backend supports, in the fingerprints' order (shm fingerprints number
#: them): the first nine fingerprint dtypes.
CPU_DTYPES = F.DTYPES[:9]


class on_host:
    """Yield a CPU contiguous view of ``tensor``; copy back on exit if it had to be staged."""

    __slots__ = ("_host", "_tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor
        self._host = tensor if tensor.is_cpu else tensor.detach().to("cpu")

    def __enter__(self) -> torch.Tensor:
        return self._host

    def __exit__(self, *exc: object) -> None:
        if self._host is not self._tensor and exc[0] is None:
            self._tensor.copy_(self._host)


class reduced_on_host(on_host):
    """``on_host`` for a reduction's result: yields the flat host view; on a clean exit,
    AVG's division (``finish_average``), then the copy back."""

    __slots__ = ("_op", "_size")

    def __init__(self, tensor: torch.Tensor, op: ReduceOp, size: int) -> None:
        self._tensor = tensor
        self._host = tensor if tensor.is_cpu else tensor.detach().to("cpu")
        self._op = op
        self._size = size

    def __enter__(self) -> torch.Tensor:
        return self._host.view(-1)

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            finish_average(self._host, self._op, self._size)
            if self._host is not self._tensor:
                self._tensor.copy_(self._host)


class all_on_host:
    """``on_host`` for a list of tensors: yields their flat host views; on a clean exit,
    copies back those that had to be staged."""

    __slots__ = ("_stages",)

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._stages = [on_host(t) for t in tensors]

    def __enter__(self) -> list[torch.Tensor]:
        return [s.__enter__().view(-1) for s in self._stages]

    def __exit__(self, *exc: object) -> None:
        for s in self._stages:
            s.__exit__(*exc)


def premultiplied(tensor: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """PREMUL_SUM's operand: ``tensor`` times the op's factor (a new tensor); else ``tensor``."""
    return tensor * op.factor_value() if op.type is RedOpType.PREMUL_SUM else tensor


def finish_average(tensor: torch.Tensor, op: ReduceOp, size: int) -> None:
    """AVG is a sum divided by the member count (integers truncate, as torch does)."""
    if op.type is RedOpType.AVG:
        if tensor.is_floating_point():
            tensor.div_(size)
        else:
            tensor.copy_(torch.div(tensor, size, rounding_mode="trunc"))


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous CPU tensors share any byte."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def host_flat(tensor: torch.Tensor) -> torch.Tensor:
    """A flat CPU view (or copy, for device tensors) of a contiguous tensor, for reading."""
    if tensor.is_cpu:
        return tensor if tensor.dim() == 1 else tensor.view(-1)
    return tensor.detach().to("cpu").reshape(-1)
