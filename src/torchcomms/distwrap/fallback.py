"""The pass-through path's stand-ins for what torch's gloo refuses.

* ``all_gather_uneven``: an all_gather whose outputs differ in size (gloo requires equal
  sizes), as one batch of point-to-point transfers on the same group;
* ``split_by_new_group``: ``split_group`` where torch cannot split (gloo, or no ``device_id``
  at init): the split lists are gathered on the parent and every parent member creates every
  listed group with ``new_group``, in the same order, as torch requires of ``new_group``.

Both run torch.distributed's own calls on the caller's thread.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torchcomms.distwrap import env, registry


def backend_of(group: dist.ProcessGroup | None, tensor: torch.Tensor) -> str:
    """The backend name torch uses for ``tensor``'s device in ``group``."""
    pg = registry.get_group(group)
    found = registry.info(pg)
    device = tensor.device.type
    if found is not None and device in found.device_backends:
        return found.device_backends[device]
    name = str(dist.get_backend(pg))
    if ":" in name:
        return env.parse_backend_string(name).get(device, "")
    return name


def all_gather_uneven(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    async_op: bool,
) -> dist.Work | None:
    """``all_gather`` of differently sized outputs over send/recv."""
    pg = registry.get_group(group)
    me = dist.get_rank(pg)
    size = dist.get_world_size(pg)
    if len(tensor_list) != size:
        raise ValueError(
            f"all_gather: tensor_list has {len(tensor_list)} tensors for a group of {size}"
        )
    tensor_list[me].copy_(tensor)
    ops = []
    for peer in range(size):
        if peer == me:
            continue
        ops.append(dist.P2POp(dist.irecv, tensor_list[peer], group=pg, group_peer=peer))
        ops.append(dist.P2POp(dist.isend, tensor, group=pg, group_peer=peer))
    if not ops:
        return None
    works = dist.batch_isend_irecv(ops)
    for work in works[:-1]:
        work.wait()
    if async_op:
        return works[-1]
    works[-1].wait()
    return None


def split_by_new_group(
    parent: dist.ProcessGroup,
    my_group: list[int] | None,
    timeout: timedelta | None,
    pg_options: Any,
    group_desc: str | None,
) -> dist.ProcessGroup | None:
    """This rank's group (``None`` if it is in none); ``my_group`` holds parent ranks."""
    me = dist.get_rank(parent)
    # The smallest member of each group speaks for it, so each group is listed once.
    mine = my_group if my_group is not None and me == min(my_group) else None
    gathered: list[list[int] | None] = [None] * dist.get_world_size(parent)
    dist.all_gather_object(gathered, mine, group=parent)
    to_global = list(dist.get_process_group_ranks(parent))
    result: dist.ProcessGroup | None = None
    for ranks in (r for r in gathered if r is not None):
        pg = dist.new_group(
            ranks=[to_global[r] for r in ranks],
            timeout=timeout,
            pg_options=pg_options,
            group_desc=group_desc,
        )
        if my_group is not None and me in ranks:
            result = pg
    return result
