"""Argument checks shared by every backend, with the reference's error texts.

``TorchComm`` calls these before any hook or backend runs, so a bad argument
raises the same typed error on every backend and nothing is half-done.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from torchcomms.errors import CommValidationError
from torchcomms.types import RedOpType, ReduceOp

_BITWISE = (RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR)
#: Reductions valid for every dtype: ``reduce_op`` returns at once for these.
_ANY_DTYPE = (RedOpType.SUM, RedOpType.MAX, RedOpType.MIN, RedOpType.PRODUCT)
_PREMUL_SUM = RedOpType.PREMUL_SUM
_AVG = RedOpType.AVG


class Checker:
    """Validates one op's arguments; errors are prefixed with comm, rank and op.

    The prefix is built only when an error is raised: valid calls (the hot path) skip it.
    """

    __slots__ = (
        "_cpu",
        "_describe",
        "_device_type",
        "device",
        "dtypes",
        "rank",
        "self_p2p",
        "size",
    )

    def __init__(
        self,
        describe: Callable[[], str],
        rank: int,
        size: int,
        device: torch.device,
        dtypes: frozenset[torch.dtype] | None,
        self_p2p: bool = True,
    ) -> None:
        self._describe = describe
        self.self_p2p = self_p2p
        self.rank = rank
        self.size = size
        self.device = device
        # ``t.is_cpu`` is a fifth of the cost of ``t.device.type`` (which builds a device).
        self._cpu = device.type == "cpu"
        self._device_type = device.type
        self.dtypes = dtypes

    @property
    def prefix(self) -> str:
        """``"[<backend> comm=<name> rank=<r>] <op>: "``, naming where the error happened."""
        return self._describe()

    def fail(self, message: str) -> CommValidationError:
        return CommValidationError(f"{self.prefix}{message}")

    # -- scalars -----------------------------------------------------------------------------
    def async_op(self, value: Any) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"{self.prefix}async_op must be a bool, got {type(value).__name__}")

    def rank_arg(self, what: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{self.prefix}{what} must be an int, got {type(value).__name__}")
        if not 0 <= value < self.size:
            raise self.fail(f"{what} must be in range [0, {self.size}), but got {value}")

    def peer(self, what: str, value: Any, verb: str) -> None:
        self.rank_arg(what, value)
        if value == self.rank and not self.self_p2p:
            raise self.fail(f"Cannot {verb} self (rank {value})")

    # -- tensors -----------------------------------------------------------------------------
    def tensor(self, t: Any, what: str = "tensor") -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{self.prefix}{what} must be a torch.Tensor, got {type(t).__name__}")
        wrong_device = not self._cpu if t.is_cpu else t.device.type != self._device_type
        if wrong_device:
            raise self.fail(
                f"{what} is on device {t.device}, but the communicator's device is {self.device}"
            )
        try:
            contiguous = t.is_contiguous()
        except RuntimeError:  # sparse CSR/CSC/BSR tensors have no notion of contiguity
            contiguous = False
        if not contiguous:
            layout = t.layout
            if layout is not torch.strided:
                kind = "a sparse tensor, " if "sparse" in str(layout) else ""
                raise self.fail(f"{what} must be dense (got {kind}layout {layout})")
            raise self.fail(f"Tensor must be contiguous for Gloo operations ({what})")
        if self.dtypes is not None and t.dtype not in self.dtypes:
            raise self.fail(f"Invalid scalar type {t.dtype} ({what})")
        return t

    def tensor_list(self, ts: Any, what: str) -> list[torch.Tensor]:
        if not isinstance(ts, (list, tuple)):
            raise TypeError(
                f"{self.prefix}{what} must be a list of tensors, got {type(ts).__name__}"
            )
        return [self.tensor(t, f"{what}[{i}]") for i, t in enumerate(ts)]

    def same_dtype(self, reference: torch.Tensor, others: Sequence[torch.Tensor]) -> None:
        for t in others:
            if t.dtype != reference.dtype:
                raise self.fail(
                    f"All tensors must have the same dtype (got {t.dtype}, expected {reference.dtype})"
                )

    def list_len(self, ts: Sequence[Any], message: str) -> None:
        if len(ts) != self.size:
            raise self.fail(f"{message} (got {len(ts)}, expected {self.size})")

    def numel_eq(self, got: int, expected: int, message: str) -> None:
        if got != expected:
            raise self.fail(f"{message} (got {got}, expected {expected})")

    # -- reductions --------------------------------------------------------------------------
    def reduce_op(self, op: Any, dtype: torch.dtype) -> ReduceOp:
        if not isinstance(op, ReduceOp):
            raise TypeError(f"{self.prefix}op must be a ReduceOp, got {type(op).__name__}")
        kind = op._type
        if kind in _ANY_DTYPE:  # the common case: nothing depends on the dtype
            return op
        floating = dtype.is_floating_point or dtype.is_complex
        if kind in _BITWISE and floating:
            raise self.fail(f"Cannot use ReduceOp.{kind.name} with non-integral dtype")
        if kind is _PREMUL_SUM and not floating:
            raise self.fail(f"ReduceOp.PREMUL_SUM requires a floating-point dtype (got {dtype})")
        if kind is _AVG and dtype is torch.bool:
            raise self.fail("ReduceOp.AVG is not supported for dtype torch.bool")
        return op

    # -- split sizes ---------------------------------------------------------------------------
    def split_sizes(self, sizes: Any, what: str, tensor: torch.Tensor) -> list[int]:
        if not isinstance(sizes, (list, tuple)) or not all(
            isinstance(s, int) and not isinstance(s, bool) for s in sizes
        ):
            raise TypeError(f"{self.prefix}{what} must be a list of ints")
        self.list_len(sizes, f"{what} length must equal comm_size for all_to_all_v_single")
        if any(s < 0 for s in sizes):
            raise self.fail(f"{what} must not contain negative sizes (got {list(sizes)})")
        rows = tensor.shape[0] if tensor.dim() > 0 else tensor.numel()
        if sum(sizes) > rows:
            raise self.fail(
                f"sum of {what} ({sum(sizes)}) exceeds the tensor's dim-0 size ({rows}) "
                "for all_to_all_v_single"
            )
        return list(sizes)

    def split_ranks(self, ranks: Any) -> list[int]:
        if not isinstance(ranks, (list, tuple)) or not all(
            isinstance(r, int) and not isinstance(r, bool) for r in ranks
        ):
            raise TypeError(f"{self.prefix}ranks must be a list of ints")
        ranks = list(ranks)
        for r in ranks:
            if not 0 <= r < self.size:
                raise self.fail(f"Invalid rank {r} in ranks. Valid ranks are 0 to {self.size - 1}")
        if len(set(ranks)) != len(ranks):
            dupes = sorted({r for r in ranks if ranks.count(r) > 1})
            raise self.fail(f"Duplicate ranks found in ranks list: {dupes}")
        if ranks and self.rank not in ranks:
            raise self.fail(
                f"Current rank {self.rank} is not in the ranks list {ranks}; ranks not joining "
                "any group must pass []"
            )
        return ranks
