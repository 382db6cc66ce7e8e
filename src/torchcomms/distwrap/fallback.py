"""Stand-ins, made of torch.distributed's simpler calls, for what torch's gloo refuses.

Upstream's ``fallback``; the pass-through path (``use_torchcomms=False``) uses them:

* ``fallback_split_group_new_group``: ``split_group`` where torch cannot split (gloo, or no
  ``device_id`` at init): the split lists are gathered on the parent and every parent member
  creates every listed group with ``new_group``, in the same order, as torch requires;
* ``fallback_all_gather_gloo``: an all_gather of differently sized outputs;
* ``fallback_all_to_all_gloo`` / ``fallback_all_to_all_single_gloo``: all_to_all as one batch
  of point-to-point transfers.

Ranks are group ranks of ``pg`` / ``parent_pg`` throughout (list index ``i`` is group rank
``i``).  Everything runs torch.distributed's own calls on the caller's thread.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def _split_by_new_group(
    parent_pg: ProcessGroup,
    my_group_ranks: list[int] | None,
    timeout: timedelta | None,
    pg_options: Any | None,
    group_desc: str | None,
) -> ProcessGroup | None:
    """This rank's group, or ``None`` on a rank in none (``my_group_ranks`` is ``None``)."""
    me = dist.get_rank(parent_pg)
    # The smallest member of each group speaks for it, so each group is listed once.
    mine = my_group_ranks if my_group_ranks and me == min(my_group_ranks) else None
    gathered: list[list[int] | None] = [None] * dist.get_world_size(parent_pg)
    dist.all_gather_object(gathered, mine, group=parent_pg)
    to_global = list(dist.get_process_group_ranks(parent_pg))
    result: ProcessGroup | None = None
    for ranks in (r for r in gathered if r is not None):
        pg = dist.new_group(
            ranks=[to_global[r] for r in ranks],
            timeout=timeout,
            pg_options=pg_options,
            group_desc=group_desc,
        )
        if my_group_ranks and me in ranks:
            result = pg
    return result


def fallback_split_group_new_group(
    parent_pg: ProcessGroup,
    my_group_ranks: list[int],
    timeout: timedelta | None,
    pg_options: Any | None,
    group_desc: str | None,
) -> ProcessGroup:
    """``split_group`` by ``new_group``: this rank's group (``my_group_ranks``: parent ranks).

    Every rank of ``parent_pg`` calls it; each passes the list it belongs to.
    """
    new_pg = _split_by_new_group(parent_pg, my_group_ranks, timeout, pg_options, group_desc)
    if new_pg is None:
        raise AssertionError("Failed to create process group for this rank")
    return new_pg


def fallback_all_gather_gloo(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    pg: ProcessGroup,
    async_op: bool,
) -> dist.Work | None:
    """``all_gather`` whose outputs may differ in size: ``tensor`` goes to every rank."""
    return fallback_all_to_all_gloo(tensor_list, [tensor] * len(tensor_list), pg, async_op)


def fallback_all_to_all_gloo(
    output_tensor_list: list[torch.Tensor],
    input_tensor_list: list[torch.Tensor],
    pg: ProcessGroup,
    async_op: bool,
) -> dist.Work | None:
    """``all_to_all`` over point-to-point transfers; a work to wait on if ``async_op``.

    Entry ``i`` of ``input_tensor_list`` goes to group rank ``i``, whose data lands in
    ``output_tensor_list[i]``."""
    me = dist.get_rank(pg)
    size = dist.get_world_size(pg)
    for name, tensors in (("outputs", output_tensor_list), ("inputs", input_tensor_list)):
        if len(tensors) != size:
            raise ValueError(f"{len(tensors)} {name} given for a group of {size} ranks")
    output_tensor_list[me].copy_(input_tensor_list[me])
    ops = []
    for peer in range(size):
        if peer == me:
            continue
        ops.append(dist.P2POp(dist.irecv, output_tensor_list[peer], group=pg, group_peer=peer))
        ops.append(dist.P2POp(dist.isend, input_tensor_list[peer], group=pg, group_peer=peer))
    if not ops:
        return None
    works = dist.batch_isend_irecv(ops)
    for work in works[:-1]:
        work.wait()
    if async_op:
        return works[-1]
    works[-1].wait()
    return None


def _chunks(t: torch.Tensor, sizes: list[int] | None, n: int, what: str) -> list[torch.Tensor]:
    rows = t.shape[0] if t.dim() > 0 else t.numel()
    if sizes is None:
        if rows % n:
            raise ValueError(
                f"all_to_all_single: {what} has {rows} rows, which do not split evenly across "
                f"{n} ranks (pass {what}_split_sizes)"
            )
        sizes = [rows // n] * n
    if len(sizes) != n or sum(sizes) != rows:
        raise ValueError(
            f"all_to_all_single: {what}_split_sizes {list(sizes)} must have {n} entries that "
            f"add up to the {rows} rows of {what}"
        )
    return list(torch.split(t if t.dim() > 0 else t.reshape(-1), list(sizes)))


def fallback_all_to_all_single_gloo(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None,
    input_split_sizes: list[int] | None,
    pg: ProcessGroup,
    async_op: bool,
) -> dist.Work | None:
    """``all_to_all_single`` over point-to-point transfers (``None`` sizes: equal rows)."""
    n = dist.get_world_size(pg)
    outs = _chunks(output, output_split_sizes, n, "output")
    ins = [c.contiguous() for c in _chunks(input, input_split_sizes, n, "input")]
    if not all(o.is_contiguous() for o in outs):
        raise ValueError("all_to_all_single: output must be contiguous")
    return fallback_all_to_all_gloo(outs, ins, pg, async_op)
