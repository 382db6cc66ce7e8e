"""Typed, read-only argument objects handed to pre- and post-hooks (upstream's names).

Post-hooks of collectives and point-to-point get the op's own subclass of
``CollectivePostHookArgs`` (upstream's stub names them; its binding passes the base class,
so ``isinstance(args, CollectivePostHookArgs)`` holds either way).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from torchcomms.optable.spec import Op, OpName


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
class SendPostHookArgs(CollectivePostHookArgs):
    pass


@dataclass(frozen=True, slots=True)
class RecvPostHookArgs(CollectivePostHookArgs):
    pass


@dataclass(frozen=True, slots=True)
class BroadcastPostHookArgs(CollectivePostHookArgs):
    pass


@dataclass(frozen=True, slots=True)
class AllReducePostHookArgs(CollectivePostHookArgs):
    pass


@dataclass(frozen=True, slots=True)
class ReducePostHookArgs(CollectivePostHookArgs):
    pass


@dataclass(frozen=True, slots=True)
class AllGatherPostHookArgs(CollectivePostHookArgs):
    pass


@dataclass(frozen=True, slots=True)
class AllGatherVPostHookArgs(CollectivePostHookArgs):
    pass


@dataclass(frozen=True, slots=True)
class AllGatherSinglePostHookArgs(CollectivePostHookArgs):
    pass


@dataclass(frozen=True, slots=True)
class ReduceScatterPostHookArgs(CollectivePostHookArgs):
    pass


@dataclass(frozen=True, slots=True)
class ReduceScatterVPostHookArgs(CollectivePostHookArgs):
    pass


@dataclass(frozen=True, slots=True)
class ReduceScatterSinglePostHookArgs(CollectivePostHookArgs):
    pass


@dataclass(frozen=True, slots=True)
class AllToAllSinglePostHookArgs(CollectivePostHookArgs):
    pass


@dataclass(frozen=True, slots=True)
class AllToAllVSinglePostHookArgs(CollectivePostHookArgs):
    pass


@dataclass(frozen=True, slots=True)
class AllToAllPostHookArgs(CollectivePostHookArgs):
    pass


@dataclass(frozen=True, slots=True)
class BarrierPostHookArgs(CollectivePostHookArgs):
    pass


@dataclass(frozen=True, slots=True)
class ScatterPostHookArgs(CollectivePostHookArgs):
    pass


@dataclass(frozen=True, slots=True)
class GatherPostHookArgs(CollectivePostHookArgs):
    pass


@dataclass(frozen=True, slots=True)
class GatherSinglePostHookArgs(CollectivePostHookArgs):
    pass


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


def _camel(name: OpName) -> str:
    """As upstream's class names spell an op: ``AllReduce`` for ``all_reduce``."""
    return "".join(w.capitalize() for w in name.name.split("_"))


def pre_hook_class(entry: Op) -> type:
    """The op's pre-hook argument class (``AllReducePreHookArgs`` for ``all_reduce``): the
    one its method in ``optable.methods`` builds, with a field per ``hook`` argument, then
    ``async_op``."""
    found = globals().get(entry.hook_class_name)
    if not isinstance(found, type) or len(fields(found)) != len(entry.hook) + 1:
        raise RuntimeError(
            f"optable: {entry.method} needs hook_args.{entry.hook_class_name} with a field per "
            f"pre-hook argument {entry.hook} and then async_op"
        )
    return found


#: The post-hook argument class of each collective and point-to-point op (upstream's:
#: ``AllReducePostHookArgs`` for ``all_reduce``).
POST_HOOK_ARGS_BY_OP: dict[OpName, type[CollectivePostHookArgs]] = {
    name: found
    for name in OpName
    if isinstance(found := globals().get(_camel(name) + "PostHookArgs"), type)
    and issubclass(found, CollectivePostHookArgs)
}

#: Upstream's stub aliases: what a pre-hook / post-hook may receive.
PreHookArgs = (
    SendPreHookArgs
    | RecvPreHookArgs
    | BroadcastPreHookArgs
    | AllReducePreHookArgs
    | ReducePreHookArgs
    | AllGatherPreHookArgs
    | AllGatherVPreHookArgs
    | AllGatherSinglePreHookArgs
    | ReduceScatterPreHookArgs
    | ReduceScatterVPreHookArgs
    | ReduceScatterSinglePreHookArgs
    | AllToAllSinglePreHookArgs
    | AllToAllVSinglePreHookArgs
    | AllToAllPreHookArgs
    | BarrierPreHookArgs
    | ScatterPreHookArgs
    | GatherPreHookArgs
    | GatherSinglePreHookArgs
    | SplitPreHookArgs
    | NewWindowPreHookArgs
    | BatchOpIssuePreHookArgs
    | FinalizePreHookArgs
)
PostHookArgs = (
    CollectivePostHookArgs
    | SendPostHookArgs
    | RecvPostHookArgs
    | BroadcastPostHookArgs
    | AllReducePostHookArgs
    | ReducePostHookArgs
    | AllGatherPostHookArgs
    | AllGatherVPostHookArgs
    | AllGatherSinglePostHookArgs
    | ReduceScatterPostHookArgs
    | ReduceScatterVPostHookArgs
    | ReduceScatterSinglePostHookArgs
    | AllToAllSinglePostHookArgs
    | AllToAllVSinglePostHookArgs
    | AllToAllPostHookArgs
    | BarrierPostHookArgs
    | ScatterPostHookArgs
    | GatherPostHookArgs
    | GatherSinglePostHookArgs
    | SplitPostHookArgs
    | NewWindowPostHookArgs
    | BatchOpIssuePostHookArgs
    | FinalizePostHookArgs
)

__all__ = [
    "AllGatherPostHookArgs",
    "AllGatherPreHookArgs",
    "AllGatherSinglePostHookArgs",
    "AllGatherSinglePreHookArgs",
    "AllGatherVPostHookArgs",
    "AllGatherVPreHookArgs",
    "AllReducePostHookArgs",
    "AllReducePreHookArgs",
    "AllToAllPostHookArgs",
    "AllToAllPreHookArgs",
    "AllToAllSinglePostHookArgs",
    "AllToAllSinglePreHookArgs",
    "AllToAllVSinglePostHookArgs",
    "AllToAllVSinglePreHookArgs",
    "BarrierPostHookArgs",
    "BarrierPreHookArgs",
    "BatchOpIssuePostHookArgs",
    "BatchOpIssuePreHookArgs",
    "BroadcastPostHookArgs",
    "BroadcastPreHookArgs",
    "CollectivePostHookArgs",
    "FinalizePostHookArgs",
    "FinalizePreHookArgs",
    "GatherPostHookArgs",
    "GatherPreHookArgs",
    "GatherSinglePostHookArgs",
    "GatherSinglePreHookArgs",
    "NewWindowPostHookArgs",
    "NewWindowPreHookArgs",
    "PostHookArgs",
    "PreHookArgs",
    "RecvPostHookArgs",
    "RecvPreHookArgs",
    "ReducePostHookArgs",
    "ReducePreHookArgs",
    "ReduceScatterPostHookArgs",
    "ReduceScatterPreHookArgs",
    "ReduceScatterSinglePostHookArgs",
    "ReduceScatterSinglePreHookArgs",
    "ReduceScatterVPostHookArgs",
    "ReduceScatterVPreHookArgs",
    "ScatterPostHookArgs",
    "ScatterPreHookArgs",
    "SendPostHookArgs",
    "SendPreHookArgs",
    "SplitPostHookArgs",
    "SplitPreHookArgs",
]
