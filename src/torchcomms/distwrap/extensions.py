"""The torchcomms-only extensions upstream's distwrap exports, and what they do on CPU.

* ``new_window``: a one-sided window (``TorchComm.new_window``) on the group's communicator;
* ``reduce_scatter_quantized``: upstream's ncclx op (FP32 in and out, BF16 on the wire with
  stochastic rounding seeded by ``seed``, FP32 reduction at the destination) done the same
  way on any communicator: each rank rounds its input to BF16 (round-to-nearest-up with
  16 random bits from a generator seeded by ``seed``), the chunks cross with one
  ``all_to_all_single``, and each rank sums its chunks in FP32 (``AVG`` divides by the size);
  it always returns a work to wait on, as upstream's does;
* ``get_mem_allocator`` / ``register_mem_pool``: CUDA memory-pool plumbing; there is no
  allocator on CPU, so asking for one raises naming the limit, and registering a pool is a
  no-op with torchcomms on (as upstream) and an error for a backend without pools otherwise;
* ``alltoallv_dedup_*`` / ``alltoallv_dynamic_*``: ncclx-only on upstream too: they look up
  the group's CUDA ncclx communicator and raise upstream's errors without one.

Every call except the last group needs ``use_torchcomms=True`` where upstream's does
(``AssertionError``, upstream's text).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from torchcomms._c10d.work import _WorkWrapper
from torchcomms.distwrap import env, registry
from torchcomms.distwrap.collectives import to_torchcomms_op
from torchcomms.types import RedOpType


def _require_torchcomms(op: str) -> None:
    if not registry.torchcomms_is_enabled():
        raise AssertionError(f"{op} requires torchcomms to be enabled")


def new_window(group: dist.ProcessGroup | None = None, backend: str | None = None) -> Any:
    """A window on the group's communicator (``backend`` picks the device's; default: first)."""
    _require_torchcomms("new_window")
    pg = registry.get_group(group)
    if backend is not None:
        device_type = next(iter(env.parse_backend_string(backend)))
        comm = registry.comm_for(pg, "new_window", device_type=device_type)
    else:
        found = registry.info(pg)
        if found is None or not found.comms:
            comm = registry.default_comm(pg, "new_window")  # raises the registry's error
        else:
            comm = next(iter(found.comms.values()))
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
    op: Any,
    seed: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Any:
    """Reduce-scatter with BF16 transport and FP32 reduction; returns a work either way."""
    _require_torchcomms("reduce_scatter_quantized")
    pg = registry.get_group(group)
    comm = registry.comm_for(pg, "reduce_scatter_quantized", tensor=output)
    n = comm.get_size()
    tc_op = to_torchcomms_op(op)
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


def get_mem_allocator(group: dist.ProcessGroup | None, device: torch.device) -> Any:
    """The group's memory allocator for ``device``: CUDA only, so an error on CPU."""
    pg = registry.get_group(group)
    device = torch.device(device)
    if registry.torchcomms_is_enabled():
        comm = registry.comm_for(pg, "get_mem_allocator", device_type=device.type)
        allocator = getattr(comm, "mem_allocator", None)
        if allocator is None:
            raise RuntimeError(
                f"get_mem_allocator: the {comm.get_backend()!r} communicator for device "
                f"{device.type!r} has no memory allocator (torchcomms allocators are CUDA "
                "caching allocators; CPU communicators use ordinary tensors)"
            )
        return allocator
    backend = pg._get_backend(device)
    allocator = getattr(backend, "mem_allocator", None)
    if allocator is None:
        raise RuntimeError(
            f"get_mem_allocator: backend {backend.name()!r} for device {device.type!r} has no "
            "memory allocator (only CUDA backends such as NCCL provide one)"
        )
    return allocator


def register_mem_pool(group: dist.ProcessGroup | None, device: torch.device, pool: Any) -> None:
    """Register ``pool`` with the group's backend; torchcomms manages its own (no-op)."""
    if registry.torchcomms_is_enabled():
        return
    pg = registry.get_group(group)
    device = torch.device(device)
    backend = pg._get_backend(device)
    register = getattr(backend, "register_mem_pool", None)
    if register is None:
        raise RuntimeError(
            f"register_mem_pool: backend {backend.name()!r} for device {device.type!r} has no "
            "memory pools (only CUDA backends such as NCCL register torch.cuda.MemPool)"
        )
    register(pool)


def _ncclx_backend(op: str, group: dist.ProcessGroup | None) -> Any:
    _require_torchcomms(op)
    comm = registry.comm_for(registry.get_group(group), op, device_type="cuda")
    if comm.get_backend() != "ncclx":
        raise AssertionError(f"{op} requires ncclx backend, got {comm.get_backend()}")
    return comm.get_backend_impl()


def alltoallv_dedup_init(
    num_tokens: int,
    token_size: int,
    topk_k: int,
    experts_per_rank: int,
    dtype: torch.dtype,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Any:
    impl = _ncclx_backend("alltoallv_dedup_init", group)
    return impl.alltoallv_dedup_init(
        num_tokens, token_size, topk_k, experts_per_rank, dtype, async_op
    )


def alltoallv_dedup_exec(
    output_tensor: torch.Tensor,
    recv_block_ids: torch.Tensor,
    input_tensor: torch.Tensor,
    send_indices: torch.Tensor,
    forward_indices: torch.Tensor,
    recv_indices: torch.Tensor,
    persist_req: Any,
    group: dist.ProcessGroup | None = None,
) -> Any:
    impl = _ncclx_backend("alltoallv_dedup_exec", group)
    return impl.alltoallv_dedup_exec(
        output_tensor,
        recv_block_ids,
        input_tensor,
        send_indices,
        forward_indices,
        recv_indices,
        persist_req,
    )


def alltoallv_dynamic_dispatch(
    output_tensors: list[torch.Tensor],
    output_split_sizes: torch.Tensor,
    input_tensor: torch.Tensor,
    input_split_sizes: torch.Tensor,
    input_split_indices: torch.Tensor,
    input_split_indices_per_rank: torch.Tensor,
    D: int,  # upstream's parameter name
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Any:
    impl = _ncclx_backend("alltoallv_dynamic_dispatch", group)
    return impl.alltoallv_dynamic_dispatch(
        output_tensors,
        output_split_sizes,
        input_tensor,
        input_split_sizes,
        input_split_indices,
        input_split_indices_per_rank,
        D,
        async_op,
    )


def alltoallv_dynamic_combine(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    input_split_sizes: torch.Tensor,
    input_split_indices: torch.Tensor,
    input_split_indices_per_rank: torch.Tensor,
    D: int,  # upstream's parameter name
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> None:
    impl = _ncclx_backend("alltoallv_dynamic_combine", group)
    impl.alltoallv_dynamic_combine(
        output_tensor,
        input_tensor,
        input_split_sizes,
        input_split_indices,
        input_split_indices_per_rank,
        D,
        async_op,
    )
