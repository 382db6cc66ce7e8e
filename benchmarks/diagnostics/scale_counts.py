"""What creating, splitting and reconfiguring a communicator costs per rank, counted.

    python benchmarks/diagnostics/scale_counts.py [--sizes 2,4,8,16,32,64] \
        [--transports auto,tcp,hier] [--lazy | --eager] [--json out.json]

For each world size N and transport, N ranks are forked from this process (oversubscribed
past 2 cores: counts, not times, are the measure) and the store is served by a process
of its own.  With ``TORCHCOMM_STORE_COUNTS=1`` every store operation of the comms is
counted (``torchcomms.store_counts``: ours and gloo's).  Per rank and phase it records:

* store operations by kind; ``polls`` are the ``check`` calls waits poll with, ``ops``
  the rest (the operations that move keys);
* sockets and threads the process holds after the phase, shared-memory bytes it maps;
* the phase's wall time (on 2 cores at N = 64 it measures the CPU, not the algorithm).

Transports: ``auto`` (shm: one host), ``tcp``, and ``hier``: the ranks play two hosts
(``TORCHCOMM_HOST_ID``, blocked halves; gloo on loopback), so from N = 4 the comm is
hierarchical (shm inside each half, gloo between).

Phases: ``new_comm`` (the world), a first 1 MiB ``all_reduce`` (the tcp lane's ring) and
a first ``all_to_all`` (gloo's pairs; ``--lazy`` makes gloo connect them only then),
``ops_loop`` (2 s of small all_reduces: the liveness watcher's store load, per second),
``split`` (two halves), ``reconfigure`` (a comm made
with ``enable_reconfigure=True``, all members, handles exchanged through the store: the
exchange is not counted, the reconfigure is).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import statistics
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from _doc import write_doc
from _store_server import served_store

PHASES = ("new_comm", "all_reduce", "all_to_all", "ops_loop", "split", "reconfigure")
#: How long the ``ops_loop`` phase runs small all_reduces.
OPS_SECONDS = 2.0


def _resources() -> dict[str, int]:
    fds = os.listdir("/proc/self/fd")
    sockets = 0
    for fd in fds:
        with contextlib.suppress(OSError):  # an fd closed meanwhile
            sockets += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    shm = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split()
            if len(parts) >= 6 and parts[5].startswith("/dev/shm/"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                shm += hi - lo
    return {
        "sockets": sockets,
        "threads": len(os.listdir("/proc/self/task")),
        "shm_bytes": shm,
    }


def _rank(rank: int, world: int, port: int, transport: str, q: Any) -> None:
    os.environ.update(TORCHCOMM_RANK=str(rank), TORCHCOMM_SIZE=str(world))
    os.environ.update(TORCHCOMM_STORE_COUNTS="1", TORCHCOMM_ABORT_ON_ERROR="0")
    import torchcomms
    from torchcomms import store_counts

    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=300))
    hints = {"transport": transport}
    if transport == "hier":  # two simulated hosts (blocked halves), gloo on loopback
        os.environ["TORCHCOMM_HOST_ID"] = f"simulated-host-{rank * 2 // world}"
        os.environ["TORCHCOMM_GLOO_HOSTNAME"] = "127.0.0.1"
        hints = {"transport": "auto"}
    cpu = torch.device("cpu")
    timeout = timedelta(seconds=300)
    rows: dict[str, Any] = {}

    def phase(name: str, call: Any) -> Any:
        before = store_counts.snapshot()
        start = time.monotonic()
        result = call()
        seconds = time.monotonic() - start
        rows[name] = {
            "store": store_counts.diff(store_counts.snapshot(), before),
            "s": seconds,
            **_resources(),
        }
        return result

    comm = phase(
        "new_comm",
        lambda: torchcomms.new_comm(
            "gloo", cpu, name="scale", store=store, timeout=timeout, hints=hints
        ),
    )
    # Sockets a first ring all_reduce (the lane's) and a first all_to_all (gloo's) add:
    # with TORCHCOMM_GLOO_LAZY_INIT=1 gloo connects a pair only at its first op.
    big = torch.ones(262144)
    phase("all_reduce", lambda: comm.all_reduce(big, torchcomms.ReduceOp.SUM, False))
    a2a = torch.ones(world * 4)
    phase("all_to_all", lambda: comm.all_to_all_single(torch.empty_like(a2a), a2a, False))

    # The steady state: small all_reduces for a while.  The store operations here are the
    # liveness watcher's (one publish per rank per period at most, while ops run).
    def busy() -> None:
        end = time.monotonic() + OPS_SECONDS
        while True:  # every rank stops at the same op: once any rank's time is up
            t = torch.tensor([float(time.monotonic() >= end)])
            comm.all_reduce(t, torchcomms.ReduceOp.SUM, False)
            if t[0] > 0:
                break

    phase("ops_loop", busy)
    half = world // 2
    mine = list(range(half)) if rank < half else list(range(half, world))
    child = phase("split", lambda: comm.split(mine, "half"))
    re = torchcomms.new_comm(
        "gloo",
        cpu,
        name="scale_re",
        store=store,
        timeout=timeout,
        hints=hints,
        enable_reconfigure=True,
    )
    store.set(f"handle/{rank}", re.get_init_handle())
    store.wait([f"handle/{r}" for r in range(world)])
    handles = [store.get(f"handle/{r}").decode() for r in range(world)]
    phase("reconfigure", lambda: re.reconfigure(1, handles))
    t = torch.ones(4)
    for c in (comm, child, re):
        c.all_reduce(t, torchcomms.ReduceOp.SUM, False)  # every comm works
    q.put((rank, rows))
    store.set(f"done/{rank}", "1")
    store.wait([f"done/{r}" for r in range(world)])
    for c in (re, child, comm):
        c.finalize()
    os._exit(0)


def _trial(world: int, transport: str) -> list[tuple[int, dict[str, Any]]]:
    ctx = mp.get_context("fork")
    q = ctx.SimpleQueue()
    with served_store() as port:
        procs = [
            ctx.Process(target=_rank, args=(r, world, port, transport, q)) for r in range(world)
        ]
        for p in procs:
            p.start()
        got = [q.get() for _ in range(world)]
        for p in procs:
            p.join(120)
            if p.is_alive():
                p.kill()
    return sorted(got)


def _summary(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    def ops(row: dict[str, Any]) -> int:
        return sum(v for k, v in row["store"].items() if not k.startswith("bytes") and k != "check")

    polls = [row["store"].get("check", 0) for row in per_rank]
    counts = [ops(row) for row in per_rank]
    kinds: dict[str, int] = {}
    for row in per_rank:
        for k, v in row["store"].items():
            kinds[k] = kinds.get(k, 0) + v
    return {
        "ops_per_rank_max": max(counts),
        "ops_per_rank_median": statistics.median(counts),
        "ops_rank0": counts[0],
        "ops_others_max": max(counts[1:], default=0),
        "ops_total": sum(counts),
        "polls_per_rank_median": statistics.median(polls),
        "polls_total": sum(polls),
        "bytes_total": kinds.get("bytes_out", 0) + kinds.get("bytes_in", 0),
        "by_kind_total": kinds,
        "sockets_per_rank_max": max(r["sockets"] for r in per_rank),
        "threads_per_rank_max": max(r["threads"] for r in per_rank),
        "shm_bytes_per_rank_max": max(r["shm_bytes"] for r in per_rank),
        "seconds_max": round(max(r["s"] for r in per_rank), 3),
        "ops_per_rank_per_s": round(
            statistics.median(c / r["s"] for c, r in zip(counts, per_rank, strict=True)), 2
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="2,4,8,16,32,64")
    ap.add_argument("--transports", default="auto,tcp")
    ap.add_argument("--lazy", action="store_true", help="TORCHCOMM_GLOO_LAZY_INIT=1 (the default)")
    ap.add_argument("--eager", action="store_true", help="TORCHCOMM_GLOO_LAZY_INIT=0")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.lazy or args.eager:
        os.environ["TORCHCOMM_GLOO_LAZY_INIT"] = "0" if args.eager else "1"
    results: dict[str, Any] = {}
    for transport in args.transports.split(","):
        for world in (int(x) for x in args.sizes.split(",")):
            got = _trial(world, transport)
            for phase in PHASES:
                summary = _summary([rows[phase] for _, rows in got])
                results[f"{transport}/{world}/{phase}"] = summary
                print(
                    f"{transport:5s} N={world:3d} {phase:12s} ops: rank 0 "
                    f"{summary['ops_rank0']:5d}, others max {summary['ops_others_max']:5d}, "
                    f"total {summary['ops_total']:6d}  polls/rank {summary['polls_per_rank_median']:6.0f}"
                    f"  sockets {summary['sockets_per_rank_max']:4d} threads "
                    f"{summary['threads_per_rank_max']:3d} shm {summary['shm_bytes_per_rank_max'] >> 20:4d} MiB"
                    f"  {summary['seconds_max']:.2f} s",
                    flush=True,
                )
    if args.json:
        write_doc(
            args.json,
            f"python benchmarks/diagnostics/scale_counts.py --sizes {args.sizes} "
            f"--transports {args.transports}"
            + (" --lazy" if args.lazy else "")
            + (" --eager" if args.eager else ""),
            results,
            what="per phase: store operations (ops: all but check; polls: check) per rank and "
            "in total, sockets/threads/shm per rank after the phase, slowest rank's seconds",
        )


if __name__ == "__main__":
    main()
