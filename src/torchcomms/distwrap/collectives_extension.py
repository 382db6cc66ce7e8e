"""The torchcomms-only calls upstream's distwrap adds (upstream's ``collectives_extension``).

* ``new_window``: a one-sided window (``TorchComm.new_window``) on the group's communicator;
* ``reduce_scatter_quantized``: upstream's ncclx op (FP32 in and out, BF16 on the wire with
  stochastic rounding seeded by ``seed``, FP32 reduction at the destination) done the same
  way on any communicator: each rank rounds its input to BF16 (round-to-nearest-up with
  16 random bits from a generator seeded by ``seed``), the chunks cross with one
  ``all_to_all_single``, and each rank sums its chunks in FP32 (``AVG`` divides by the size);
  it always returns a work to wait on, as upstream's does.

Both need ``use_torchcomms=True`` (``AssertionError``, upstream's text).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup, ReduceOp

from torchcomms.bridge.c10d_work import _WorkWrapper
from torchcomms.distwrap.collectives import _convert_reduce_op
from torchcomms.distwrap.pginfo import pg_info_get_data
from torchcomms.distwrap.utils import (
    _check_routable,
    _comm_for,
    _resolve_group,
    parse_backend_string,
    torchcomms_is_enabled,
)
from torchcomms.types import RedOpType


def _require_torchcomms(op: str) -> None:
    if not torchcomms_is_enabled():
        raise AssertionError(f"{op} requires torchcomms to be enabled")


def new_window(group: ProcessGroup | None = None, backend: str | None = None) -> Any:
    """A window on the group's communicator (``backend`` picks the device's; default: first)."""
    _require_torchcomms("new_window")
    pg = _resolve_group(group)
    if backend is not None:
        device_type = next(iter(parse_backend_string(backend)))
        comm = _comm_for(pg, "new_window", device_type=device_type)
    else:
        _check_routable(pg, "new_window")
        comms = pg_info_get_data(pg, "torchcomms")
        if not comms:
            raise AssertionError(f"No torchcomms instances found for process group {pg}")
        comm = next(iter(comms.values()))  # the first, as upstream's
    return comm.new_window()


def _stochastic_bf16(t: torch.Tensor, seed: int) -> torch.Tensor:
    """``t`` (float32) rounded to bfloat16, up with probability of the dropped bits' weight."""
    bits = t.contiguous().view(torch.int32)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    noise = torch.randint(0, 1 << 16, bits.shape, generator=gen, dtype=torch.int32)
    noise = noise.to(bits.device)
    rounded = torch.bitwise_and(bits + noise, -(1 << 16)).view(torch.float32)
    # inf/nan pass as they are; a finite value rounded past the largest finite one is
    # rounded to nearest instead (by the cast below).
    rounded = torch.where(torch.isfinite(t) & torch.isfinite(rounded), rounded, t)
    return rounded.to(torch.bfloat16)


def reduce_scatter_quantized(
    output: torch.Tensor,
    input: torch.Tensor,
    op: ReduceOp,
    seed: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Any:
    """Reduce-scatter with BF16 transport and FP32 reduction; returns a work either way."""
    _require_torchcomms("reduce_scatter_quantized")
    pg = _resolve_group(group)
    comm = _comm_for(pg, "reduce_scatter_quantized", tensor=output)
    n = comm.get_size()
    tc_op = _convert_reduce_op(op)
    if tc_op.type not in (RedOpType.SUM, RedOpType.AVG):
        raise ValueError(
            f"reduce_scatter_quantized: op must be ReduceOp.SUM or ReduceOp.AVG, got {tc_op}"
        )
    for name, t in (("output", output), ("input", input)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            what = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(
                f"reduce_scatter_quantized: {name} must be a float32 tensor, got {what}"
            )
    if input.numel() != output.numel() * n:
        raise ValueError(
            f"reduce_scatter_quantized: input has {input.numel()} elements, expected "
            f"output.numel() * world_size = {output.numel()} * {n} = {output.numel() * n}"
        )
    if not isinstance(seed, torch.Tensor) or seed.numel() != 1 or seed.dtype != torch.int64:
        raise TypeError("reduce_scatter_quantized: seed must be a one-element int64 tensor")
    staged = _stochastic_bf16(input.reshape(-1), int(seed.item()))
    received = torch.empty_like(staged)
    work = comm.all_to_all_single(received, staged, async_op)

    def reduce_chunks() -> None:
        total = received.view(n, -1).to(torch.float32).sum(dim=0)
        if tc_op.type is RedOpType.AVG:
            total.div_(n)
        output.copy_(total.view(output.shape))

    return _WorkWrapper([work], [output], None, reduce_chunks)
