"""What creating, splitting, reconfiguring and shrinking a communicator costs per rank,
counted.

    python benchmarks/diagnostics/scale_counts.py [--sizes 2,4,8,16,32,64] \
        [--transports auto,tcp,hier] [--ranks-per-host K] [--lazy | --eager] \
        [--json out.json]

For each world size N and transport, N ranks are forked from this process (oversubscribed
past 2 cores: counts, not times, are the measure) and the store is served by a process
of its own.  With ``TORCHCOMM_STORE_COUNTS=1`` every store operation of the comms is
counted (``torchcomms.runtime.store_counts``: ours and gloo's).  Per rank and phase it records:

* store operations by kind; ``polls`` are the ``check`` calls and counter reads waits poll with,
  ``liveness`` the liveness watcher's publishes (both depend on timing), ``ops`` the rest
  (the operations that move keys);
* bytes (``bytes_out`` + ``bytes_in``: every operation's but the timing-dependent ones)
  of rank 0 and of the other members, and the polls' and publishes' bytes apart
  (``poll_bytes``);
* the transport the phase's comm got (``get_backend_impl().transport``);
* sockets and threads the process holds after the phase, shared-memory bytes it maps;
* the phase's wall time (on 2 cores at N = 64 it measures the CPU, not the algorithm).

Transports and where the ranks are (``--ranks-per-host K``; hosts are simulated with
``TORCHCOMM_HOST_ID``, host of rank r = ``simulated-host-{r // K}``, gloo on loopback):

* ``auto``: one host (no ``TORCHCOMM_HOST_ID``; shm), unless K is given;
* ``tcp``: hint ``transport=tcp``, every rank its own host (K = 1: one rank per host, as
  tcp is deployed);
* ``hier``: hint ``transport=auto`` with K = 2 ranks per host (N/2 hosts), so from N = 4
  the comm is hierarchical (shm inside each host, gloo between); at N = 2 the one host of
  two is shm (each row says which transport it got).  ``--ranks-per-host -1`` is the
  older placement: two hosts, blocked halves.

A K given applies to every transport of the run; the JSON's ``placement`` says which K
each transport ran with.

Phases: ``new_comm`` (the world), a first 1 MiB ``all_reduce`` (the tcp lane's ring) and
a first ``all_to_all`` (gloo's pairs; ``--lazy`` makes gloo connect them only then),
``ops_loop`` (2 s of small all_reduces: the store load while ops run, none since the
liveness watcher stopped publishing; ``liveness`` counts any), ``split`` (two halves),
``reconfigure`` (a comm made with ``enable_reconfigure=True``, all members, handles
exchanged through the store: the exchange is not counted, the reconfigure is), ``shrink``
(every rank but the last shrinks the world comm without it: the agreement and the new
comm's connect; the last rank has no row).

Printed, a line per transport, size and phase: the hosts, the transport the comm got
(``shm``, ``tcp``, ``hier``), ops and bytes of the comm's rank 0 (the larger of a split's
two) / of the largest other member, ops and bytes of all ranks, then (per rank, median)
polls and liveness publishes, the polls' and publishes' bytes in all, sockets, threads,
shm and the slowest rank's seconds.
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

from torchcomms.runtime import store_counts

PHASES = ("new_comm", "all_reduce", "all_to_all", "ops_loop", "split", "reconfigure", "shrink")
#: How long the ``ops_loop`` phase runs small all_reduces.
OPS_SECONDS = 2.0
#: Kinds whose number depends on timing: waits' polls (``check``, ``read_counter``) and
#: the liveness watcher's publishes.  Not ``ops``.
TIMED_KINDS = store_counts.TIMED_KINDS
#: How waits poll (``polls``).
POLL_KINDS = tuple(k for k in TIMED_KINDS if k != "liveness")
#: Counters that are bytes, not operations.
BYTE_KEYS = ("bytes_out", "bytes_in", "poll_bytes")
#: Ranks per simulated host when ``--ranks-per-host`` is 0: 0 is one real host (no
#: ``TORCHCOMM_HOST_ID``), -1 two hosts of blocked halves.
DEFAULT_RANKS_PER_HOST = {"auto": 0, "tcp": 1, "hier": 2}


def placement(transport: str, ranks_per_host: int) -> tuple[dict[str, str], int]:
    """The hints a transport's ranks pass and its ranks per simulated host (0: one real
    host, -1: two hosts of blocked halves)."""
    hints = {"transport": "auto" if transport == "hier" else transport}
    return hints, ranks_per_host or DEFAULT_RANKS_PER_HOST.get(transport, 0)


def host_of(rank: int, world: int, ranks_per_host: int) -> str | None:
    """``TORCHCOMM_HOST_ID`` of ``rank`` (None: left unset, the real host)."""
    if ranks_per_host == 0:
        return None
    if ranks_per_host < 0:  # two hosts, blocked halves
        return f"simulated-host-{rank * 2 // world}"
    return f"simulated-host-{rank // ranks_per_host}"


def hosts_in(world: int, ranks_per_host: int) -> int:
    return len({host_of(r, world, ranks_per_host) for r in range(world)})


def _describe_placement(ranks_per_host: int) -> str:
    if ranks_per_host == 0:
        return "one host: TORCHCOMM_HOST_ID unset"
    if ranks_per_host < 0:
        return "two simulated hosts, blocked halves: simulated-host-{r * 2 // N}"
    return f"{ranks_per_host} rank(s) per simulated host: simulated-host-{{r // {ranks_per_host}}}"


def _transport_of(comm: Any) -> str | None:
    """What the comm's backend says it runs over (``get_backend_impl().transport``)."""
    try:
        return str(comm.get_backend_impl().transport)
    except Exception:  # a size-1 comm, or a backend without one
        return None


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


def _rank(rank: int, world: int, port: int, transport: str, ranks_per_host: int, q: Any) -> None:
    os.environ.update(TORCHCOMM_RANK=str(rank), TORCHCOMM_SIZE=str(world))
    os.environ.update(TORCHCOMM_STORE_COUNTS="1", TORCHCOMM_ABORT_ON_ERROR="0")
    hints, ranks_per_host = placement(transport, ranks_per_host)
    host = host_of(rank, world, ranks_per_host)
    if host is not None:  # simulated hosts, gloo on loopback
        os.environ["TORCHCOMM_HOST_ID"] = host
        os.environ["TORCHCOMM_GLOO_HOSTNAME"] = "127.0.0.1"
    import torchcomms

    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=300))
    cpu = torch.device("cpu")
    timeout = timedelta(seconds=300)
    rows: dict[str, Any] = {}

    def phase(name: str, call: Any, comm_of: Any = None) -> Any:
        """Counts ``call``; the row's transport is that of ``comm_of(result)`` (default:
        the result itself, a comm)."""
        before = store_counts.snapshot()
        start = time.monotonic()
        result = call()
        seconds = time.monotonic() - start
        made = comm_of(result) if comm_of else result
        rows[name] = {
            "store": store_counts.diff(store_counts.snapshot(), before),
            "s": seconds,
            "transport": _transport_of(made),
            # Rank 0 of the phase's comm (a split has one per child): it reads every
            # member's identity, so it is counted apart from the members.
            "leads": made.get_rank() == 0,
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

    def world_comm(_: Any) -> Any:
        return comm

    phase("all_reduce", lambda: comm.all_reduce(big, torchcomms.ReduceOp.SUM, False), world_comm)
    a2a = torch.ones(world * 4)
    phase(
        "all_to_all",
        lambda: comm.all_to_all_single(torch.empty_like(a2a), a2a, False),
        world_comm,
    )

    # The steady state: small all_reduces for a while.  Nothing here should touch the
    # store (the liveness watcher publishes nothing; a timeout would take a census).
    def busy() -> None:
        end = time.monotonic() + OPS_SECONDS
        while True:  # every rank stops at the same op: once any rank's time is up
            t = torch.tensor([float(time.monotonic() >= end)])
            comm.all_reduce(t, torchcomms.ReduceOp.SUM, False)
            if t[0] > 0:
                break

    phase("ops_loop", busy, world_comm)
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
    phase("reconfigure", lambda: re.reconfigure(1, handles), lambda _: re)
    comms = [comm, child, re]
    if rank != world - 1:  # the others shrink the world without the last rank
        comms.append(phase("shrink", lambda: comm.shrink(exclude_ranks=[world - 1], name="less")))
    t = torch.ones(4)
    for c in comms:
        c.all_reduce(t, torchcomms.ReduceOp.SUM, False)  # every comm works
    q.put((rank, rows))
    store.set(f"done/{rank}", "1")
    store.wait([f"done/{r}" for r in range(world)])
    for c in reversed(comms):
        c.finalize()
    os._exit(0)


def _trial(world: int, transport: str, ranks_per_host: int) -> list[tuple[int, dict[str, Any]]]:
    ctx = mp.get_context("fork")
    q = ctx.SimpleQueue()
    with served_store() as port:
        procs = [
            ctx.Process(target=_rank, args=(r, world, port, transport, ranks_per_host, q))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        got = []
        try:
            while len(got) < world:
                if not q.empty():
                    got.append(q.get())
                    continue
                # A rank that failed (its traceback is on stderr) never reports: stop
                # rather than wait for the others' timeouts.
                failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed:
                    raise RuntimeError(
                        f"{transport} N={world}: rank(s) {failed} exited before reporting "
                        f"(exit codes {[procs[r].exitcode for r in failed]})"
                    )
                time.sleep(0.05)
        finally:
            for p in procs:
                p.join(120 if len(got) == world else 0)
                if p.is_alive():
                    p.kill()
                    p.join(10)
    return sorted(got)


def _ops(store: dict[str, int]) -> int:
    """Operations that move keys: every kind but the timing-dependent ones."""
    return sum(v for k, v in store.items() if k not in BYTE_KEYS and k not in TIMED_KINDS)


def _bytes(store: dict[str, int]) -> int:
    """Bytes both ways of every operation but the timing-dependent ones."""
    return store.get("bytes_out", 0) + store.get("bytes_in", 0)


def _short(transport: str | None) -> str:
    """``shm``, ``tcp`` or ``hier`` from a backend's transport description."""
    if not transport:
        return "-"
    word = transport.split()[0].rstrip(":")
    return "hier" if word.startswith("hierarchical") else word


def _summary(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One phase over every rank that ran it; ``rank0`` figures are the largest of the
    phase comm's rank 0s (two for a split into halves), ``others`` the members'."""
    polls = [sum(row["store"].get(k, 0) for k in POLL_KINDS) for row in per_rank]
    liveness = [row["store"].get("liveness", 0) for row in per_rank]
    counts = [_ops(row["store"]) for row in per_rank]
    nbytes = [_bytes(row["store"]) for row in per_rank]
    leads = [row.get("leads", r == 0) for r, row in enumerate(per_rank)]
    lead_ops = [c for c, lead in zip(counts, leads, strict=True) if lead]
    lead_bytes = [b for b, lead in zip(nbytes, leads, strict=True) if lead]
    member_ops = [c for c, lead in zip(counts, leads, strict=True) if not lead]
    member_bytes = [b for b, lead in zip(nbytes, leads, strict=True) if not lead]
    kinds: dict[str, int] = {}
    for row in per_rank:
        for k, v in row["store"].items():
            kinds[k] = kinds.get(k, 0) + v
    transports = [row.get("transport") for row in per_rank]
    got = sorted({t for t in transports if t})
    return {
        # The transport each rank's comm of this phase got (one value when all agree).
        "transport": got[0] if len(got) == 1 else (got or None),
        # Each rank's, only when they differ.
        **({"transport_per_rank": transports} if len(set(transports)) > 1 else {}),
        "transport_kind": "+".join(sorted({_short(t) for t in transports})),
        "ops_per_rank_max": max(counts),
        "ops_per_rank_median": statistics.median(counts),
        "ops_rank0": max(lead_ops, default=0),
        "ops_others_max": max(member_ops, default=0),
        "ops_others_median": statistics.median(member_ops) if member_ops else 0,
        "ops_total": sum(counts),
        "polls_per_rank_median": statistics.median(polls),
        "polls_total": sum(polls),
        "liveness_per_rank_median": statistics.median(liveness),
        "liveness_per_rank_max": max(liveness),
        "liveness_total": sum(liveness),
        # bytes_out + bytes_in: every operation's but the polls' and publishes'.
        "bytes_total": kinds.get("bytes_out", 0) + kinds.get("bytes_in", 0),
        "bytes_rank0": max(lead_bytes, default=0),
        "bytes_others_max": max(member_bytes, default=0),
        "bytes_others_median": statistics.median(member_bytes) if member_bytes else 0,
        "bytes_per_rank_median": statistics.median(nbytes),
        "poll_bytes_total": kinds.get("poll_bytes", 0),
        "by_kind_total": kinds,
        "sockets_per_rank_max": max(r["sockets"] for r in per_rank),
        "threads_per_rank_max": max(r["threads"] for r in per_rank),
        "shm_bytes_per_rank_max": max(r["shm_bytes"] for r in per_rank),
        "seconds_max": round(max(r["s"] for r in per_rank), 3),
        "ops_per_rank_per_s": round(
            statistics.median(c / r["s"] for c, r in zip(counts, per_rank, strict=True)), 2
        ),
        "liveness_per_rank_per_s": round(
            statistics.median(c / r["s"] for c, r in zip(liveness, per_rank, strict=True)), 2
        ),
    }


_HEADER = (
    f"{'transport':9s} {'N':>4s} {'hosts':>5s} {'phase':12s} {'got':5s} "
    f"{'ops r0/others max':>17s} {'bytes r0/others max':>21s} {'ops total':>9s} "
    f"{'bytes total':>11s} {'polls/rk':>8s} {'live/rk':>7s} {'poll B':>8s} "
    f"{'sock':>4s} {'thr':>3s} {'shm MiB':>7s} {'s':>6s}"
)


def _line(transport: str, world: int, hosts: int, phase: str, row: dict[str, Any]) -> str:
    ops = f"{row['ops_rank0']} / {row['ops_others_max']}"
    nbytes = f"{row['bytes_rank0']} / {row['bytes_others_max']}"
    return (
        f"{transport:9s} {world:4d} {hosts:5d} {phase:12s} {row['transport_kind']:5s} "
        f"{ops:>17s} {nbytes:>21s} {row['ops_total']:9d} {row['bytes_total']:11d} "
        f"{row['polls_per_rank_median']:8.0f} {row['liveness_per_rank_median']:7.0f} "
        f"{row['poll_bytes_total']:8d} {row['sockets_per_rank_max']:4d} "
        f"{row['threads_per_rank_max']:3d} {row['shm_bytes_per_rank_max'] >> 20:7d} "
        f"{row['seconds_max']:6.2f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="2,4,8,16,32,64")
    ap.add_argument("--transports", default="auto,tcp")
    ap.add_argument(
        "--ranks-per-host",
        type=int,
        default=0,
        help="ranks per simulated host, for every transport of the run (0: each transport's "
        "default: auto one host, tcp 1, hier 2; -1: two hosts, blocked halves)",
    )
    ap.add_argument("--lazy", action="store_true", help="TORCHCOMM_GLOO_LAZY_INIT=1 (the default)")
    ap.add_argument("--eager", action="store_true", help="TORCHCOMM_GLOO_LAZY_INIT=0")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.lazy or args.eager:
        os.environ["TORCHCOMM_GLOO_LAZY_INIT"] = "0" if args.eager else "1"
    transports = args.transports.split(",")
    sizes = [int(x) for x in args.sizes.split(",")]
    where: dict[str, Any] = {}
    for transport in transports:
        hints, k = placement(transport, args.ranks_per_host)
        where[transport] = {
            "ranks_per_host": k,
            "placement": _describe_placement(k),
            "hints": hints,
            "hosts": {str(n): hosts_in(n, k) for n in sizes},
        }
        print(f"{transport}: hints {hints}, {_describe_placement(k)}", flush=True)
    print(_HEADER, flush=True)
    results: dict[str, Any] = {}
    for transport in transports:
        k = where[transport]["ranks_per_host"]
        for world in sizes:
            got = _trial(world, transport, args.ranks_per_host)
            for phase in PHASES:
                summary = _summary([rows[phase] for _, rows in got if phase in rows])
                summary["ranks_per_host"] = k
                summary["hosts"] = hosts_in(world, k)
                results[f"{transport}/{world}/{phase}"] = summary
                print(_line(transport, world, summary["hosts"], phase, summary), flush=True)
    if args.json:
        gloo = "eager" if args.eager else "lazy" if args.lazy else "default"
        write_doc(
            args.json,
            f"python benchmarks/diagnostics/scale_counts.py --sizes {args.sizes} "
            f"--transports {args.transports}"
            + (f" --ranks-per-host {args.ranks_per_host}" if args.ranks_per_host else "")
            + (" --lazy" if args.lazy else "")
            + (" --eager" if args.eager else ""),
            results,
            what="per phase: store operations (ops: all but check and liveness; polls: "
            "check; liveness: the watcher's publishes) per rank and in total; bytes "
            "(bytes_out + bytes_in, polls' and publishes' apart as poll_bytes) of rank 0 "
            "and the other members; the transport each comm got; sockets/threads/shm per "
            "rank after the phase, slowest rank's seconds",
            placement={"gloo_connect": gloo, **where},
        )


if __name__ == "__main__":
    main()
