"""One trial of the fault matrix: a fault x an op x a placement x a world x a position.

The last rank is the victim.  Every rank first runs the op once and checks it bit for
bit, then the fault fires and every rank runs the op again and records what it saw
(error type, text, seconds, and whether a "successful" op returned the right data).
Results go to ``report_dir`` (a killed rank fails the task).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.chaos.faults import outcome
from tests.harness import RankContext
from torchcomms import ReduceOp, TorchComm, new_comm

CPU = torch.device("cpu")
N = 8
#: int64s per rank past the tcp path's inline limit (64 KiB): its ring ops.
LARGE = 32768
OP_TIMEOUT_S = 2.0

#: placement -> host of each rank (by rank // 2 for hier: two ranks per host).
PLACEMENTS = ("shm", "tcp", "hier")


def _op(name: str, comm: TorchComm, rank: int, world: int, n: int) -> Callable[[], bool]:
    """A call of op ``name`` with ``n`` elements per rank; returns a checker of its result."""
    mine = torch.full((n,), rank + 1, dtype=torch.int64)
    if name == "all_reduce":
        t = mine.clone()
        comm.all_reduce(t, ReduceOp.SUM, False)
        return lambda: bool(torch.equal(t, torch.full((n,), world * (world + 1) // 2)))
    if name == "broadcast":
        t = mine.clone()
        comm.broadcast(t, 0, False)
        return lambda: bool(torch.equal(t, torch.full((n,), 1)))
    if name == "all_gather":
        out = torch.zeros(world * n, dtype=torch.int64)
        comm.all_gather_single(out, mine, False)
        want = torch.cat([torch.full((n,), r + 1) for r in range(world)])
        return lambda: bool(torch.equal(out, want))
    if name == "reduce_scatter":
        out = torch.zeros(n, dtype=torch.int64)
        comm.reduce_scatter_single(out, torch.cat([mine] * world), ReduceOp.SUM, False)
        return lambda: bool(torch.equal(out, torch.full((n,), world * (world + 1) // 2)))
    if name == "all_to_all":
        out = torch.zeros(world * n, dtype=torch.int64)
        comm.all_to_all_single(out, torch.cat([mine] * world), False)
        want = torch.cat([torch.full((n,), r + 1) for r in range(world)])
        return lambda: bool(torch.equal(out, want))
    if name == "send_recv":
        got = torch.zeros(n, dtype=torch.int64)
        batch = comm.batch_op_create()
        batch.send(mine, (rank + 1) % world)
        batch.recv(got, (rank - 1) % world)
        batch.issue(False)
        return lambda: bool(torch.equal(got, torch.full((n,), (rank - 1) % world + 1)))
    if name == "barrier":
        comm.barrier(False)
        return lambda: True
    raise ValueError(name)


def _store_ports(*stores: Any) -> set[int]:
    """The ports of the TCPStores under ``stores`` (through PrefixStores)."""
    ports = set()
    for store in stores:
        for _ in range(16):
            if isinstance(store, dist.TCPStore):
                ports.add(store.port)
                break
            if not isinstance(store, dist.PrefixStore):
                break
            store = store.underlying_store
    return ports


def _shut_down_sockets(ctx: RankContext, comm: TorchComm) -> int:
    """Shut down every TCP connection of this process but the stores' (the harness's and
    the communicator's own): what a broken link or a killed connection looks like to the
    peers while the process lives."""
    comm_store = comm.get_backend_impl()._store.store  # type: ignore[attr-defined]
    store_ports = _store_ports(ctx.store, comm_store)
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue  # not a socket
        with sock:
            try:
                if sock.type != socket.SOCK_STREAM or sock.family not in (
                    socket.AF_INET,
                    socket.AF_INET6,
                ):
                    continue
                peer = sock.getpeername()
            except OSError:
                continue  # a listener, or not connected
            if peer[1] in store_ports:
                continue
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
                count += 1
    return count


def posts(op: str, placement: str, world: int, rank: int) -> bool:
    """Whether ``rank`` returns from ``op`` once its own bytes are out, learning of a fault
    at its next op: a two-rank tcp broadcast's root (``transport.tcp.posted``)."""
    return op == "broadcast" and placement == "tcp" and world == 2 and rank == 0


def trial(
    ctx: RankContext,
    fault: str,
    op: str,
    placement: str,
    position: str,
    report_dir: str,
    size: int = N,
) -> dict[str, Any]:
    me, world = ctx.rank, ctx.world_size
    victim = world - 1
    if placement == "hier":
        os.environ["TORCHCOMM_HOST_ID"] = f"matrix-host-{me // 2}"
    transport = "auto" if placement == "hier" else placement
    comm = new_comm(
        "gloo",
        CPU,
        name=f"m_{fault}_{op}_{placement}_{position}_{size}",
        store=ctx.store,
        timeout=timedelta(seconds=30),
        hints={"transport": transport},
    )
    assert _op(op, comm, me, world, size)(), f"{op} wrong before the fault"
    comm.barrier(False)
    ctx.store.set(f"pid/{me}", str(os.getpid()))
    seen: dict[str, Any] = {}

    def run(n: int = size, name: str = op) -> dict[str, Any]:
        check: list[Callable[[], bool]] = []
        return outcome(lambda: check.append(_op(name, comm, me, world, n)), lambda: check[0]())

    def run_and_next() -> None:
        """The op; where it posted (``posts``) and succeeded, a barrier after it, which
        must fail as the op would have."""
        seen["op"] = run()
        if posts(op, placement, world, me) and seen["op"]["type"] is None:
            seen["next"] = run(name="barrier")

    if fault == "kill":
        if me == victim:
            if position == "during":
                time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)
        if position == "before":
            time.sleep(0.5)
        run_and_next()
    elif fault == "stop":
        victim_pid = int(ctx.store.get(f"pid/{victim}").decode())
        if me == victim:
            ctx.store.wait(["released"], timedelta(seconds=120))
        else:
            if me == 0 and position == "before":
                os.kill(victim_pid, signal.SIGSTOP)
            ctx.store.set(f"stopping/{me}", "1")
            ctx.store.wait([f"stopping/{r}" for r in range(world - 1)])
            if me == 0 and position == "during":

                def stop_soon() -> None:
                    time.sleep(0.3)
                    os.kill(victim_pid, signal.SIGSTOP)

                threading.Thread(target=stop_soon, daemon=True).start()
            comm.set_timeout(timedelta(seconds=OP_TIMEOUT_S))
            run_and_next()
            ctx.store.set(f"stopped_done/{me}", "1")
            ctx.store.wait([f"stopped_done/{r}" for r in range(world - 1)])
            if me == 0:
                os.kill(victim_pid, signal.SIGCONT)
                ctx.store.set("released", "1")
    elif fault == "slow":
        # Late by half the op's timeout: a slow peer is not a failure.
        comm.set_timeout(timedelta(seconds=OP_TIMEOUT_S))
        if me == victim:
            time.sleep(OP_TIMEOUT_S / 2)
        seen["op"] = run()
    elif fault == "closed":
        comm.set_timeout(timedelta(seconds=OP_TIMEOUT_S))
        if me == victim:
            if position == "during":
                time.sleep(0.3)
            closed = _shut_down_sockets(ctx, comm)
            assert closed, "the victim had no connection to close"
        elif position == "before":
            time.sleep(0.5)
        run_and_next()
    elif fault == "mismatch":
        if me == victim:
            seen["op"] = run(size + 1)
        else:
            run_and_next()
    elif fault == "skipped":
        nxt = "all_reduce" if op == "barrier" else "barrier"
        if me == victim:
            seen["op"] = run(name=nxt)
        else:
            seen["op"] = run()
            if seen["op"]["type"] is None:
                seen["next"] = run(name=nxt)
    Path(report_dir, f"rank{me}.json").write_text(json.dumps(seen))
    if fault != "stop" or me != victim:
        comm.finalize()
    return seen
