"""Hierarchical placement of the ``gloo`` CPU backend: shm inside each host, gloo between.

Issue 5, scope item 4. Hosts are simulated with ``TORCHCOMM_HOST_ID``: every rank sets it
inside the rank function before ``new_comm`` (and restores it after), so one machine plays
2 hosts x 2 ranks (blocked ``h0 h0 h1 h1`` and interleaved ``h0 h1 h0 h1`` placements) or
2 + 1 ranks (uneven). Covered:

* how members are grouped into hosts, and the switch-size setting (no processes needed);
* the communicator says how it moves bytes (``transport`` starts with ``hierarchical``);
* ``all_reduce`` for every dtype and every reduce op that applies to it, at sizes on both
  sides of the leader/sharded switch (``hier_small_max``), with and without padding to a
  multiple of the ranks per host, and across shm chunk boundaries (small ``shm_slot_bytes``):
  equal bit for bit to an independent reference (integer-valued data, wide dtypes) and to a
  ``transport=tcp`` communicator over the same ranks;
* ``broadcast`` (every root) and ``barrier``, which also run hierarchically; async work;
  the ops that stay on the global gloo group (reduce, all_gather_single,
  reduce_scatter_single, all_to_all_single, send/recv); a split spanning 2 + 1 ranks;
* a rank that never joins: the others raise typed errors (the shm wait names the missing
  comm rank) within the op timeout, and the communicator is poisoned afterwards;
* where the runner is root and ``ip netns`` works (``@pytest.mark.netns``): two network
  namespaces joined by a veth pair play the hosts, with gloo bound to each namespace's
  address via ``TORCHCOMM_GLOO_HOSTNAME`` (``netns_hier_checks``, run by the hierarchical
  trial of ``tests/chaos/test_netns.py`` before its fault, in the same processes).

``python -m tests.test_shm_hier`` (not a test) measures hierarchical all_reduce against the
plain tcp path on the simulated 2 x 2 world and prints a table.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import pytest
import torch

from tests.harness import RankContext, run_ranks
from tests.reference import ALL_DTYPES, ALL_REDS, make_reduce_op, reds_for, reduce_ref
from torchcomms import (
    CommTimeoutError,
    PeerFailureError,
    ReduceOp,
    TorchComm,
    config,
    new_comm,
)
from torchcomms.backends.cpu.hier import ops as hier

CPU = torch.device("cpu")
TIMEOUT = 120.0
COMM_TIMEOUT = timedelta(seconds=60)

BLOCKED = ("h0", "h0", "h1", "h1")
INTERLEAVED = ("h0", "h1", "h0", "h1")
UNEVEN = ("h0", "h0", "h1")


#: Hints of the hierarchical comms: library defaults (leader-based up to 1 MiB), a 64 KiB
#: switch, and a tiny switch with tiny shm slots (the sharded path across chunk boundaries).
DEFAULT_HINTS: dict[str, str] = {}
SWITCH_64K_HINTS = {"hier_small_max": "64K"}
TINY_HINTS = {"hier_small_max": "256", "shm_slot_bytes": "8192"}
#: Element counts: odd (padding); 70001 is above 64 KiB even for 1-byte dtypes.
DEFAULT_SIZES = (1, 7, 70001)
SWITCH_64K_SIZES = (7, 70001)
TINY_SIZES = (7, 1001, 5003)


# ------------------------------------------------------------------------------- helpers
@contextlib.contextmanager
def host_id(host: str) -> Iterator[None]:
    """Pretend this process runs on ``host`` while communicators are created."""
    saved = os.environ.get("TORCHCOMM_HOST_ID")
    os.environ["TORCHCOMM_HOST_ID"] = host
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TORCHCOMM_HOST_ID", None)
        else:
            os.environ["TORCHCOMM_HOST_ID"] = saved


def make_comm(
    store: Any, name: str, host: str, hints: dict[str, str], timeout: timedelta = COMM_TIMEOUT
) -> TorchComm:
    with host_id(host):
        return new_comm("gloo", CPU, name=name, store=store, hints=hints, timeout=timeout)


def transport_of(comm: TorchComm) -> str:
    return str(comm.get_backend_impl().transport)  # type: ignore[attr-defined]


def cases(sizes: Sequence[int]) -> list[tuple[torch.dtype, str, int]]:
    """Every dtype with every reduce op the library accepts on it, at every size."""
    return [(dtype, red, n) for dtype in ALL_DTYPES for red in reds_for(dtype) for n in sizes]


def case_seed(dtype: torch.dtype, red: str, numel: int) -> int:
    """The same case gets the same data in every run and on every rank (seeded per rank)."""
    return (ALL_DTYPES.index(dtype) * 16 + ALL_REDS.index(red)) * 1_000_003 + numel


def rank_data(rank: int, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Pseudo-random values in {-1, 0, 1, 2}: sums, products and halves stay exact."""
    gen = torch.Generator().manual_seed(seed * 8 + rank)
    base = torch.randint(-1, 3, (numel,), generator=gen, dtype=torch.int64)
    if dtype is torch.bool:
        return base > 0
    return base.to(dtype)


def reference(red: str, datas: Sequence[torch.Tensor]) -> torch.Tensor:
    """The reduction of every rank's data, computed independently of the library.

    AVG divides the sum in the tensor's dtype, as the library does (sum, then one division).
    """
    dtype = datas[0].dtype
    if red != "AVG":
        return reduce_ref(datas, red, dtype)
    total = reduce_ref(datas, "SUM", dtype)
    if dtype.is_floating_point:
        return total.div_(len(datas))
    return torch.div(total, len(datas), rounding_mode="trunc")


def check_all_reduce(
    comm: TorchComm,
    tcp_results: dict[tuple[torch.dtype, str, int], torch.Tensor],
    tcp: TorchComm,
    rank: int,
    size: int,
    sizes: Sequence[int],
    label: str,
    failures: list[str],
) -> int:
    """Run the dtype x op x size matrix on ``comm``; compare with the reference and tcp."""
    checked = 0
    for dtype, red, n in cases(sizes):
        case = f"{label} all_reduce {red} {dtype} n={n}"
        datas = [rank_data(r, n, dtype, case_seed(dtype, red, n)) for r in range(size)]
        expected = reference(red, datas)
        key = (dtype, red, n)
        if key not in tcp_results:
            flat = datas[rank].clone()
            tcp.all_reduce(flat, make_reduce_op(red), async_op=False)
            tcp_results[key] = flat
        got = datas[rank].clone()
        comm.all_reduce(got, make_reduce_op(red), async_op=False)
        checked += 1
        if not torch.equal(got, expected):
            bad = (got != expected).nonzero()[:3].flatten().tolist()
            failures.append(f"{case}: differs from the reference at {bad}")
        elif not torch.equal(got, tcp_results[key]):
            failures.append(f"{case}: differs from the tcp comm's result")
    return checked


# ------------------------------------------------------------------------- placement
def test_topology_groups_members_by_host_in_order_of_first_appearance() -> None:
    peers = [("b", 10), ("a", 11), ("b", 12), ("a", 13), ("b", 14)]
    topo = hier.topology(peers, 3)
    assert topo.hosts == ((0, 2, 4), (1, 3))
    assert (topo.host, topo.local_rank, topo.local_size, topo.even) == (1, 1, 2, False)
    assert topo.cross_members(0) == [0, 1]
    assert topo.cross_members(2) == [4]
    assert hier.topology(peers[:4], 2).even
    assert hier.wanted(peers)
    assert not hier.wanted([("a", 1), ("b", 2)])  # one member per host: plain gloo
    assert not hier.wanted([("a", 1), ("a", 2)])  # one host: shm


def test_switch_size_hint_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHCOMM_HIER_SMALL_MAX_BYTES", raising=False)
    assert config.hier_small_max(None) == 1 << 20
    assert config.hier_small_max("64K") == 64 << 10
    monkeypatch.setenv("TORCHCOMM_HIER_SMALL_MAX_BYTES", "2M")
    assert config.hier_small_max(None) == 2 << 20
    assert config.hier_small_max("0") == 0  # the hint wins: always sharded
    with pytest.raises(RuntimeError, match=r"Invalid value for hint hier_small_max: 'lots'"):
        config.hier_small_max("lots")


# ------------------------------------------------------------------ all_reduce, 2 x 2 world
def _two_by_two_all_reduce(ctx: RankContext) -> dict[str, Any]:
    rank, size = ctx.rank, ctx.world_size
    failures: list[str] = []
    checked = 0
    transports: dict[str, str] = {}
    tcp = make_comm(ctx.store, "tcp", BLOCKED[rank], {"transport": "tcp"})
    transports["tcp"] = transport_of(tcp)
    tcp_results: dict[tuple[torch.dtype, str, int], torch.Tensor] = {}
    runs = (
        ("blocked", BLOCKED, DEFAULT_HINTS, DEFAULT_SIZES),
        ("blocked-64k", BLOCKED, SWITCH_64K_HINTS, SWITCH_64K_SIZES),
        ("blocked-tiny", BLOCKED, TINY_HINTS, TINY_SIZES),
        ("interleaved", INTERLEAVED, SWITCH_64K_HINTS, SWITCH_64K_SIZES),
    )
    for label, placement, hints, sizes in runs:
        comm = make_comm(ctx.store, label, placement[rank], hints)
        transports[label] = transport_of(comm)
        checked += check_all_reduce(comm, tcp_results, tcp, rank, size, sizes, label, failures)
        comm.finalize()
    tcp.finalize()
    return {"checked": checked, "failures": failures, "transports": transports}


def test_two_hosts_two_ranks_all_reduce_matches_tcp_bit_for_bit() -> None:
    results = run_ranks(_two_by_two_all_reduce, 4, timeout=TIMEOUT)
    per_rank = len(cases(DEFAULT_SIZES)) + 2 * len(cases(SWITCH_64K_SIZES)) + len(cases(TINY_SIZES))
    for rank, res in enumerate(results):
        assert res["failures"] == [], f"rank {rank}: " + "\n".join(res["failures"])
        assert res["checked"] == per_rank, f"rank {rank} checked {res['checked']} cases"
        t = res["transports"]
        assert t["tcp"].startswith("tcp ("), t["tcp"]
        for label in ("blocked", "blocked-64k", "blocked-tiny", "interleaved"):
            assert t[label].startswith("hierarchical: shm inside 2 hosts (2+2 ranks), tcp"), t
        assert "leader-based up to 1048576 B, sharded above" in t["blocked"], t["blocked"]
        assert "leader-based up to 65536 B, sharded above" in t["interleaved"], t
        assert "leader-based up to 256 B, sharded above" in t["blocked-tiny"], t


def _lazy_and_eager(ctx: RankContext) -> dict[str, Any]:
    """Both gloo connect modes: a leader-based and a sharded all_reduce, and a broadcast.

    With lazy gloo the cross group used to share the flat group's device, and torch
    2.13's lazy gloo never completed a second group's first op on one device: the leaders
    waited out the timeout.  A timeout here raises, so the test fails rather than hangs."""
    rank, size = ctx.rank, ctx.world_size
    out: dict[str, Any] = {}
    for lazy in ("true", "false"):
        comm = make_comm(
            ctx.store, f"lazy-{lazy}", BLOCKED[rank], {"lazy": lazy}, timedelta(seconds=20)
        )
        got = [transport_of(comm)]
        for numel in (8, 1 << 19):  # leader-based, then sharded (over 1 MiB of float32)
            t = torch.full((numel,), float(rank + 1))
            comm.all_reduce(t, ReduceOp.SUM, False)
            got.append(bool(torch.all(t == size * (size + 1) / 2)))
        b = torch.full((1000,), float(rank))
        comm.broadcast(b, 3, False)
        got.append(bool(torch.all(b == 3.0)))
        comm.finalize()
        out[lazy] = got
    return out


def test_lazy_and_eager_gloo_hierarchical_ops_complete() -> None:
    for rank, res in enumerate(run_ranks(_lazy_and_eager, 4, timeout=TIMEOUT)):
        for lazy in ("true", "false"):
            transport, *checks = res[lazy]
            assert transport.startswith("hierarchical: shm inside 2 hosts"), (rank, res)
            assert checks == [True, True, True], (rank, lazy, res)


# ------------------------------------------------------ other ops on the hierarchical comm
def _pattern(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return ((torch.arange(numel, dtype=torch.int64) * 7 + rank * 11) % 61).to(dtype)


def _other_ops(ctx: RankContext) -> dict[str, Any]:
    rank, size = ctx.rank, ctx.world_size
    failures: list[str] = []

    def expect(case: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not torch.equal(got, want):
            failures.append(f"{case}: got {got[:8].tolist()} want {want[:8].tolist()}")

    comm = make_comm(ctx.store, "hier", BLOCKED[rank], DEFAULT_HINTS)
    transport = transport_of(comm)
    # broadcast (hierarchical) from every root, both sides of the shm chunk size.
    for dtype in (torch.float32, torch.int8, torch.bool):
        for n in (7, 70001):
            for root in range(size):
                want = _pattern(root, n, dtype)
                t = want.clone() if rank == root else torch.zeros(n, dtype=dtype)
                comm.broadcast(t, root, async_op=False)
                expect(f"broadcast {dtype} n={n} root={root}", t, want)
    # barrier (hierarchical), sync and async
    comm.barrier(async_op=False)
    comm.barrier(async_op=True).wait()
    # async all_reduce: issue several, then wait
    works, tensors = [], []
    for i in range(3):
        t = torch.full((70001 if i == 1 else 5,), rank + i, dtype=torch.int64)
        works.append(comm.all_reduce(t, ReduceOp.SUM, async_op=True))
        tensors.append(t)
    for i, (w, t) in enumerate(zip(works, tensors, strict=True)):
        w.wait()
        expect(f"async all_reduce #{i}", t, torch.full_like(t, sum(r + i for r in range(size))))
    # above the default switch (1 MiB): sharded; not a multiple of the 2 ranks per host
    t = torch.arange(300001, dtype=torch.float32) % 1000 + rank
    comm.all_reduce(t, ReduceOp.SUM, async_op=False)
    expect("sharded all_reduce 1.2 MB", t, (torch.arange(300001) % 1000 * 4.0 + 6).float())
    # ops that stay on the global gloo group
    t = _pattern(rank, 9, torch.int32)
    comm.reduce(t, 3, ReduceOp.SUM, async_op=False)
    if rank == 3:
        expect("reduce", t, sum(_pattern(r, 9, torch.int32) for r in range(size)))
    out = torch.empty(4 * size, dtype=torch.int64)
    comm.all_gather_single(out, torch.arange(4) + 10 * rank, async_op=False)
    expect("all_gather_single", out, torch.cat([torch.arange(4) + 10 * r for r in range(size)]))
    inp = torch.arange(3 * size, dtype=torch.float32) * (rank + 1)
    rs = torch.empty(3, dtype=torch.float32)
    comm.reduce_scatter_single(rs, inp, ReduceOp.MAX, async_op=False)
    expect("reduce_scatter_single", rs, torch.arange(3 * rank, 3 * rank + 3) * float(size))
    a2a = torch.empty(2 * size, dtype=torch.int64)
    comm.all_to_all_single(a2a, torch.arange(2 * size) + 100 * rank, async_op=False)
    expect(
        "all_to_all_single",
        a2a,
        torch.cat([torch.arange(2 * rank, 2 * rank + 2) + 100 * r for r in range(size)]),
    )
    got = torch.zeros(6, dtype=torch.int64)
    send = comm.send(torch.full((6,), rank), (rank + 1) % size, async_op=True)
    comm.recv(got, (rank - 1) % size, async_op=False)
    send.wait()
    expect("send/recv ring", got, torch.full((6,), (rank - 1) % size))
    # a split over hosts of 2 + 1 members is hierarchical too
    with host_id(BLOCKED[rank]):
        sub = comm.split([0, 1, 2] if rank < 3 else [], "sub3")
    sub_transport = None
    if sub is not None:
        sub_transport = transport_of(sub)
        for n in (7, 70001):
            t = torch.full((n,), rank + 1, dtype=torch.int32)
            sub.all_reduce(t, ReduceOp.SUM, async_op=False)
            expect(f"split all_reduce n={n}", t, torch.full((n,), 6, dtype=torch.int32))
        sub.finalize()
    comm.finalize()
    return {"failures": failures, "transport": transport, "sub_transport": sub_transport}


def test_broadcast_barrier_and_global_gloo_ops_on_a_hierarchical_comm() -> None:
    results = run_ranks(_other_ops, 4, timeout=TIMEOUT)
    for rank, res in enumerate(results):
        assert res["failures"] == [], f"rank {rank}: " + "\n".join(res["failures"])
        assert res["transport"].startswith("hierarchical: shm inside 2 hosts (2+2 ranks)")
        if rank < 3:
            assert res["sub_transport"].startswith("hierarchical: shm inside 2 hosts (2+1 ranks)")


# ---------------------------------------------------------------- uneven placement (2 + 1)
def _uneven(ctx: RankContext) -> dict[str, Any]:
    rank, size = ctx.rank, ctx.world_size
    failures: list[str] = []
    checked = 0
    transports: dict[str, str] = {}
    tcp = make_comm(ctx.store, "tcp", UNEVEN[rank], {"transport": "tcp"})
    tcp_results: dict[tuple[torch.dtype, str, int], torch.Tensor] = {}
    runs = (("uneven", DEFAULT_HINTS, DEFAULT_SIZES), ("uneven-tiny", TINY_HINTS, TINY_SIZES))
    for label, hints, sizes in runs:
        comm = make_comm(ctx.store, label, UNEVEN[rank], hints)
        transports[label] = transport_of(comm)
        checked += check_all_reduce(comm, tcp_results, tcp, rank, size, sizes, label, failures)
        for root in range(size):
            want = _pattern(root, 5003, torch.int64)
            t = want.clone() if rank == root else torch.zeros_like(want)
            comm.broadcast(t, root, async_op=False)
            if not torch.equal(t, want):
                failures.append(f"{label} broadcast root={root}")
        comm.barrier(async_op=False)
        comm.finalize()
    tcp.finalize()
    return {"checked": checked, "failures": failures, "transports": transports}


def test_uneven_placement_two_plus_one_all_reduce_matches_tcp() -> None:
    results = run_ranks(_uneven, 3, timeout=TIMEOUT)
    per_rank = len(cases(DEFAULT_SIZES)) + len(cases(TINY_SIZES))
    for rank, res in enumerate(results):
        assert res["failures"] == [], f"rank {rank}: " + "\n".join(res["failures"])
        assert res["checked"] == per_rank, f"rank {rank} checked {res['checked']} cases"
        for label, text in res["transports"].items():
            assert text.startswith("hierarchical: shm inside 2 hosts (2+1 ranks)"), label
            assert "(uneven hosts)" in text, text


# ------------------------------------------------------------------- a rank that never joins
def _missing_rank(ctx: RankContext) -> dict[str, Any]:
    rank = ctx.rank
    comm = make_comm(ctx.store, "stuck", BLOCKED[rank], DEFAULT_HINTS)
    outcome: dict[str, Any] = {}
    if rank != 3:
        t = torch.ones(7, dtype=torch.float32)
        # Rank 2 (rank 3's host peer) times out first: the others hear its timeout from
        # the transport before their own, and must still name the rank that never entered.
        first = timedelta(seconds=1 if rank == 2 else 3)
        try:
            comm.all_reduce(t, ReduceOp.SUM, async_op=False, timeout=first)
        except (CommTimeoutError, PeerFailureError) as exc:
            outcome = {"type": type(exc).__name__, "message": str(exc)}
        try:
            comm.all_reduce(t, ReduceOp.SUM, async_op=False, timeout=timedelta(seconds=2))
        except (CommTimeoutError, PeerFailureError) as exc:
            outcome["again"] = str(exc)
        ctx.store.set(f"done/{rank}", "1")
    else:  # never calls all_reduce; stays alive until the others have failed
        ctx.store.wait([f"done/{r}" for r in range(3)], timedelta(seconds=60))
    comm.finalize()
    return outcome


def test_a_rank_that_never_joins_makes_the_others_raise_typed_errors() -> None:
    results = run_ranks(_missing_rank, 4, timeout=TIMEOUT)
    # Every rank's header call waits for comm rank 3, which never entered the op.
    for rank in (0, 1, 2):
        got = results[rank]
        assert got["type"] == "CommTimeoutError", got
        assert f"rank={rank}] all_reduce" in got["message"], got
        assert "waiting for peer rank 3, which never entered all_reduce" in got["message"], got
    for rank in (0, 1, 2):
        assert "unusable after an earlier failure" in results[rank]["again"], results[rank]
    assert results[3] == {}


# --------------------------------------------------------- two network namespaces over veth
NETNS_ADDRS = ("10.77.0.1", "10.77.0.2")
NETNS_SIZES = (7, 70001)
NETNS_DTYPES = (torch.float32, torch.bfloat16, torch.int8, torch.bool)


def _netns_cases() -> list[tuple[torch.dtype, str, int]]:
    return [c for c in cases(NETNS_SIZES) if c[0] in NETNS_DTYPES]


def netns_hier_checks(store: Any, rank: int, size: int) -> dict[str, Any]:
    """The hierarchical checks of one rank across two network namespaces (the ``netns`` run).

    Run by ``tests/chaos/test_netns.py``'s hierarchical trial before its fault, in the same
    processes (``ip netns exec NS python -c ...``): every all_reduce case bit for bit against
    an independent reference and a ``transport=tcp`` comm over the same ranks, broadcast from
    every root, barrier, all_gather_single."""
    host = os.environ["TORCHCOMM_HOST_ID"]
    failures: list[str] = []
    tcp = make_comm(store, "tcp", host, {"transport": "tcp"})
    comm = make_comm(store, "hier", host, {"hier_small_max": "4096"})
    checked = 0
    for dtype, red, n in _netns_cases():
        datas = [rank_data(r, n, dtype, case_seed(dtype, red, n)) for r in range(size)]
        want = reference(red, datas)
        flat = datas[rank].clone()
        tcp.all_reduce(flat, make_reduce_op(red), async_op=False)
        got = datas[rank].clone()
        comm.all_reduce(got, make_reduce_op(red), async_op=False)
        checked += 1
        if not (torch.equal(got, want) and torch.equal(got, flat)):
            failures.append(f"all_reduce {red} {dtype} n={n}")
    for root in range(size):
        want = _pattern(root, 70001, torch.float32)
        t = want.clone() if rank == root else torch.zeros_like(want)
        comm.broadcast(t, root, async_op=False)
        if not torch.equal(t, want):
            failures.append(f"broadcast root={root}")
    comm.barrier(async_op=False)
    out = torch.empty(3 * size, dtype=torch.int64)
    comm.all_gather_single(out, torch.arange(3) + 10 * rank, async_op=False)
    if not torch.equal(out, torch.cat([torch.arange(3) + 10 * r for r in range(size)])):
        failures.append("all_gather_single")
    result = {
        "checked": checked,
        "failures": failures,
        "transport": transport_of(comm),
        "tcp_transport": transport_of(tcp),
    }
    comm.finalize()
    tcp.finalize()
    return result


def check_netns_hier_results(results: dict[int, dict[str, Any]]) -> None:
    """What every rank of the netns run must have seen (see ``netns_hier_checks``)."""
    for rank in range(4):
        res = results[rank]
        assert res["failures"] == [], f"rank {rank}: {res['failures']}"
        assert res["checked"] == len(_netns_cases()), res
        addr = NETNS_ADDRS[rank // 2]
        assert res["transport"].startswith("hierarchical: shm inside 2 hosts (2+2 ranks)")
        assert f"hostname='{addr}'" in res["transport"], res["transport"]
        assert res["tcp_transport"].startswith(f"tcp (hostname='{addr}'"), res


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def veth_namespaces() -> Iterator[tuple[str, str]]:
    """Two namespaces joined by a veth pair (10.77.0.1/24 and .2); skip if not possible."""
    if os.geteuid() != 0:
        pytest.skip("needs root for ip netns")
    if shutil.which("ip") is None:
        pytest.skip("the ip command (iproute2) is not installed")
    tag = f"{os.getpid() % 100000}"
    names = (f"tchier{tag}a", f"tchier{tag}b")
    created: list[str] = []
    try:
        for ns in names:
            res = _ip("netns", "add", ns)
            if res.returncode != 0:
                pytest.skip(f"ip netns add failed: {res.stderr.strip()}")
            created.append(ns)
        veth = (f"thv{tag}a", f"thv{tag}b")
        steps = [
            ("link", "add", veth[0], "type", "veth", "peer", "name", veth[1]),
            *[("link", "set", v, "netns", ns) for v, ns in zip(veth, names, strict=True)],
        ]
        for v, ns, addr in zip(veth, names, NETNS_ADDRS, strict=True):
            steps += [
                ("-n", ns, "addr", "add", f"{addr}/24", "dev", v),
                ("-n", ns, "link", "set", v, "up"),
                ("-n", ns, "link", "set", "lo", "up"),
            ]
        for step in steps:
            res = _ip(*step)
            if res.returncode != 0:
                pytest.skip(f"ip {' '.join(step)} failed: {res.stderr.strip()}")
        yield names
    finally:
        for ns in created:
            _ip("netns", "del", ns)  # removes the veth end inside it, and so the pair
        _ip("link", "del", f"thv{tag}a")  # only there if moving it into its namespace failed


def netns_rank_cmd(
    names: tuple[str, str], rank: int, host_id: str, code: str, **extra: str
) -> tuple[list[str], dict[str, str]]:
    """The command and environment of rank ``rank`` of 4, two per namespace (rank // 2)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = rank // 2
    env = dict(os.environ)
    env.update(
        TORCHCOMM_RANK=str(rank),
        TORCHCOMM_SIZE="4",
        TORCHCOMM_HOST_ID=f"{host_id}{h}",
        TORCHCOMM_GLOO_HOSTNAME=NETNS_ADDRS[h],
        PYTHONPATH=os.pathsep.join([os.path.join(repo, "src"), repo]),
        **extra,
    )
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(var, None)
    return ["ip", "netns", "exec", names[h], sys.executable, "-c", code], env


# ------------------------------------------------------------------- measurement (not a test)
BENCH_SIZES = (8, 4 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20)


def _bench(ctx: RankContext, iters_small: int, iters_large: int) -> dict[str, Any]:
    rank = ctx.rank
    comms = {
        "tcp": make_comm(ctx.store, "tcp", BLOCKED[rank], {"transport": "tcp"}),
        "leader": make_comm(ctx.store, "leader", BLOCKED[rank], {"hier_small_max": "1G"}),
        "sharded": make_comm(ctx.store, "sharded", BLOCKED[rank], {"hier_small_max": "0"}),
        "auto": make_comm(ctx.store, "auto", BLOCKED[rank], {}),
    }
    table: dict[str, dict[str, float]] = {}
    for nbytes in BENCH_SIZES:
        t = torch.ones(nbytes // 4, dtype=torch.float32)
        iters = iters_small if nbytes <= 64 << 10 else iters_large
        samples: dict[str, list[float]] = {k: [] for k in comms}
        for _block in range(4):  # alternating blocks, so drift hits every variant alike
            for key, comm in comms.items():
                comm.all_reduce(t, ReduceOp.SUM, async_op=False)  # warm-up
                comm.barrier(async_op=False)
                for _ in range(iters):
                    start = time.perf_counter()
                    comm.all_reduce(t, ReduceOp.SUM, async_op=False)
                    samples[key].append(time.perf_counter() - start)
        table[str(nbytes)] = {k: sorted(v)[len(v) // 2] for k, v in samples.items()}
    for comm in comms.values():
        comm.finalize()
    return table


def main() -> None:
    from tests import harness

    try:
        results = run_ranks(_bench, 4, 25, 3, timeout=1800)
    finally:
        harness.shutdown()
    print("all_reduce float32 SUM, 2 simulated hosts x 2 ranks, p50 per call (rank 0 / rank 2)")
    print(
        f"{'bytes':>10} | {'tcp ms':>14} | {'leader ms':>14} | {'sharded ms':>14} | {'auto ms':>14}"
    )
    for nbytes in BENCH_SIZES:
        cells = []
        for key in ("tcp", "leader", "sharded", "auto"):
            a, b = (results[r][str(nbytes)][key] * 1e3 for r in (0, 2))
            cells.append(f"{a:6.3f} / {b:6.3f}")
        print(f"{nbytes:>10} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
