"""Store operations per rank of ``new_comm``, counted (``TORCHCOMM_STORE_COUNTS=1``).

O(1) store round trips and bytes per rank on every transport: whatever the world size, each member
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

#: transport -> (hints, world sizes, ranks per simulated host; 0: every rank on this host).
CASES: dict[str, tuple[dict[str, str], tuple[int, ...], int]] = {
    "shm": ({"transport": "auto"}, (2, 3, 4), 0),
    # One rank per host, as tcp runs in a real job (a forced tcp on one host reads its
    # host's pid list: O(ranks on the host), docs/scale.md).
    "tcp_eager": ({"transport": "tcp", "lazy": "false"}, (2, 3, 4), 1),
    "tcp_lazy": ({"transport": "tcp", "lazy": "true"}, (2, 3, 4), 1),
    # 2 + 2 and 2 + 2 + 2 ranks: hierarchical (shm inside each host, gloo between).
    "hierarchical_lazy": ({"transport": "auto", "lazy": "true"}, (4, 6), 2),
    "hierarchical_eager": ({"transport": "auto", "lazy": "false"}, (4, 6), 2),
}
#: The most a member's bytes may differ between world sizes besides its lane addresses:
#: the digits of ranks, sizes and pids in keys and values.
DIGITS_SLACK = 24
#: The most a doubling of N adds to a member's bundle of neighbours: one lane neighbour's
#: address and one census child's (``"5":"<16 hex> <port> <host>"`` each).
NEIGHBOURS_PER_DOUBLING_MAX = 2 * 44


def _new_comm_ops(ctx: RankContext, hints: dict[str, str], per_host: int) -> dict[str, Any]:
    saved = os.environ.get("TORCHCOMM_HOST_ID")
    if per_host:
        os.environ["TORCHCOMM_HOST_ID"] = f"simulated-host-{ctx.rank // per_host}"
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
    not_ops = ("bytes_in", "bytes_out", "poll_bytes", *store_counts.TIMED_KINDS)
    ops = sum(v for k, v in counted.items() if k not in not_ops)
    moved = counted.get("bytes_in", 0) + counted.get("bytes_out", 0)
    return {"ops": ops, "bytes": moved, "transport": transport}


def _lane_rounds(n: int) -> int:
    return (n - 1).bit_length()


@pytest.mark.parametrize("case", list(CASES))
def test_new_comm_store_ops_and_bytes_per_rank_do_not_grow_with_the_world(case: str) -> None:
    hints, sizes, per_host = CASES[case]
    env = {"TORCHCOMM_STORE_COUNTS": "1", "TORCHCOMM_GLOO_HOSTNAME": "127.0.0.1"}
    got = {n: run_ranks(_new_comm_ops, n, hints, per_host, timeout=90, env=env) for n in sizes}
    for n, results in got.items():
        expected = case.split("_")[0]
        assert all(r["transport"].startswith(expected) for r in results), (n, results)
    ops = {n: [r["ops"] for r in results] for n, results in got.items()}
    rank0 = {n: counts[0] for n, counts in ops.items()}
    others = {n: max(counts[1:]) for n, counts in ops.items()}
    # Every size the same: rank 0's gathers are one multi_get each, not one get per member.
    assert len(set(rank0.values())) == 1, ops
    assert len(set(others.values())) == 1, ops
    if case.endswith("eager"):
        return  # gloo's eager keys hold an address per pair: O(N) bytes per member
    # Bytes: a member reads its bundle, never a list of every member; over tcp it is also
    # given its neighbours' addresses (the lane's and the census tree's, O(log2 N) of
    # them); nothing else grows.
    moved = {n: max(r["bytes"] for r in results[1:]) for n, results in got.items()}
    lane = 0 if case == "shm" else NEIGHBOURS_PER_DOUBLING_MAX
    smallest = min(sizes)
    for n in sizes:
        grown = moved[n] - moved[smallest]
        allowed = DIGITS_SLACK + lane * (_lane_rounds(n) - _lane_rounds(smallest))
        assert abs(grown) <= allowed, (case, moved, {"n": n, "grown": grown, "allowed": allowed})
