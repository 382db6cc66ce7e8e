"""Store operations per rank of ``new_comm``, counted (``TORCHCOMM_STORE_COUNTS=1``).

The members other than rank 0 must do the same number of store operations whatever the
world size (O(1) round trips each: rank 0 gathers the identities and publishes one
list), and rank 0's count must grow by the same amount per member (O(N) in total).
``check`` calls (how waits poll) depend on timing and are left out.  Counts, never times.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import pytest
import torch

from tests.harness import RankContext, run_ranks
from torchcomms import ReduceOp, new_comm, store_counts


def _new_comm_ops(ctx: RankContext, transport: str, lazy: str) -> int:
    before = store_counts.snapshot()
    comm = new_comm(
        "gloo",
        torch.device("cpu"),
        name="counted",
        store=ctx.store,
        timeout=timedelta(seconds=60),
        hints={"transport": transport, "lazy": lazy},
    )
    counted = store_counts.diff(store_counts.snapshot(), before)
    t = torch.ones(4)
    comm.all_reduce(t, ReduceOp.SUM, False)
    assert int(t[0]) == ctx.world_size
    comm.finalize()
    return sum(v for k, v in counted.items() if k not in ("check", "bytes_in", "bytes_out"))


@pytest.mark.parametrize("transport", ("auto", "tcp"))
def test_new_comm_store_ops_per_rank(transport: str) -> None:
    env = {"TORCHCOMM_STORE_COUNTS": "1"}
    lazy = "true" if transport == "tcp" else "false"  # tcp: gloo pairs connect at first use
    ops: dict[int, list[Any]] = {
        n: run_ranks(_new_comm_ops, n, transport, lazy, timeout=90, env=env) for n in (2, 3, 4)
    }
    others = {n: set(counts[1:]) for n, counts in ops.items()}
    rank0 = {n: counts[0] for n, counts in ops.items()}
    if transport == "auto":
        # One host, shared memory: every other member does the same, at every size, and
        # rank 0, which gathers, the same number more per member (O(N) in total).
        assert others[2] == others[3] == others[4] and len(others[2]) == 1, ops
        assert rank0[4] - rank0[3] == rank0[3] - rank0[2] > 0, ops
    else:
        # rank 0: at most 3 more per member (its gathers, plus its lane neighbours).
        assert 0 < rank0[4] - rank0[2] <= 3 * 2, ops
        # tcp: the lane connects each member to its log2(N) Bruck neighbours through the
        # store; nothing else grows with N.
        for n in (3, 4):
            assert max(others[n]) <= max(others[2]) + math.ceil(math.log2(n)), ops
