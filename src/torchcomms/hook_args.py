"""Typed, read-only argument objects handed to pre- and post-hooks (upstream's names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class SendPreHookArgs:
    tensor: torch.Tensor
    peer: int
    async_op: bool


@dataclass(frozen=True)
class RecvPreHookArgs:
    tensor: torch.Tensor
    peer: int
    async_op: bool


@dataclass(frozen=True)
class BroadcastPreHookArgs:
    tensor: torch.Tensor
    root: int
    async_op: bool


@dataclass(frozen=True)
class AllReducePreHookArgs:
    tensor: torch.Tensor
    async_op: bool


@dataclass(frozen=True)
class ReducePreHookArgs:
    tensor: torch.Tensor
    root: int
    async_op: bool


@dataclass(frozen=True)
class AllGatherPreHookArgs:
    input: torch.Tensor
    output: list[torch.Tensor]
    async_op: bool


@dataclass(frozen=True)
class AllGatherVPreHookArgs:
    input: torch.Tensor
    output: list[torch.Tensor]
    async_op: bool


@dataclass(frozen=True)
class AllGatherSinglePreHookArgs:
    input: torch.Tensor
    output: torch.Tensor
    async_op: bool


@dataclass(frozen=True)
class ReduceScatterPreHookArgs:
    input: list[torch.Tensor]
    output: torch.Tensor
    async_op: bool


@dataclass(frozen=True)
class ReduceScatterVPreHookArgs:
    input: list[torch.Tensor]
    output: torch.Tensor
    async_op: bool


@dataclass(frozen=True)
class ReduceScatterSinglePreHookArgs:
    input: torch.Tensor
    output: torch.Tensor
    async_op: bool


@dataclass(frozen=True)
class AllToAllSinglePreHookArgs:
    input: torch.Tensor
    output: torch.Tensor
    async_op: bool


@dataclass(frozen=True)
class AllToAllVSinglePreHookArgs:
    input: torch.Tensor
    output: torch.Tensor
    input_split_sizes: list[int]
    output_split_sizes: list[int]
    async_op: bool


@dataclass(frozen=True)
class AllToAllPreHookArgs:
    input: list[torch.Tensor]
    output: list[torch.Tensor]
    async_op: bool


@dataclass(frozen=True)
class BarrierPreHookArgs:
    async_op: bool


@dataclass(frozen=True)
class ScatterPreHookArgs:
    output: torch.Tensor
    input: list[torch.Tensor]
    root: int
    async_op: bool


@dataclass(frozen=True)
class GatherPreHookArgs:
    input: torch.Tensor
    output: list[torch.Tensor]
    root: int
    async_op: bool


@dataclass(frozen=True)
class GatherSinglePreHookArgs:
    input: torch.Tensor
    output: torch.Tensor
    root: int
    async_op: bool


@dataclass(frozen=True)
class SplitPreHookArgs:
    ranks: list[int]
    name: str


@dataclass(frozen=True)
class NewWindowPreHookArgs:
    pass


@dataclass(frozen=True)
class BatchOpIssuePreHookArgs:
    num_ops: int
    async_op: bool


@dataclass(frozen=True)
class FinalizePreHookArgs:
    pass


@dataclass(frozen=True)
class CollectivePostHookArgs:
    """Post-hook argument of every collective and p2p op; ``work`` is the returned work."""

    work: Any = None


@dataclass(frozen=True)
class SplitPostHookArgs:
    """Post-hook argument of ``split``; ``new_comm`` is the child communicator."""

    new_comm: Any = None


@dataclass(frozen=True)
class NewWindowPostHookArgs:
    window: Any = None


@dataclass(frozen=True)
class BatchOpIssuePostHookArgs:
    work: Any = None


@dataclass(frozen=True)
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
