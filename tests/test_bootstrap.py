"""Bootstrap, lifecycle and fault behaviour of ``new_comm("gloo", ...)`` on real processes.

Covers (reference §1.4-1.5, §3, DESIGN "Fault model"):

* store-less bootstrap through ``MASTER_ADDR``/``MASTER_PORT`` (2 and 4 ranks), comms created
  back to back, ``MASTER_PORT`` released after every init, store and store-less comms alive
  together, and the error without ``MASTER_ADDR``;
* an explicit store, non-persistent (bootstrap only) and ``persistent_store``, duplicate names;
* rank/size discovery: ``TORCHCOMM_RANK/SIZE`` before ``RANK/WORLD_SIZE``;
* real ``torchrun`` (``examples/quickstart.py`` and store-less comms under the agent store);
* timeouts (sync, async, per-op), poisoning after a failure, a peer killed mid-job;
* ``finalize`` rules, ``get_init_handle``/``reconfigure``/``abort`` on gloo;
* more ranks than cores.

Rank functions are module-level because the harness pickles them by reference. Each test
makes one ``run_ranks`` call that checks many cases; failure tests come last (a failed run
discards its worker pool) and use ``fresh=True`` so the shared pools survive them.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._C._distributed_c10d import FileStore, PrefixStore, Store

import torchcomms
from tests import harness, shared_jobs
from tests.harness import RankContext, RankFailure, run_ranks, run_torchrun
from torchcomms import (
    CommStateError,
    CommTimeoutError,
    PeerFailureError,
    ReduceOp,
    TorchComm,
    WorkStatus,
    new_comm,
)

CPU = torch.device("cpu")
REPO_ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = REPO_ROOT / "examples" / "quickstart.py"

#: Short comm/op timeout (seconds, before the harness scale) for the fault tests.
FAULT_TIMEOUT_S = 2
#: Per-op timeout of the set-up ops of the fault tests, so a loaded box cannot trip them.
SETUP_TIMEOUT = timedelta(seconds=120)


# ----------------------------------------------------------------------------- helpers


def _gloo(name: str, store: Store | None = None, **kwargs: Any) -> TorchComm:
    return new_comm("gloo", CPU, name=name, store=store, **kwargs)


def _sum_check(comm: TorchComm, scale: int, case: str, timeout: timedelta | None = None) -> None:
    """all_reduce(SUM) of (rank + 1) * scale must give scale * n(n+1)/2 on every rank."""
    n = comm.get_size()
    t = torch.full((16,), (comm.get_rank() + 1) * scale, dtype=torch.int64)
    comm.all_reduce(t, ReduceOp.SUM, False, timeout=timeout)
    expected = torch.full((16,), scale * n * (n + 1) // 2, dtype=torch.int64)
    assert torch.equal(t, expected), f"{case}: all_reduce gave {t.tolist()}"


def _gather_ints(comm: TorchComm, value: int) -> list[int]:
    """Every rank's ``value``, in the comm's rank order."""
    out = torch.zeros(comm.get_size(), dtype=torch.int64)
    comm.all_gather_single(out, torch.tensor([value], dtype=torch.int64), False)
    return [int(v) for v in out.tolist()]


def _nobody_listens(addr: str, port: int) -> bool:
    """True if a TCP connect to ``addr:port`` is refused (no listening socket)."""
    try:
        with socket.create_connection((addr, port), timeout=5.0):
            return False
    except ConnectionRefusedError:
        return True


def _scaled(seconds: float) -> float:
    return seconds * harness.timeout_scale()


def _fault_timeout() -> timedelta:
    return timedelta(seconds=_scaled(FAULT_TIMEOUT_S))


# ----------------------------------------------------------------------------- store-less


def _storeless_cases(ctx: RankContext) -> None:
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    assert (addr, port) == (ctx.master_addr, ctx.master_port), "harness env"

    # Three store-less comms back to back; MASTER_PORT must be free again after each init.
    comms: list[TorchComm] = []
    for i, name in enumerate(("nostore_a", "nostore_b", "nostore_c")):
        comm = _gloo(name)
        assert comm.get_rank() == ctx.rank and comm.get_size() == ctx.world_size, name
        assert comm.get_name() == name
        _sum_check(comm, i + 1, f"store-less comm {name}")
        comm.barrier(False)  # every rank is past init, so rank 0 dropped its bootstrap store
        assert _nobody_listens(addr, port), f"MASTER_PORT {port} still served after {name}"
        comm.barrier(False)  # nobody binds MASTER_PORT for the next comm before all checked
        comms.append(comm)

    # A store comm and another store-less comm alive together with the first three.
    with_store = _gloo("with_store", store=ctx.store)
    nostore_d = _gloo("nostore_d")
    nostore_d.barrier(False)
    assert _nobody_listens(addr, port), "MASTER_PORT still served after the mixed init"
    every = [*comms, with_store, nostore_d]
    # Interleave ops across all five comms: each must reduce only its own data.
    for round_ in range(3):
        for k, comm in enumerate(every):
            _sum_check(comm, 10 * round_ + k + 1, f"mixed comm {comm.get_name()} round {round_}")
    assert _gather_ints(nostore_d, ctx.rank * 7) == [r * 7 for r in range(ctx.world_size)]

    # Without MASTER_ADDR (or MASTER_PORT) a store-less new_comm cannot bootstrap.
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        saved = os.environ.pop(var)
        try:
            with pytest.raises(RuntimeError, match=var):
                _gloo(f"no_{var.lower()}")
        finally:
            os.environ[var] = saved
    _sum_check(nostore_d, 5, "store-less comm after the failed inits")

    for comm in every:
        comm.finalize()


@pytest.mark.parametrize("world_size", [2, 4])
def test_storeless_bootstrap_via_master_addr_port(world_size: int) -> None:
    run_ranks(_storeless_cases, world_size, timeout=120)


# ----------------------------------------------------------------------------- explicit store


def _explicit_store_cases(ctx: RankContext) -> None:
    size = ctx.world_size

    # Default: the given store only bootstraps a private store; the comm's own keys (here the
    # host identities rank 0 publishes at connect time) live in the private store.
    bootstrap_only = _gloo("bootstrap_only", store=ctx.store)
    _sum_check(bootstrap_only, 1, "non-persistent store")
    given = PrefixStore("bootstrap_only", ctx.store)
    assert given.check(["dup_store"]), "non-persistent: private store address not published"
    assert not given.check(["host/all"]), "non-persistent: comm keys went to the given store"

    persistent = _gloo("persistent", store=ctx.store, hints={"persistent_store": "true"})
    _sum_check(persistent, 2, "persistent store")
    given = PrefixStore("persistent", ctx.store)
    assert given.check(["host/all"]), "persistent: comm keys are not in the given store"
    assert not given.check(["dup_store"]), "persistent: a private store was created anyway"

    # The same name twice on one store fails on every rank (each rank checks its own claim,
    # so nobody waits for a peer) - in both modes, while the first comm is live.
    for hints in (None, {"persistent_store": "true"}):
        for taken in ("bootstrap_only", "persistent"):
            with pytest.raises(RuntimeError, match="detected multiple communicators on same store"):
                _gloo(taken, store=ctx.store, hints=hints)

    # The same name on two different stores is fine; both comms work side by side.
    file_store = FileStore(os.path.join(ctx.tmpdir, "second_store"), size)
    twin_a = _gloo("twin", store=ctx.store)
    twin_b = _gloo("twin", store=file_store)
    for k in range(3):
        _sum_check(twin_a, 2 * k + 1, "same name, store A")
        _sum_check(twin_b, 2 * k + 2, "same name, store B")
    _sum_check(persistent, 3, "persistent store after the failed duplicates")
    for comm in (twin_a, twin_b):
        comm.finalize()

    # Once finalized, the name can be created again (destroy + init_process_group on one
    # store does this); the new generation's keys cannot be confused with the old ones.
    for hints in (None, {"persistent_store": "true"}):
        first = bootstrap_only if hints is None else persistent
        first.finalize()
        for generation in range(2):
            again = _gloo(first.get_name(), store=ctx.store, hints=hints)
            _sum_check(again, 3 + generation, f"re-created {first.get_name()}")
            with pytest.raises(RuntimeError, match="detected multiple communicators on same store"):
                _gloo(first.get_name(), store=ctx.store, hints=hints)
            again.finalize()


def test_explicit_store_persistent_and_bootstrap_only() -> None:
    run_ranks(_explicit_store_cases, 2, timeout=120)


# ----------------------------------------------------------------------------- locality


def _locality_cases(ctx: RankContext) -> list[str]:
    """One host: shm (or loopback TCP when forced). Simulated hosts: gloo's default interface."""
    local = _gloo("one_host", store=ctx.store)
    local_tcp = _gloo("one_host_tcp", store=ctx.store, hints={"transport": "tcp"})
    os.environ["TORCHCOMM_HOST_ID"] = f"host{ctx.rank % 2}"  # the harness restores the env
    spread = _gloo("two_hosts", store=ctx.store)
    _sum_check(spread, 1, "simulated two-host comm")
    _sum_check(local, 2, "single-host comm")
    _sum_check(local_tcp, 3, "single-host comm over tcp")
    comms = (local, local_tcp, spread)
    transports = [c.get_backend_impl().transport for c in comms]  # type: ignore[attr-defined]
    for comm in comms:
        comm.finalize()
    return transports


def test_host_identity_selects_shm_loopback_or_default_interface() -> None:
    for local, local_tcp, spread in run_ranks(_locality_cases, 2, timeout=120):
        assert local.startswith("shm (2 ranks on this host"), local
        assert local_tcp == "tcp (loopback: all ranks on this host)", local_tcp
        assert spread == "tcp (default interface: 2 hosts)", spread


# ----------------------------------------------------------------------------- rank discovery


def _discovery_cases(ctx: RankContext) -> dict[str, Any]:
    size = ctx.world_size
    out: dict[str, Any] = {}

    # TORCHCOMM_RANK/SIZE win over RANK/WORLD_SIZE: reverse the order, leave RANK as it was.
    reversed_rank = size - 1 - ctx.rank
    os.environ["TORCHCOMM_RANK"] = str(reversed_rank)
    comm = _gloo("reversed", store=ctx.store)
    assert comm.get_rank() == reversed_rank and comm.get_size() == size
    out["reversed"] = _gather_ints(comm, ctx.rank)  # worker ids in comm rank order
    comm.finalize()

    # Without TORCHCOMM_*, RANK/WORLD_SIZE (torchrun's variables) decide: rotate by one.
    del os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"]
    rotated_rank = (ctx.rank + 1) % size
    os.environ["RANK"] = str(rotated_rank)
    comm = _gloo("rotated", store=ctx.store)
    assert comm.get_rank() == rotated_rank and comm.get_size() == size
    out["rotated"] = _gather_ints(comm, ctx.rank)
    comm.finalize()

    # Neither pair: the upstream error text.
    del os.environ["RANK"], os.environ["WORLD_SIZE"]
    with pytest.raises(RuntimeError, match="Unable to determine rank and size"):
        _gloo("no_rank", store=ctx.store)
    return out


def test_rank_size_discovery_torchcomm_env_first() -> None:
    size = 4
    results = run_ranks(_discovery_cases, size, timeout=120)
    for rank, result in enumerate(results):
        # Comm rank r is the worker whose reversed / rotated id is r.
        assert result["reversed"] == [size - 1 - r for r in range(size)], (rank, result)
        assert result["rotated"] == [(r - 1) % size for r in range(size)], (rank, result)


# ----------------------------------------------------------------------------- finalize & co


def _lifecycle_cases(ctx: RankContext) -> dict[str, Any]:
    # Double finalize, and any op after finalize.
    comm = _gloo("fin", store=ctx.store)
    _sum_check(comm, 1, "before finalize")
    comm.finalize()
    with pytest.raises(RuntimeError, match="already finalized"):
        comm.finalize()
    t = torch.ones(4)
    after_finalize = {
        "all_reduce": lambda: comm.all_reduce(t, ReduceOp.SUM, False),
        "broadcast": lambda: comm.broadcast(t, 0, False),
        "barrier": lambda: comm.barrier(False),
        "send": lambda: comm.send(t, (ctx.rank + 1) % ctx.world_size, False),
        "split": lambda: comm.split([0], "late_split"),
    }
    for op, call in after_finalize.items():
        try:
            call()
        except CommStateError as exc:  # a RuntimeError subclass
            assert "not initialized" in str(exc), (op, str(exc))
        else:
            raise AssertionError(f"{op} after finalize did not raise")

    # A comm dropped without finalize is fine: nothing raised from __del__, later comms work.
    dropped = _gloo("dropped", store=ctx.store)
    _sum_check(dropped, 2, "comm later dropped")
    dropped.all_reduce(torch.ones(4), ReduceOp.SUM, True).wait()  # its executor thread runs
    unraisable: list[Any] = []
    saved_hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        del dropped
        gc.collect()
    finally:
        sys.unraisablehook = saved_hook
    assert not unraisable, [str(u.exc_value) for u in unraisable]
    again = _gloo("after_drop", store=ctx.store)
    _sum_check(again, 3, "comm after a dropped one")
    again.finalize()

    # Finalizing a parent leaves its split child working (ops and a further split).
    parent = _gloo("parent", store=ctx.store)
    child = parent.split(list(range(ctx.world_size)), "child")
    assert child is not None
    parent.finalize()
    _sum_check(child, 4, "child after parent finalize")
    assert _gather_ints(child, ctx.rank * 3) == [r * 3 for r in range(ctx.world_size)]
    grandchild = child.split([0, 1], "grandchild") if ctx.rank < 2 else child.split([], "gc")
    if grandchild is not None:
        _sum_check(grandchild, 5, "grandchild of a finalized parent")
        grandchild.finalize()
    child.barrier(False)
    child.finalize()

    # gloo: init handle, reconfigure and abort.
    comm = _gloo("handles", store=ctx.store)
    handle = comm.get_init_handle()
    assert isinstance(handle, str) and handle, repr(handle)
    assert comm.get_init_handle() == handle
    with pytest.raises(CommStateError, match="needs a communicator made with enable_reconfigure"):
        comm.reconfigure(1, [handle])
    _sum_check(comm, 6, "after failed reconfigure")  # still usable
    assert comm.is_abort_supported() and not comm.is_aborted()
    comm.abort()  # local: the peer is not involved
    assert comm.is_aborted()
    comm.finalize()
    return {"handle": handle}


def test_finalize_init_handle_reconfigure_abort() -> None:
    results = run_ranks(_lifecycle_cases, 4, timeout=120)
    handles = [r["handle"] for r in results]
    assert all(isinstance(h, str) and h for h in handles), handles


# ----------------------------------------------------------------------------- oversubscription


def _oversubscribed(ctx: RankContext, iterations: int) -> int:
    comm = _gloo("busy", store=ctx.store)
    n = comm.get_size()
    wrong = 0
    for i in range(iterations):
        t = torch.full((8,), ctx.rank * 1000 + i, dtype=torch.int64)
        comm.all_reduce(t, ReduceOp.SUM, False)
        expected = 1000 * n * (n - 1) // 2 + n * i
        if not torch.equal(t, torch.full((8,), expected, dtype=torch.int64)):
            wrong += 1
    comm.finalize()
    return wrong


def test_more_ranks_than_cores_stay_correct() -> None:
    assert run_ranks(_oversubscribed, 4, 200, timeout=120) == [0, 0, 0, 0]


# ----------------------------------------------------------------------------- torchrun


@pytest.mark.slow  # the 4-rank run below is the default run's
def test_quickstart_under_torchrun_2() -> None:
    proc = run_torchrun([str(QUICKSTART)], nproc=2)
    assert proc.returncode == 0, proc.stdout
    assert "quickstart OK: 2 ranks" in proc.stdout, proc.stdout


def test_quickstart_under_torchrun_4() -> None:
    """Runs in the shared 4-rank job (``tests/shared_jobs.py``) with two more scripts."""
    proc, _ = shared_jobs.torchrun_scripts_4()
    assert proc.returncode == 0, proc.stdout
    assert "quickstart OK: 4 ranks" in proc.stdout, proc.stdout


def test_storeless_comms_and_split_under_torchrun() -> None:
    """In the shared 4-rank job, after the quickstart's comms were created and finalized."""
    proc, out_dir = shared_jobs.torchrun_scripts_4()
    nproc = shared_jobs.NPROC  # 4: the "evens" split then has two members
    assert proc.returncode == 0, proc.stdout
    results = {}
    for path in sorted(out_dir.glob("result*.json")):
        result = json.loads(path.read_text())
        results[result["rank"]] = result
    assert sorted(results) == list(range(nproc)), (sorted(results), proc.stdout)
    total = nproc * (nproc + 1) // 2
    for rank, r in results.items():
        # torchrun's agent serves MASTER_PORT; the store-less comms must coexist with it.
        assert r["env"]["TORCHELASTIC_USE_AGENT_STORE"] == "True", r
        assert r["env"]["RANK"] == str(rank), r
        assert r["size"] == nproc
        assert r["first"] == [total] * 4, r
        assert r["second"] == [10 * total] * 4, r
        evens = [q for q in range(nproc) if q % 2 == 0]
        assert r["even_sum"] == (sum(evens) if rank % 2 == 0 else None), r
        assert r["again_max"] == nproc - 1, r


# ----------------------------------------------------------------------------- timeouts


def _timeout_cases(ctx: RankContext) -> dict[str, Any]:
    """Rank 1 skips ops; rank 0 must get typed timeouts, then a poisoned comm."""
    store, rank = ctx.store, ctx.rank
    out: dict[str, Any] = {}
    opts: dict[str, Any] = {"store": store, "abort_process_on_timeout_or_error": False}
    per_op = _gloo("per_op_to", timeout=timedelta(seconds=300), **opts)
    per_op.barrier(False)  # line the ranks up before inits that must finish in a short timeout
    # The short timeout also bounds these comms' new_comm: they keep the harness's store
    # (no private store for rank 0 to serve and the others to reach in time on a busy box).
    short = {**opts, "timeout": _fault_timeout(), "hints": {"persistent_store": "1"}}
    sync = _gloo("sync_to", **short)
    asyn = _gloo("async_to", **short)
    p2p = _gloo("p2p_to", **short)
    for k, comm in enumerate((sync, asyn, per_op, p2p)):
        # A long per-op timeout overrides the short comm default for the set-up ops.
        _sum_check(comm, k + 1, f"warm-up {comm.get_name()}", timeout=SETUP_TIMEOUT)

    if rank == 0:
        # Async op, issued first: it times out on the executor while the sync op below does.
        pending = torch.ones(8)
        work = asyn.all_reduce(pending, ReduceOp.SUM, True)
        # Sync op: rank 1 never joins.
        t = torch.ones(8)
        start = time.monotonic()
        with pytest.raises(CommTimeoutError) as info:
            sync.all_reduce(t, ReduceOp.SUM, False)
        out["sync_elapsed"] = time.monotonic() - start
        err = info.value
        assert isinstance(err, RuntimeError)
        out["sync_error"] = str(err)
        # The comm is poisoned: the next op fails at once, naming the earlier failure.
        with pytest.raises(CommTimeoutError) as info:
            sync.broadcast(t, 0, False)
        out["poisoned_error"] = str(info.value)
        with pytest.raises(CommTimeoutError):
            sync.all_reduce(t, ReduceOp.SUM, True).wait()

        # The async op: wait() raises, the work says it did not complete.
        with pytest.raises(CommTimeoutError) as info:
            work.wait()
        out["async_error"] = str(info.value)
        out["async_status"] = work.status().name
        out["async_completed"] = work.is_completed()

        # A per-op timeout overrides the comm's (300 s) default.
        start = time.monotonic()
        with pytest.raises(CommTimeoutError) as info:
            per_op.barrier(False, timeout=_fault_timeout())
        out["per_op_elapsed"] = time.monotonic() - start
        out["per_op_error"] = str(info.value)

        # A receive whose sender never sends names that peer.
        with pytest.raises(CommTimeoutError) as info:
            p2p.recv(torch.empty(4), 1, False)
        out["p2p_error"] = str(info.value)
        store.set("rank0_done", "1")
    else:
        store.wait(["rank0_done"], timedelta(seconds=_scaled(90)))
    for comm in (sync, asyn, per_op, p2p):
        comm.finalize()
    return out


def test_timeouts_are_typed_and_poison_the_comm() -> None:
    deadline = 120.0
    r0 = run_ranks(_timeout_cases, 2, timeout=deadline)[0]
    sync_error = r0["sync_error"]
    for part in ("comm=sync_to", "rank=0", "all_reduce", "op_id=", "timed out"):
        assert part in sync_error, (part, sync_error)
    # Raised within its own short timeout, far from the harness deadline (a hang guard only).
    assert r0["sync_elapsed"] < _scaled(deadline) / 4, r0
    poisoned = r0["poisoned_error"]
    assert "broadcast" in poisoned and "earlier failure" in poisoned, poisoned
    assert sync_error.split("] ", 1)[1] in poisoned, (sync_error, poisoned)
    assert "comm=async_to" in r0["async_error"] and "all_reduce" in r0["async_error"], r0
    assert r0["async_status"] in (WorkStatus.TIMEDOUT.name, WorkStatus.ERROR.name), r0
    assert r0["async_completed"] is True  # a failed work is completed (status says how)
    per_op = r0["per_op_error"]
    timeout_text = f"timed out after {_scaled(FAULT_TIMEOUT_S):g} s"
    assert "comm=per_op_to" in per_op and "barrier" in per_op, per_op
    assert timeout_text in per_op and timeout_text in sync_error, (per_op, sync_error)
    assert r0["per_op_elapsed"] < _scaled(deadline) / 4, r0
    p2p = r0["p2p_error"]
    assert "comm=p2p_to" in p2p and "recv" in p2p and "waiting for peer rank 1" in p2p, p2p


# ----------------------------------------------------------------------------- peer failure


def _killed_peer(ctx: RankContext) -> None:
    """Rank 1 SIGKILLs itself after a good op; rank 0's next op must raise a typed error."""
    comm = _gloo("victim", store=ctx.store, abort_process_on_timeout_or_error=False)
    _sum_check(comm, 1, "before the peer dies")
    comm.set_timeout(_fault_timeout())  # the comm default from now on
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(1024)
    comm.all_reduce(t, ReduceOp.SUM, False)  # expected to raise: rank 1 is gone
    raise AssertionError(f"all_reduce with a dead peer returned {t[:4].tolist()}")


def test_killed_peer_gives_typed_error_not_hang() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(_killed_peer, 2, timeout=60, fresh=True)
    failure = info.value
    assert 1 in failure.died and "SIGKILL" in failure.died[1], str(failure)
    assert not failure.timed_out, str(failure)  # the survivor did not hang
    survivor = failure.errors.get(0, "")
    # The survivor checks its same-host peers' pids, so it names the dead rank.
    assert "PeerFailureError" in survivor and "peer rank 1 died" in survivor, str(failure)
    assert "comm=victim" in survivor and "all_reduce" in survivor, survivor
    assert issubclass(PeerFailureError, torchcomms.CommError)


# ----------------------------------------------------------------------------- FileStore bootstrap


def _file_store_bootstrap(ctx: RankContext) -> list[float]:
    """``TORCHCOMM_STORE_PATH`` bootstraps without MASTER_PORT; names may be reused after
    finalize.  Rank 0 creates the second comm while the others still hold the first one's
    store: c10d removes the file once as many store objects as ranks were destroyed, which
    must not erase what rank 0 wrote for the second comm (it could hang until the timeout)."""
    os.environ.pop("MASTER_PORT", None)  # prove the FileStore, not TCP, carried the bootstrap
    sums = []
    for _ in range(2):
        comm = _gloo("via_file")
        t = torch.full((4,), float(ctx.rank + 1))
        comm.all_reduce(t, ReduceOp.SUM, False)
        sums.append(t[0].item())
        comm.finalize()
        if ctx.rank != 0:
            time.sleep(1.0)
        del comm
        gc.collect()
        # The file outlives the comm (c10d had removed it here, under the others' feet).
        assert os.path.exists(os.environ["TORCHCOMM_STORE_PATH"])
    return sums


def test_store_path_env_bootstraps_through_a_file_store(tmp_path: Path) -> None:
    env = {"TORCHCOMM_STORE_PATH": str(tmp_path / "rendezvous")}
    assert run_ranks(_file_store_bootstrap, 3, env=env, timeout=60) == [[6.0, 6.0]] * 3


# ----------------------------------------------------------------------------- connect, then leave


def _connect_and_leave(ctx: RankContext) -> int:
    """new_comm, then finalize at once, on every rank: rank 0 serves the comm's store and
    must not take it away while a member still reads the connect verdict from it."""
    for i in range(5):
        comm = torchcomms.new_comm("gloo", CPU, name=f"brief{i}", store=ctx.store)
        comm.finalize()
    return ctx.rank


def test_finalize_right_after_new_comm_leaves_no_member_behind() -> None:
    assert run_ranks(_connect_and_leave, 3, timeout=120) == [0, 1, 2]
