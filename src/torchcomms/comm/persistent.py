"""Persistent all-gather on a communicator: ``all_gather_p_init`` / ``_exec`` / ``_free``.

Upstream's API (ncclx and rcclx): ``init`` registers an output buffer once (collective),
``exec`` gathers every member's input into it, rank-major, as often as needed, and ``free``
releases it (local).  Arguments and handles are checked here, once, for every backend, with
the package's error texts; the backend does the rest (the CPU backend's is
``backends.cpu.allgather_p``; a backend without one raises upstream's "not implemented").

As in upstream's ``TorchComm``, these calls take no ``op_id`` and run no hooks (``OpName``
has no entry for them), so hooks and the flight recorder do not see them; ``exec`` still
runs in the communicator's issue order like any op.
"""

from __future__ import annotations

import weakref
from datetime import timedelta
from typing import Any

import torch

from torchcomms.comm.core import CommCore
from torchcomms.errors import CommValidationError
from torchcomms.runtime.state import CommState
from torchcomms.runtime.work import TorchWork
from torchcomms.types import OpOptions


class AllGatherPHandle:
    """What ``all_gather_p_init`` returns: one registered output of one communicator.

    Opaque, as upstream's; pass it to ``all_gather_p_exec`` and ``all_gather_p_free``.
    """

    __slots__ = ("_comm", "_comm_name", "_freed", "_output", "_registration")

    def __init__(self, comm: CommCore, output: torch.Tensor, registration: Any) -> None:
        self._comm = weakref.ref(comm)  # a handle does not keep its communicator alive
        self._comm_name = comm._safe_name()
        self._output = output
        self._registration = registration
        self._freed = False

    def __repr__(self) -> str:
        out = self._output
        state = "freed" if self._freed else "registered"
        dtype = str(out.dtype).removeprefix("torch.")
        return f"AllGatherPHandle(comm={self._comm_name!r}, output={dtype}[{out.numel()}], {state})"


class PersistentAllGather(CommCore):
    """The persistent all-gather methods of ``TorchComm`` (see the module docstring)."""

    def all_gather_p_init(
        self,
        output: torch.Tensor,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> AllGatherPHandle:
        """Register ``output`` (``comm_size`` times the input size) for ``all_gather_p_exec``.

        Collective: every member registers its output, in the same order.
        """
        c = self._checker("all_gather_p_init")
        c.tensor(output, "output")
        if output.numel() % c.size:
            raise c.fail(
                "Output tensor size must be a multiple of comm_size for all_gather_p_init "
                f"(got {output.numel()}, comm_size {c.size})"
            )
        options = self._p_options("all_gather_p_init", hints, timeout)
        registration = self._backend.all_gather_p_init(output, options)
        return AllGatherPHandle(self, output, registration)

    def all_gather_p_exec(
        self,
        handle: AllGatherPHandle,
        input: torch.Tensor,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        """Gather every member's ``input`` into the output ``handle`` registered (rank-major)."""
        c = self._checker("all_gather_p_exec")
        output = self._registered_output(c.prefix, handle)
        c.tensor(input, "input")
        if input.dtype != output.dtype:
            raise c.fail(
                f"input dtype {input.dtype} must match the registered output's dtype {output.dtype}"
            )
        c.numel_eq(
            output.numel(),
            input.numel() * c.size,
            "Registered output size must be input_size * comm_size for all_gather_p_exec",
        )
        c.async_op(async_op)
        options = self._p_options("all_gather_p_exec", hints, timeout)
        work: TorchWork = self._backend.all_gather_p_exec(
            handle._registration, input, async_op, options
        )
        return work

    def all_gather_p_free(self, handle: AllGatherPHandle | None) -> None:
        """Release ``handle`` (local).  ``None`` is ignored, as upstream ignores a null handle;
        after ``finalize`` (which released everything) it only marks the handle freed."""
        if handle is None:
            return
        prefix = self._prefix("all_gather_p_free")
        self._registered_output(prefix, handle, "was already freed")
        if self._status.state is not CommState.FINALIZED:
            self._backend.all_gather_p_free(handle._registration)
        handle._freed = True

    def _p_options(self, op: str, hints: Any, timeout: timedelta | None) -> OpOptions:
        resolved = self._resolve_timeout(timeout, op, hints)
        return OpOptions(resolved, {str(k): str(v) for k, v in (hints or {}).items()}, op)

    def _registered_output(
        self,
        prefix: str,
        handle: Any,
        freed: str = "was freed by all_gather_p_free (register the output again with "
        "all_gather_p_init)",
    ) -> torch.Tensor:
        """The output ``handle`` registered on this communicator, or the error saying why not."""
        if not isinstance(handle, AllGatherPHandle):
            raise TypeError(
                f"{prefix}handle must be an AllGatherPHandle from all_gather_p_init, got "
                f"{type(handle).__name__}"
            )
        if handle._comm() is not self:
            raise CommValidationError(
                f"{prefix}the handle was registered on communicator {handle._comm_name!r} "
                "(another communicator); use it only with the communicator whose "
                "all_gather_p_init returned it"
            )
        if handle._freed:
            raise CommValidationError(f"{prefix}the handle {freed}")
        return handle._output
