"""Store operations and bytes per rank of ``new_comm`` and ``shrink``, counted
(``TORCHCOMM_STORE_COUNTS=1``).

Whatever the world size, a member makes the same number of store operations and moves
the same bytes, on every transport (over tcp it is told its successor's listeners alone:
the lane's handshakes pass on the rest, ``transport.tcp.meet``): rank 0 reads every member's identity in one ``multi_get`` and answers with one
bundle for all (``cpu.hier.members``), a shrink's agreement is led by its lowest live rank
(``cpu.recovery.agree``).  Rank 0 (the coordinator) is counted apart: its round trips are
constant too, its bytes O(N).  Transports: shm (one host), tcp with gloo's eager and lazy
connect (one rank per simulated host), and hierarchical (two ranks per simulated host;
its shrink is run, not compared: the survivors' hosts differ in shape from N to N).
``check`` calls (how waits poll) depend on timing and are left out.  Counts, never times.
Also the bundle itself (``cpu.hier.members``): a launcher's placement in closed form.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from typing import Any

import pytest
import torch

from tests.harness import RankContext, run_ranks
from torchcomms import ReduceOp, new_comm
from torchcomms.backends.cpu.hier import members
from torchcomms.runtime import store_counts

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
#: The most a member's bytes may differ between world sizes: the digits of ranks, sizes
#: and pids in keys and values.
DIGITS_SLACK = 24
#: What a member's draw in the identity exchange adds (``cpu.hier.leaders``): the first on its
#: host signs it in (an ``add``) and, past one member, summarises it (a ``multi_get`` and
#: a ``multi_set``).
ROLE_OPS = 3
ROLE_BYTES = 64
ENV = {"TORCHCOMM_STORE_COUNTS": "1", "TORCHCOMM_GLOO_HOSTNAME": "127.0.0.1"}


def _count(call: Any) -> tuple[Any, dict[str, int]]:
    before = store_counts.snapshot()
    result = call()
    counted = store_counts.diff(store_counts.snapshot(), before)
    not_ops = ("bytes_in", "bytes_out", "poll_bytes", *store_counts.TIMED_KINDS)
    ops = sum(v for k, v in counted.items() if k not in not_ops)
    moved = counted.get("bytes_in", 0) + counted.get("bytes_out", 0)
    return result, {"ops": ops, "bytes": moved}


def _phases(ctx: RankContext, hints: dict[str, str], per_host: int) -> dict[str, Any]:
    saved = os.environ.get("TORCHCOMM_HOST_ID")
    if per_host:
        os.environ["TORCHCOMM_HOST_ID"] = f"simulated-host-{ctx.rank // per_host}"
    try:
        return _new_comm_and_shrink(ctx, hints)
    finally:
        if saved is None:
            os.environ.pop("TORCHCOMM_HOST_ID", None)
        else:
            os.environ["TORCHCOMM_HOST_ID"] = saved


def _counted_comm(ctx: RankContext, name: str, hints: dict[str, str]) -> tuple[Any, dict[str, int]]:
    """A comm over the world and what its ``new_comm`` cost; checked with one all_reduce."""
    comm, made = _count(
        lambda: new_comm(
            "gloo",
            torch.device("cpu"),
            name=name,
            store=ctx.store,
            timeout=timedelta(seconds=60),
            hints=hints,
        )
    )
    t = torch.ones(4)
    comm.all_reduce(t, ReduceOp.SUM, False)
    assert int(t[0]) == ctx.world_size
    return comm, made


def _new_comm_and_shrink(ctx: RankContext, hints: dict[str, str]) -> dict[str, Any]:
    """``new_comm`` over the world, then every rank but the last shrinks it without it."""
    comm, made = _counted_comm(ctx, "counted", hints)
    out = {"new_comm": {**made, "leads": ctx.rank == 0}}
    out["transport"] = comm.get_backend_impl().transport  # type: ignore[attr-defined]
    last = ctx.world_size - 1
    if ctx.rank != last:
        less, shrunk = _count(lambda: comm.shrink(exclude_ranks=[last], name="less"))
        t = torch.ones(4)
        less.all_reduce(t, ReduceOp.SUM, False)
        assert int(t[0]) == last
        out["shrink"] = {**shrunk, "leads": less.get_rank() == 0}
        less.finalize()
    ctx.store.set(f"shrunk/{ctx.rank}", "1")  # the last rank's comm lives until all shrank
    ctx.store.wait([f"shrunk/{r}" for r in range(ctx.world_size)])
    comm.finalize()
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_store_ops_and_bytes_per_member_do_not_grow_with_the_world(case: str) -> None:
    hints, sizes, per_host = CASES[case]
    got = {n: run_ranks(_phases, n, hints, per_host, timeout=90, env=ENV) for n in sizes}
    for n, results in got.items():
        expected = case.split("_")[0]
        assert all(r["transport"].startswith(expected) for r in results), (n, results)
    # A shrink leaves N - 1 members: of 2 ranks, one (nobody to meet); on two ranks per
    # host, hosts of different sizes, whose leaders' cross-host work differs with the shape
    # (scale_counts.py counts it; here it must work).
    phases = ("new_comm",) if case.startswith("hier") else ("new_comm", "shrink")
    for name in phases:
        size_of = (lambda n: n) if name == "new_comm" else (lambda n: n - 1)
        rows = {
            n: [r[name] for r in results if name in r]
            for n, results in got.items()
            if size_of(n) > 1
        }
        leads = {n: max(r["ops"] for r in rs if r["leads"]) for n, rs in rows.items()}
        ops = {n: [r["ops"] for r in rs if not r["leads"]] for n, rs in rows.items()}
        members = {n: max(counts) for n, counts in ops.items() if counts}
        # Every size the same: rank 0 hears from host leaders, not from every member.  A
        # member's count depends on its draw (``cpu.hier.leaders``: the first on a host signs
        # it in), never on N.
        # Rank 0 reads its host's entries past the first only when there are any.
        assert max(leads.values()) - min(leads.values()) <= 1, (name, rows)
        assert max(members.values()) - min(members.values()) <= ROLE_OPS, (name, rows)
        if case.endswith("eager"):
            continue  # gloo's eager keys hold an address per pair: O(N) bytes per member
        # Bytes: a member reads its bundle and, over tcp, its successor's listeners; never
        # a list of every member, nor of its O(log2 N) lane neighbours.
        moved = {
            n: max(r["bytes"] for r in rs if not r["leads"]) for n, rs in rows.items() if ops[n]
        }
        smallest = min(moved)
        for n, value in moved.items():
            grown = value - moved[smallest]
            assert abs(grown) <= DIGITS_SLACK + ROLE_BYTES, (case, name, moved, n, grown)


def _rank0_apart(ctx: RankContext) -> dict[str, Any]:
    """Rank 0 alone on its simulated host, every other rank on a second one."""
    os.environ["TORCHCOMM_HOST_ID"] = "simulated-host-0" if ctx.rank == 0 else "simulated-host-1"
    try:
        # The comm keeps the given store: the private store's meeting (``bootstrap``) is
        # another step, whose rank 0 reads every join.
        comm, made = _counted_comm(ctx, "apart", {"lazy": "true", "persistent_store": "1"})
        transport = comm.get_backend_impl().transport  # type: ignore[attr-defined]
        comm.finalize()
    finally:
        os.environ.pop("TORCHCOMM_HOST_ID", None)
    return {**made, "transport": transport}


def test_rank_0_hears_from_each_host_leader_not_from_each_member() -> None:
    """``cpu.hier.leaders``: with rank 0 alone on its host and the rest on another, rank 0's
    store round trips and bytes stay the same as that host fills up: it hears from the
    host's leader, never from its members."""
    got = {n: run_ranks(_rank0_apart, n, timeout=90, env=ENV) for n in (3, 4)}
    for results in got.values():
        assert all(r["transport"].startswith("hier") for r in results), results
    rank0 = {n: results[0]["bytes"] for n, results in got.items()}
    assert abs(rank0[4] - rank0[3]) <= DIGITS_SLACK, got
    assert got[3][0]["ops"] == got[4][0]["ops"], got


@pytest.mark.parametrize(
    ("hosts", "kind"),
    [
        ([0, 0, 0, 1, 1, 1, 2, 2, 2], "blocked"),  # torchrun's placement
        ([0, 0, 1, 1, 2], "blocked"),  # a short last host
        ([0, 1, 2, 3], "blocked"),  # a rank per host
        ([0, 0, 0, 0], "blocked"),  # one host
        ([0, 1, 2, 0, 1, 2, 0], "cyclic"),  # round-robin
        ([0, 0, 1, 0, 2, 2, 1], "runs"),  # anything else
    ],
)
def test_a_placement_is_described_in_closed_form_and_read_back(hosts: list[int], kind: str) -> None:
    """What a member's bundle says of where ranks sit: a launcher's placement in O(1)."""
    placement = members.Placement.of(hosts)
    assert placement.kind == kind
    assert placement.hosts(len(hosts)) == hosts
    decoded = members.Placement.decode(placement.encode())
    assert decoded == placement and decoded.hosts(len(hosts)) == hosts
    # A launcher's placement costs the same bytes at any size (digits aside).
    if kind != "runs":
        n, count = len(hosts) * 1000, max(hosts) + 1
        big = [h for h in hosts for _ in range(1000)]
        if kind == "cyclic":
            big = [r % count for r in range(n)]
        assert members.Placement.of(big).kind == kind
        assert len(str(members.Placement.of(big).encode())) <= len(str(placement.encode())) + 4


def test_a_member_learns_its_host_from_the_bundle() -> None:
    """The bundle rank 0 writes (``cpu.hier.leaders``): the placement and rank 0's pid, read by
    every member; rank 0's pid is kept only where it shares rank 0's host."""
    placement = members.Placement.of([0, 0, 1, 1, 2, 2])
    bundle = json.dumps({"at": placement.encode(), "p0": 100})
    three = members.from_bundle(3, 6, bundle, 103, "tag")
    assert three.local_ranks() == [2, 3] and three.pids == {3: 103}  # rank 0 lives elsewhere
    assert three.peers()[2:4] == [("host1", 0), ("host1", 103)]
    assert three.leaders() == [(0, 2), (2, 2), (4, 2)] and three.host_tag == "tag"
    one = members.from_bundle(1, 6, bundle, 101)
    assert one.pids == {0: 100, 1: 101}  # rank 0 shares its host: its pid is watched
    cyclic = members.from_bundle(2, 5, '{"at":["cyclic",2],"p0":1}', 7)
    assert cyclic.leaders() == [(0, 3), (1, 2)]
