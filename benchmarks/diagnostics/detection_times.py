"""How long survivors take to learn of a fault: p50 / p99 per transport and fault.

    python benchmarks/diagnostics/detection_times.py [--trials 20] [--world 3] \
        [--placements shm,tcp,...] [--faults kill,stop,mismatch] [--json out.json]

Faults, each on a fresh communicator of ``--world`` ranks whose last rank is the victim:

* ``kill``: the victim SIGKILLs itself 0.2 s after the others entered an all_reduce;
  detection = each survivor's ``PeerFailureError`` time minus the kill time.
* ``stop``: the victim is SIGSTOPped before a 1 s-timeout all_reduce; detection = each
  survivor's ``CommTimeoutError`` time minus the op's deadline (the overshoot: how long
  naming who never entered took, ``cpu.tcp.census``).
  A kill or stop error that does not name the victim alone counts as unexpected.
* ``mismatch``: the victim passes a different size; detection = time from entering the
  op to ``CollectiveMismatchError``, every rank.

Placements: ``shm`` and ``tcp`` on this host, ``tcp-hosts`` (every rank its own
simulated host, ``TORCHCOMM_HOST_ID``: deaths are learned through the side-connection
ring, not pids), ``hier`` (two ranks per simulated host: shm inside, tcp between) and
``tcp-ring`` (tcp with a 256 KiB all_reduce: the lane's ring op).  Ranks are forked from this process (torch already imported), so a trial
costs about a second.  Times come from ``time.monotonic()``, one clock for the machine.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import signal
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from _doc import write_doc

PLACEMENTS = ("shm", "tcp", "tcp-hosts", "hier", "tcp-ring")
#: Elements of the all_reduce per placement (float32): 8, or past the tcp inline limit.
NUMEL = {"tcp-ring": 65536}
FAULTS = ("kill", "stop", "mismatch")


def _rank(rank: int, world: int, port: int, placement: str, fault: str, q: Any) -> None:
    os.environ.update(TORCHCOMM_RANK=str(rank), TORCHCOMM_SIZE=str(world))
    os.environ["TORCHCOMM_ABORT_ON_ERROR"] = "0"
    if placement == "tcp-hosts":
        os.environ["TORCHCOMM_HOST_ID"] = f"detect-host-{rank}"
    if placement == "hier":
        os.environ["TORCHCOMM_HOST_ID"] = f"detect-host-{rank // 2}"
    import torchcomms

    # A TCPStore, never a FileStore: a stopped rank holding the FileStore's lock would
    # block every other rank's store call for good.  Rank 0 serves it (never the victim),
    # so the parent starts no thread before it forks.
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, wait_for_workers=False)
    comm = torchcomms.new_comm(
        "gloo",
        torch.device("cpu"),
        name="detect",
        store=store,
        timeout=datetime.timedelta(seconds=30),
        hints={"transport": {"shm": "shm", "hier": "auto"}.get(placement, "tcp")},
    )
    victim = world - 1
    t = torch.ones(8)
    comm.all_reduce(t, torchcomms.ReduceOp.SUM, False)
    comm.barrier(False)
    store.set(f"pid/{rank}", str(os.getpid()))
    if fault == "kill" and rank == victim:
        time.sleep(0.2)
        store.set("killed_at", repr(time.monotonic()))
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "stop":
        if rank == victim:
            time.sleep(120)  # stopped in here; the parent kills it after the trial
            os._exit(0)
        if rank == 0:
            os.kill(int(store.get(f"pid/{victim}").decode()), signal.SIGSTOP)
        store.set(f"stopped/{rank}", "1")
        store.wait([f"stopped/{r}" for r in range(world - 1)])
    size = NUMEL.get(placement, 8)
    n = size + 1 if fault == "mismatch" and rank == victim else size
    timeout = datetime.timedelta(seconds=1) if fault == "stop" else None
    start = time.monotonic()
    named: list[int] = []
    try:
        comm.all_reduce(torch.ones(n), torchcomms.ReduceOp.SUM, False, timeout=timeout)
        kind = "returned"
    except Exception as exc:
        kind = type(exc).__name__
        named = sorted(getattr(exc, "ranks", ()) or ())
    end = time.monotonic()
    if fault in ("kill", "stop") and named != [victim]:
        kind += f" naming {named}"  # counted as unexpected: it must name the victim alone
    if fault == "kill":
        store.wait(["killed_at"])
        base = float(store.get("killed_at").decode())
    elif fault == "stop":
        base = start + 1.0
    else:
        base = start
    q.put((rank, kind, end - base))
    store.set(f"done/{rank}", "1")
    if rank == 0:  # serve the store until every survivor is done with it
        store.wait([f"done/{r}" for r in range(world - 1)])
    os._exit(0)  # the comm is broken by design; skip its teardown


EXPECTED = {
    "kill": "PeerFailureError",
    "stop": "CommTimeoutError",
    "mismatch": "CollectiveMismatchError",
}


def _trial(world: int, placement: str, fault: str) -> list[tuple[int, str, float]]:
    ctx = mp.get_context("fork")
    q = ctx.SimpleQueue()  # put() writes at once: ranks end with os._exit
    with socket.socket() as probe:  # a free port for rank 0's store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    procs = [
        ctx.Process(target=_rank, args=(r, world, port, placement, fault, q)) for r in range(world)
    ]
    for p in procs:
        p.start()
    reporters = world if fault == "mismatch" else world - 1
    got = [q.get() for _ in range(reporters)]
    for p in procs:
        p.join(0 if fault == "stop" and p is procs[-1] else 30)
        if p.is_alive():
            p.kill()  # the stopped victim (SIGKILL ends a stopped process too)
            p.join(30)
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--placements", default=",".join(PLACEMENTS))
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--json")
    args = ap.parse_args()
    rows: dict[str, Any] = {}
    for placement in args.placements.split(","):
        for fault in args.faults.split(","):
            times: list[float] = []
            wrong: list[str] = []
            for _ in range(args.trials):
                for _rank_id, kind, seconds in _trial(args.world, placement, fault):
                    if kind != EXPECTED[fault]:
                        wrong.append(kind)
                    times.append(seconds)
            times.sort()
            p50 = statistics.median(times)
            p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
            rows[f"{placement}/{fault}"] = {
                "p50_s": round(p50, 4),
                "p99_s": round(p99, 4),
                "max_s": round(times[-1], 4),
                "samples": len(times),
                "unexpected": wrong,
            }
            print(
                f"{placement:10s} {fault:9s} p50 {p50 * 1e3:8.1f} ms  p99 {p99 * 1e3:8.1f} ms  "
                f"max {times[-1] * 1e3:8.1f} ms  n={len(times)}  unexpected={wrong}",
                flush=True,
            )
    if args.json:
        write_doc(
            args.json,
            "python benchmarks/diagnostics/detection_times.py "
            f"--trials {args.trials} --world {args.world} --placements {args.placements} "
            f"--faults {args.faults}",
            rows,
            what="kill: error time - kill time; stop: error time - op deadline; mismatch: error time - op entry",
        )


if __name__ == "__main__":
    main()
