"""Typed, read-only argument objects handed to pre- and post-hooks (upstream's names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class SendPreHookArgs:
    tensor: torch.Tensor
    peer: int
    async_op: bool


@dataclass(frozen=True, slots=True)
class RecvPreHookArgs:
    tensor: torch.Tensor
    peer: int
    async_op: bool


@dataclass(frozen=True, slots=True)
class BroadcastPreHookArgs:
    tensor: torch.Tensor
    root: int
    async_op: bool


@dataclass(frozen=True, slots=True)
class AllReducePreHookArgs:
    tensor: torch.Tensor
    async_op: bool


@dataclass(frozen=True, slots=True)
class ReducePreHookArgs:
    tensor: torch.Tensor
    root: int
    async_op: bool


@dataclass(frozen=True, slots=True)
class AllGatherPreHookArgs:
    input: torch.Tensor
    output: list[torch.Tensor]
    async_op: bool


@dataclass(frozen=True, slots=True)
class AllGatherVPreHookArgs:
    input: torch.Tensor
    output: list[torch.Tensor]
    async_op: bool


@dataclass(frozen=True, slots=True)
class AllGatherSinglePreHookArgs:
    input: torch.Tensor
    output: torch.Tensor
    async_op: bool


@dataclass(frozen=True, slots=True)
class ReduceScatterPreHookArgs:
    input: list[torch.Tensor]
    output: torch.Tensor
    async_op: bool


@dataclass(frozen=True, slots=True)
class ReduceScatterVPreHookArgs:
    input: list[torch.Tensor]
    output: torch.Tensor
    async_op: bool


@dataclass(frozen=True, slots=True)
class ReduceScatterSinglePreHookArgs:
    input: torch.Tensor
    output: torch.Tensor
    async_op: bool


@dataclass(frozen=True, slots=True)
class AllToAllSinglePreHookArgs:
    input: torch.Tensor
    output: torch.Tensor
    async_op: bool


@dataclass(frozen=True, slots=True)
class AllToAllVSinglePreHookArgs:
    input: torch.Tensor
    output: torch.Tensor
    input_split_sizes: list[int]
    output_split_sizes: list[int]
    async_op: bool


@dataclass(frozen=True, slots=True)
class AllToAllPreHookArgs:
    input: list[torch.Tensor]
    output: list[torch.Tensor]
    async_op: bool


@dataclass(frozen=True, slots=True)
class BarrierPreHookArgs:
    async_op: bool


@dataclass(frozen=True, slots=True)
class ScatterPreHookArgs:
    output: torch.Tensor
    input: list[torch.Tensor]
    root: int
    async_op: bool


@dataclass(frozen=True, slots=True)
class GatherPreHookArgs:
    input: torch.Tensor
    output: list[torch.Tensor]
    root: int
    async_op: bool


@dataclass(frozen=True, slots=True)
class GatherSinglePreHookArgs:
    input: torch.Tensor
    output: torch.Tensor
    root: int
    async_op: bool


@dataclass(frozen=True, slots=True)
class SplitPreHookArgs:
    ranks: list[int]
    name: str


@dataclass(frozen=True, slots=True)
class NewWindowPreHookArgs:
    pass


@dataclass(frozen=True, slots=True)
class BatchOpIssuePreHookArgs:
    num_ops: int
    async_op: bool


@dataclass(frozen=True, slots=True)
class FinalizePreHookArgs:
    pass


@dataclass(frozen=True, slots=True)
class CollectivePostHookArgs:
    """Post-hook argument of every collective and p2p op; ``work`` is the returned work."""

    work: Any = None


@dataclass(frozen=True, slots=True)
class SplitPostHookArgs:
    """Post-hook argument of ``split``; ``new_comm`` is the child communicator."""

    new_comm: Any = None


@dataclass(frozen=True, slots=True)
class NewWindowPostHookArgs:
    window: Any = None


@dataclass(frozen=True, slots=True)
class BatchOpIssuePostHookArgs:
    work: Any = None


@dataclass(frozen=True, slots=True)
class FinalizePostHookArgs:
    pass


PRE_HOOK_ARG_TYPES = (
    SendPreHookArgs,
    RecvPreHookArgs,
    BroadcastPreHookArgs,
    AllReducePreHookArgs,
    ReducePreHookArgs,
    AllGatherPreHookArgs,
    AllGatherVPreHookArgs,
    AllGatherSinglePreHookArgs,
    ReduceScatterPreHookArgs,
    ReduceScatterVPreHookArgs,
    ReduceScatterSinglePreHookArgs,
    AllToAllSinglePreHookArgs,
    AllToAllVSinglePreHookArgs,
    AllToAllPreHookArgs,
    BarrierPreHookArgs,
    ScatterPreHookArgs,
    GatherPreHookArgs,
    GatherSinglePreHookArgs,
    SplitPreHookArgs,
    NewWindowPreHookArgs,
    BatchOpIssuePreHookArgs,
    FinalizePreHookArgs,
)
