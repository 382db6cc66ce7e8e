"""Store operations per rank of ``new_comm``, counted (``TORCHCOMM_STORE_COUNTS=1``).

O(1) store round trips per rank on every transport: whatever the world size, each member
does the same number of store operations, rank 0 included (it gathers what the members
publish with one ``multi_get`` and republishes it as one value), so the total is O(N).
Transports: shm (one host), tcp with gloo's eager connect (its full-mesh rendezvous goes
through one gathered value, ``transport.gloo_rendezvous``), tcp with lazy gloo (the
default), and the hierarchical transport (two simulated hosts) with either.  ``check``
calls (how waits poll) and liveness publishes (periodic) depend on timing and are left
out.  Counts, never times.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import pytest
import torch

from tests.harness import RankContext, run_ranks
from torchcomms import ReduceOp, new_comm, store_counts

#: transport -> (hints, world sizes, whether ranks play two hosts).
CASES: dict[str, tuple[dict[str, str], tuple[int, ...], bool]] = {
    "shm": ({"transport": "auto"}, (2, 3, 4), False),
    "tcp_eager": ({"transport": "tcp", "lazy": "false"}, (2, 3, 4), False),
    "tcp_lazy": ({"transport": "tcp", "lazy": "true"}, (2, 3, 4), False),
    # 2 + 2 and 3 + 3 ranks: hierarchical (shm inside each half, gloo between).
    "hierarchical_lazy": ({"transport": "auto", "lazy": "true"}, (4, 6), True),
    "hierarchical_eager": ({"transport": "auto", "lazy": "false"}, (4, 6), True),
}


def _new_comm_ops(ctx: RankContext, hints: dict[str, str], two_hosts: bool) -> dict[str, Any]:
    saved = os.environ.get("TORCHCOMM_HOST_ID")
    if two_hosts:
        os.environ["TORCHCOMM_HOST_ID"] = f"simulated-host-{ctx.rank * 2 // ctx.world_size}"
    try:
        before = store_counts.snapshot()
        comm = new_comm(
            "gloo",
            torch.device("cpu"),
            name="counted",
            store=ctx.store,
            timeout=timedelta(seconds=60),
            hints=hints,
        )
        counted = store_counts.diff(store_counts.snapshot(), before)
    finally:
        if saved is None:
            os.environ.pop("TORCHCOMM_HOST_ID", None)
        else:
            os.environ["TORCHCOMM_HOST_ID"] = saved
    t = torch.ones(4)
    comm.all_reduce(t, ReduceOp.SUM, False)
    assert int(t[0]) == ctx.world_size
    transport = comm.get_backend_impl().transport  # type: ignore[attr-defined]
    comm.finalize()
    skip = ("check", "liveness", "bytes_in", "bytes_out")  # timing-dependent, or not ops
    ops = sum(v for k, v in counted.items() if k not in skip)
    return {"ops": ops, "transport": transport}


@pytest.mark.parametrize("case", list(CASES))
def test_new_comm_store_ops_per_rank_do_not_grow_with_the_world(case: str) -> None:
    hints, sizes, two_hosts = CASES[case]
    env = {"TORCHCOMM_STORE_COUNTS": "1", "TORCHCOMM_GLOO_HOSTNAME": "127.0.0.1"}
    got = {n: run_ranks(_new_comm_ops, n, hints, two_hosts, timeout=90, env=env) for n in sizes}
    for n, results in got.items():
        expected = case.split("_")[0]
        assert all(r["transport"].startswith(expected) for r in results), (n, results)
    ops = {n: [r["ops"] for r in results] for n, results in got.items()}
    rank0 = {n: counts[0] for n, counts in ops.items()}
    others = {n: max(counts[1:]) for n, counts in ops.items()}
    # Every size the same: rank 0's gathers are one multi_get each, not one get per member.
    assert len(set(rank0.values())) == 1, ops
    assert len(set(others.values())) == 1, ops
