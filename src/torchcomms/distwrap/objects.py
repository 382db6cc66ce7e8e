"""Object collectives with ``torch.distributed``'s names and signatures.

With ``use_torchcomms=True`` they run ``torchcomms.objcol`` on the group's default
communicator (CPU's when the group has several): payloads are serialised as ``objcol``
does (``TORCHCOMMS_SERIALIZATION``), and every call blocks.  Otherwise each is
``torch.distributed``'s own.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from torchcomms import objcol
from torchcomms.distwrap import registry


def all_gather_object(
    object_list: list[Any], obj: Any, group: dist.ProcessGroup | None = None
) -> None:
    if not registry.torchcomms_is_enabled():
        dist.all_gather_object(object_list, obj, group)
        return
    pg = registry.get_group(group)
    objcol.all_gather_object(registry.default_comm(pg, "all_gather_object"), object_list, obj)


def gather_object(
    obj: Any,
    object_gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: dist.ProcessGroup | None = None,
    group_dst: int | None = None,
) -> None:
    if not registry.torchcomms_is_enabled():
        dist.gather_object(obj, object_gather_list, dst=dst, group=group, group_dst=group_dst)
        return
    pg = registry.get_group(group)
    root = registry.resolve_peer(
        pg, dst, group_dst, ("dst", "group_dst"), "gather_object", default=0
    )
    comm = registry.default_comm(pg, "gather_object")
    objcol.gather_object(comm, obj, root=root, object_gather_list=object_gather_list)


def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int | None = None,
    group: dist.ProcessGroup | None = None,
    group_src: int | None = None,
) -> None:
    if not registry.torchcomms_is_enabled():
        dist.scatter_object_list(
            scatter_object_output_list,
            scatter_object_input_list,
            src=src,
            group=group,
            group_src=group_src,
        )
        return
    pg = registry.get_group(group)
    root = registry.resolve_peer(
        pg, src, group_src, ("src", "group_src"), "scatter_object_list", default=0
    )
    objcol.scatter_object_list(
        registry.default_comm(pg, "scatter_object_list"),
        root=root,
        scatter_object_output_list=scatter_object_output_list,
        scatter_object_input_list=scatter_object_input_list,
    )


def broadcast_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
    group_src: int | None = None,
) -> None:
    if not registry.torchcomms_is_enabled():
        dist.broadcast_object_list(
            object_list, src=src, group=group, device=device, group_src=group_src
        )
        return
    pg = registry.get_group(group)
    root = registry.resolve_peer(
        pg, src, group_src, ("src", "group_src"), "broadcast_object_list", default=0
    )
    comm = registry.default_comm(pg, "broadcast_object_list")
    objcol.broadcast_object_list(comm, object_list, root=root)
