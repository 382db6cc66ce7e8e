"""``NanCheckHook``: refuse to run a collective whose floating-point tensors hold NaN.

A pre-hook runs ``torch.ops.c10d.check_for_nan`` on each floating-point tensor of the op
before the backend sees it; a NaN raises ``RuntimeError("NaN detected in input tensor for
'all_reduce' on comm 'main': ...")`` and the op is not executed (hook errors stop the op).
In-place ops (broadcast, all_reduce, reduce) check their one tensor if either flag is set;
send checks inputs, recv checks outputs.  Inf is not flagged.
"""

from __future__ import annotations

from typing import Any

import torch

from torchcomms.comm import RemovableHandle, TorchComm
from torchcomms.optable import OpName
from torchcomms.runtime import opinfo

_INPLACE = opinfo.IN_PLACE_OPS


def _check_for_nan(tensor: torch.Tensor) -> None:
    # Imported lazily: the c10d ops are registered once torch.distributed is imported.
    import torch.distributed

    torch.ops.c10d.check_for_nan(tensor)


class NanCheckHook:
    """Registers a NaN-checking pre-hook on each communicator given to ``register_with_comm``."""

    def __init__(self, check_inputs: bool = True, check_outputs: bool = False) -> None:
        self._check_inputs = bool(check_inputs)
        self._check_outputs = bool(check_outputs)
        self._handles: list[RemovableHandle] = []

    def register_with_comm(self, comm: TorchComm) -> None:
        if not isinstance(comm, TorchComm):
            raise TypeError(f"register_with_comm expects a TorchComm, got {type(comm).__name__}")
        name = comm._safe_name()

        def pre_hook(op: OpName, op_id: int, args: Any) -> None:
            self._check(op, args, name)

        self._handles.append(comm.register_pre_hook(pre_hook))

    def unregister(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def is_enabled(self) -> bool:
        return bool(self._handles)

    def _check(self, op: OpName, args: Any, comm_name: str) -> None:
        if op in _INPLACE:
            if self._check_inputs or self._check_outputs:
                self._scan([args.tensor], "input", op, comm_name)
            return
        ins, outs = opinfo.inputs_outputs(op, args)
        if self._check_inputs:
            self._scan(ins, "input", op, comm_name)
        if self._check_outputs:
            self._scan(outs, "output", op, comm_name)

    @staticmethod
    def _scan(tensors: list[torch.Tensor], side: str, op: OpName, comm_name: str) -> None:
        for t in tensors:
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() == 0:
                continue
            try:
                _check_for_nan(t)
            except RuntimeError as exc:
                raise RuntimeError(
                    f"NaN detected in {side} tensor for '{op.name}' on comm '{comm_name}': {exc}"
                ) from exc
