"""Recovery on the CPU backend: reconfigure, revoke and shrink, on real processes.

* ``reconfigure``: uninitialized until the first call; handles unique per process and
  stable; list order gives ranks, a set the sorted order; shrink, grow, identity, a
  late joiner, after an abort; a reused uuid and bad handles are refused clearly.
* ``revoke``: the revoker's and every other member's next op raise ``CommRevokedError``,
  also a member blocked in an op at the time.
* ``shrink``: after a SIGKILL the survivors agree on the dead rank, also when another
  rank dies during the agreement, and continue on a comm with contiguous ranks.

Each placement runs on one host (shm or tcp) or on simulated hosts (``TORCHCOMM_HOST_ID``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness import RankContext, RankFailure, run_ranks
from torchcomms import (
    CommError,
    CommRevokedError,
    CommStateError,
    CommValidationError,
    PeerFailureError,
    ReduceOp,
    TorchComm,
    new_comm,
)

CPU = torch.device("cpu")
ENV = {"TORCHCOMM_ABORT_ON_ERROR": "0"}

#: (transport hint, simulated host of each rank; empty: one host)
PLACEMENTS = {
    "shm": ("auto", ()),
    "tcp": ("tcp", ()),
    "hier": ("auto", (0, 0, 1, 1)),
}


def _place(ctx: RankContext, hosts: tuple[int, ...]) -> None:
    if hosts:
        os.environ["TORCHCOMM_HOST_ID"] = f"recovery-host-{hosts[ctx.rank]}"


def _sum(comm: TorchComm, value: int) -> int:
    t = torch.full((8,), value, dtype=torch.int64)
    comm.all_reduce(t, ReduceOp.SUM, False)
    return int(t[0])


def _comm(ctx: RankContext, name: str, transport: str, **kwargs: Any) -> TorchComm:
    return new_comm(
        "gloo",
        CPU,
        name=name,
        store=ctx.store,
        timeout=timedelta(seconds=kwargs.pop("timeout_s", 20)),
        hints={"transport": transport},
        **kwargs,
    )


def _exchange(ctx: RankContext, key: str, value: str) -> list[str]:
    ctx.store.set(f"{key}/{ctx.rank}", value)
    return [ctx.store.get(f"{key}/{r}").decode() for r in range(ctx.world_size)]


# -- reconfigure -------------------------------------------------------------------------------
def _reconfigure_cases(ctx: RankContext, transport: str, hosts: tuple[int, ...]) -> dict[str, Any]:
    _place(ctx, hosts)
    me, world = ctx.rank, ctx.world_size
    comm = _comm(ctx, "reconf", transport, timeout_s=30, enable_reconfigure=True)
    with pytest.raises(CommStateError, match=r"reconfigure\(\) has not been called yet"):
        comm.all_reduce(torch.ones(2), ReduceOp.SUM, False)
    handle = comm.get_init_handle()
    assert handle == comm.get_init_handle()
    assert handle.startswith("gloo:-1:-1:"), handle
    handles = _exchange(ctx, "h0", handle)
    assert len(set(handles)) == world, handles  # unique per process

    # Refused arguments leave the comm as it was (uninitialized).
    with pytest.raises(CommValidationError, match="do not include this process"):
        comm.reconfigure(1, [h for h in handles if h != handle] or ["gloo:0:-1:127.0.0.1:1"])
    with pytest.raises(CommValidationError, match="not a gloo init handle"):
        comm.reconfigure(1, [handle, "nccl:0:1:x:1"])
    with pytest.raises(CommValidationError, match="same process more than once"):
        comm.reconfigure(1, [handle, handle])
    with pytest.raises(CommValidationError, match="list or a set"):
        comm.reconfigure(1, handle)  # type: ignore[arg-type]

    # A list: rank = position (here reversed).
    comm.reconfigure(uuid=1, init_handles=list(reversed(handles)), timeout=timedelta(seconds=30))
    assert (comm.get_rank(), comm.get_size()) == (world - 1 - me, world)
    assert _sum(comm, me + 1) == world * (world + 1) // 2
    assert comm.get_init_handle().startswith(f"gloo:{world - 1 - me}:1:")
    with pytest.raises(CommValidationError, match="already used"):
        comm.reconfigure(1, handles)

    # Shrink: the last rank leaves; the others reconfigure without it, it alone.
    if me < world - 1:
        comm.reconfigure(2, handles[:-1])
        assert (comm.get_rank(), comm.get_size()) == (me, world - 1)
        assert _sum(comm, 1) == world - 1
    else:
        comm.reconfigure(2, [handle])
        assert (comm.get_rank(), comm.get_size()) == (0, 1)
        assert _sum(comm, 5) == 5

    # Grow back, as a set: ranks follow the sorted handles, the same on every member.
    fresh = _exchange(ctx, "h3", comm.get_init_handle())
    comm.reconfigure(3, set(fresh))
    order = sorted(fresh)
    assert comm.get_rank() == order.index(fresh[me])
    assert _sum(comm, 2) == 2 * world

    # Identity (same members, new uuid), after an abort: the comm is usable again.
    comm.abort()
    assert comm.is_aborted()
    comm.reconfigure(4, fresh)
    assert not comm.is_aborted()
    assert (comm.get_rank(), comm.get_size()) == (me, world)
    out = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
    comm.all_gather(out, torch.full((2,), me * 10, dtype=torch.int64), False)
    assert [int(o[0]) for o in out] == [r * 10 for r in range(world)]

    # A late joiner: rank 0 leaves for a while and comes back under a later uuid.
    if me == 0:
        comm.reconfigure(5, [fresh[0]])
        ctx.store.set("late/ready", "1")
        ctx.store.wait(["late/others"], timedelta(seconds=30))
        comm.reconfigure(6, fresh)
    else:
        comm.reconfigure(5, fresh[1:])
        assert _sum(comm, 1) == world - 1
        ctx.store.wait(["late/ready"], timedelta(seconds=30))
        ctx.store.set("late/others", "1")
        comm.reconfigure(6, fresh)
    assert _sum(comm, me) == world * (world - 1) // 2
    split = comm.split(list(range(world)), "after_reconf")
    assert split is not None and _sum(split, 1) == world
    split.finalize()
    comm.finalize()
    return {"handle": handle}


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_reconfigure(placement: str) -> None:
    transport, hosts = PLACEMENTS[placement]
    world = len(hosts) or 3
    run_ranks(_reconfigure_cases, world, transport, hosts, timeout=150, env=ENV)


def _launcher_cases(ctx: RankContext, port: int, transport: str) -> str:
    """Under torchrun (its agent serves MASTER_PORT) with no ``store=``: the handles name
    that store, with the launcher rank; upstream's ``[handle] * world_size`` meets by
    arrival, distinct handles by position."""
    me, world = ctx.rank, ctx.world_size
    comm = new_comm(
        "gloo",
        CPU,
        name="launched",
        enable_reconfigure=True,
        timeout=timedelta(seconds=20),
        hints={"transport": transport},
    )
    handle = comm.get_init_handle()
    assert handle == f"gloo:{me}:-1:127.0.0.1:{port}", handle
    comm.reconfigure(uuid=0, init_handles=[handle] * world)  # ReconfigureTest's gloo shape
    got = comm.get_rank()
    assert comm.get_size() == world and 0 <= got < world
    assert _sum(comm, got + 1) == world * (world + 1) // 2
    ranks = _exchange(ctx, "arrival", str(got))
    assert sorted(map(int, ranks)) == list(range(world)), ranks  # a permutation
    send, recv = torch.full((4,), float(got)), torch.zeros(4)
    after, before = (got + 1) % world, (got - 1) % world
    works = [comm.send(send, after, async_op=True), comm.recv(recv, before, async_op=True)]
    for work in works:
        work.wait()
    assert recv.tolist() == [float(before)] * 4

    handles = _exchange(ctx, "positional", comm.get_init_handle())
    assert handles == [f"gloo:{r}:0:127.0.0.1:{port}" for r in range(world)], handles
    comm.reconfigure(1, list(reversed(handles)))  # distinct handles: rank = position
    assert (comm.get_rank(), comm.get_size()) == (world - 1 - me, world)
    assert _sum(comm, me) == world * (world - 1) // 2
    comm.reconfigure(2, [comm.get_init_handle()])  # alone
    assert (comm.get_rank(), comm.get_size(), _sum(comm, 7)) == (0, 1, 7)
    with pytest.raises(CommValidationError, match="same process more than once"):
        comm.reconfigure(3, [handles[me], "gloo:0:-1:10.0.0.9:1", handles[me]])

    # One member more than the handles say: exactly one is told so; the rest connect.
    outcome = "connected"
    try:
        comm.reconfigure(4, [comm.get_init_handle()] * (world - 1))
        assert _sum(comm, 1) == world - 1
    except CommError as exc:
        assert "more processes than the" in str(exc), exc
        outcome = "refused"
    comm.finalize()
    return outcome


@pytest.mark.parametrize("transport", ("auto", pytest.param("tcp", marks=pytest.mark.slow)))
def test_reconfigure_on_torchruns_store(transport: str) -> None:
    from torch.distributed import TCPStore

    agent = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # as the agent's
    env = {
        **ENV,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(agent.port),
    }
    outcomes = run_ranks(_launcher_cases, 3, agent.port, transport, timeout=90, env=env)
    assert sorted(outcomes) == ["connected", "connected", "refused"], outcomes


# -- revoke ------------------------------------------------------------------------------------
def _revoke_cases(ctx: RankContext, transport: str, hosts: tuple[int, ...]) -> dict[str, Any]:
    _place(ctx, hosts)
    me, world = ctx.rank, ctx.world_size
    comm = _comm(ctx, "revoke", transport)
    assert _sum(comm, 1) == world
    seen: dict[str, Any] = {}
    if me == 0:
        time.sleep(0.5)  # the others are blocked in the all_reduce below by now
        comm.revoke()
        with pytest.raises(CommRevokedError, match="rank 0 revoked"):
            comm.barrier(False)
    else:
        start = time.monotonic()
        with pytest.raises(CommRevokedError, match="rank 0 revoked") as info:
            _sum(comm, 1)  # blocked: rank 0 never joins
        seen["blocked_s"] = time.monotonic() - start
        seen["text"] = str(info.value)
        with pytest.raises(CommRevokedError):
            comm.barrier(False)  # the next op too
    # The survivors (everyone) shrink with nobody excluded: a working comm of all.
    again = comm.shrink(name="after_revoke")
    assert (again.get_rank(), again.get_size()) == (me, world)
    assert _sum(again, me) == world * (world - 1) // 2
    again.finalize()
    comm.finalize()
    return seen


@pytest.mark.parametrize("placement", ("shm", "tcp"))
def test_revoke(placement: str) -> None:
    transport, hosts = PLACEMENTS[placement]
    results = run_ranks(_revoke_cases, 3, transport, hosts, timeout=90, env=ENV)
    for rank, seen in enumerate(results[1:], start=1):
        # ~0.5 s of it is rank 0's sleep before revoking: the rest is how fast it spread.
        assert seen["blocked_s"] < 0.5 + 1.0, (rank, seen)


# -- shrink after a kill ------------------------------------------------------------------------
def _shrink_after_kill(
    ctx: RankContext, transport: str, hosts: tuple[int, ...], report_dir: str, second: bool
) -> None:
    """Rank 1 is SIGKILLed; with ``second``, rank 3 dies too, during the agreement."""
    _place(ctx, hosts)
    me, world = ctx.rank, ctx.world_size
    comm = _comm(ctx, "shrink", transport)
    assert _sum(comm, 1) == world
    if me == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    seen: dict[str, Any] = {}
    try:
        _sum(comm, 1)
        seen["first"] = {"type": None}
    except Exception as exc:
        seen["first"] = {"type": type(exc).__name__, "text": str(exc)}
    if second and me == 3:
        os.kill(os.getpid(), signal.SIGKILL)  # before it takes part in the agreement
    start = time.monotonic()
    small = comm.shrink()
    seen["shrink_s"] = time.monotonic() - start
    seen["rank_size"] = [small.get_rank(), small.get_size()]
    t = torch.full((4,), me, dtype=torch.int64)
    small.all_reduce(t, ReduceOp.SUM, False)
    seen["sum"] = int(t[0])
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(small.get_size())]
    small.all_gather(out, torch.tensor([me]), False)
    seen["members"] = [int(o) for o in out]
    Path(report_dir, f"rank{me}.json").write_text(json.dumps(seen))
    small.finalize()
    comm.finalize()


@pytest.mark.parametrize(
    ("placement", "second"),
    (("shm", True), ("tcp", False), ("tcp", True), ("hier", True)),
    ids=("shm-another-during", "tcp-one", "tcp-another-during", "hier-another-during"),
)
def test_shrink_after_kill(placement: str, second: bool, tmp_path: Path) -> None:
    transport, hosts = PLACEMENTS[placement]
    with pytest.raises(RankFailure) as info:
        run_ranks(
            _shrink_after_kill,
            4,
            transport,
            hosts,
            str(tmp_path),
            second,
            timeout=120,
            env=ENV,
        )
    failure = info.value
    dead = {1, 3} if second else {1}
    assert set(failure.died) == dead, str(failure)
    assert not failure.timed_out and not failure.errors, str(failure)
    survivors = [r for r in range(4) if r not in dead]
    for new_rank, rank in enumerate(survivors):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["first"]["type"] == PeerFailureError.__name__, (rank, seen)
        # Rank 3 may already be gone when this rank learns of rank 1: then both are named.
        # A rank that learns it from another ("peer rank 0 reports them dead") says "failed".
        named = re.search(r"peer ranks? ([\d, ]+) (?:died|failed)", seen["first"]["text"])
        assert named is not None, (rank, seen)
        named_ranks = {int(r) for r in named.group(1).split(", ")}
        assert 1 in named_ranks and named_ranks <= dead, (rank, seen)
        assert seen["rank_size"] == [new_rank, len(survivors)], (rank, seen)
        assert seen["sum"] == sum(survivors), (rank, seen)
        assert seen["members"] == survivors, (rank, seen)


# -- the example ---------------------------------------------------------------------------------
# The default run kills a rank and shrinks in this file's tests above and across hosts in
# tests/chaos/test_netns.py; the example's own run (7-8 s) is a longer variant.
@pytest.mark.slow
def test_elastic_shrink_example() -> None:
    """``examples/elastic_shrink.py``: a rank killed mid-training, the survivors finish."""
    repo = Path(__file__).resolve().parent.parent
    args = ["--nproc", "3", "--steps", "6", "--kill-rank", "1", "--kill-step", "3"]
    proc = subprocess.run(
        [sys.executable, "examples/elastic_shrink.py", *args],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "ok: rank 1 was killed at step 3; 2 ranks finished 6 steps" in proc.stdout, proc.stdout
    assert "now rank 1 of 2; redoing step" in proc.stdout, proc.stdout


# -- refused arguments (one process) -------------------------------------------------------------
def test_recovery_arguments_are_refused_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHCOMM_RANK", "0")
    monkeypatch.setenv("TORCHCOMM_SIZE", "1")
    store = torch.distributed.HashStore()
    comm = new_comm("gloo", CPU, name="refusals", store=store, timeout=timedelta(seconds=10))
    with pytest.raises(TypeError, match="exclude_ranks must be a list of int ranks"):
        comm.shrink(exclude_ranks="0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Invalid rank 5 in exclude_ranks"):
        comm.shrink(exclude_ranks=[5])
    with pytest.raises(ValueError, match=r"exclude_ranks holds this rank \(0\)"):
        comm.shrink(exclude_ranks=[0])
    with pytest.raises(TypeError, match="name must be a non-empty str"):
        comm.shrink(name="")
    with pytest.raises(RuntimeError, match="Invalid value for environment variable hint lazy"):
        new_comm(
            "gloo", CPU, name="badlazy", store=store, hints={"lazy": "maybe", "transport": "tcp"}
        )
    alone = comm.shrink()  # nobody failed: a comm of the one member
    assert (alone.get_rank(), alone.get_size()) == (0, 1) and _sum(alone, 3) == 3
    alone.finalize()
    comm.finalize()
    with pytest.raises(CommStateError, match="finalized"):
        comm.revoke()

    re = new_comm("gloo", CPU, name="refusals_re", store=store, enable_reconfigure=True)
    with pytest.raises(CommStateError, match=r"reconfigure\(\) has not been called yet"):
        re.revoke()
    handle = re.get_init_handle()
    with pytest.raises(CommValidationError, match="uuid must be an int"):
        re.reconfigure("1", [handle])  # type: ignore[arg-type]
    with pytest.raises(CommValidationError, match="uuid must be >= 0"):
        re.reconfigure(-1, [handle])
    with pytest.raises(CommValidationError, match="init_handles must not be empty"):
        re.reconfigure(1, [])
    with pytest.raises(CommValidationError, match="must hold str handles"):
        re.reconfigure(1, [handle, 7])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="timeout must be positive"):
        re.reconfigure(1, [handle], timeout=timedelta(0))
    re.reconfigure(1, {handle})
    assert (re.get_rank(), re.get_size()) == (0, 1) and _sum(re, 4) == 4
    re.revoke()
    with pytest.raises(CommRevokedError, match="rank 0 revoked"):
        _sum(re, 1)
    re.reconfigure(2, [re.get_init_handle()])  # a revoked comm reconfigures to a working one
    assert _sum(re, 5) == 5
    re.finalize()
    with pytest.raises(CommStateError, match="finalized"):
        re.reconfigure(3, [handle])
