"""Recovery after a SIGKILL: from ``--world`` ranks down to 1, one kill per round.

    python benchmarks/diagnostics/recovery_times.py [--trials 10] [--world 4] \
        [--placements shm,tcp,tcp-hosts,hier] [--json out.json]

Each trial: the ranks run sync all_reduces in a loop, checking every result.  Each
round, one member (a random order over the original ranks, rank 0 included) SIGKILLs
itself before a random op; the survivors' op raises, they ``shrink()`` and go on.  Per
survivor and round it records, from the kill (``time.monotonic()``, one clock for the
machine):

* ``detect``: until the op raised (and which error type);
* ``shrink``: until ``shrink()`` returned a communicator;
* ``good``: until the first collective on it returned the right value (the figure the
  issue bounds: first good collective after the kill).

``wrong`` counts results that differed from the members' sum; a trial whose last
survivor does not report within its deadline is a ``hang``.  The store is served by a
process of its own (no rank is spared), so the survivors always have one.

Placements: ``shm`` and ``tcp`` on this host, ``tcp-hosts`` (each rank its own simulated
host), ``hier`` (two ranks per simulated host).  Ranks are forked from this process.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import random
import signal
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from _doc import write_doc
from _store_server import served_store

PLACEMENTS = ("shm", "tcp", "tcp-hosts", "hier")
TRIAL_DEADLINE_S = 90.0


def _env(rank: int, world: int, placement: str) -> None:
    os.environ.update(TORCHCOMM_RANK=str(rank), TORCHCOMM_SIZE=str(world))
    os.environ["TORCHCOMM_ABORT_ON_ERROR"] = "0"
    os.environ["TORCHCOMM_FR_DUMP_ON_ERROR"] = "0"  # every round's dumps would be noise here
    if placement == "tcp-hosts":
        os.environ["TORCHCOMM_HOST_ID"] = f"recover-host-{rank}"
    if placement == "hier":
        os.environ["TORCHCOMM_HOST_ID"] = f"recover-host-{rank // 2}"


def _rank(
    rank: int,
    world: int,
    port: int,
    placement: str,
    victims: list[int],
    kill_after: list[int],
    q: Any,
) -> None:
    _env(rank, world, placement)
    import torchcomms
    from torchcomms import ReduceOp

    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=60))
    comm = torchcomms.new_comm(
        "gloo",
        torch.device("cpu"),
        name="recover",
        store=store,
        timeout=datetime.timedelta(seconds=10),
        hints={"transport": {"shm": "shm", "hier": "auto"}.get(placement, "tcp")},
    )
    members = list(range(world))  # original ranks, in comm rank order
    wrong = 0
    count = 0
    for round_, victim in enumerate(victims):
        while True:
            if rank == victim and count == kill_after[round_]:
                store.set(f"killed/{round_}", repr(time.monotonic()))
                os.kill(os.getpid(), signal.SIGKILL)
            t = torch.full((8,), rank + 1, dtype=torch.int64)
            try:
                comm.all_reduce(t, ReduceOp.SUM, False)
            except torchcomms.CommError as exc:
                detected, kind = time.monotonic(), type(exc).__name__
                break
            wrong += int(int(t[0]) != sum(m + 1 for m in members))
            count += 1
        smaller = comm.shrink()
        shrunk = time.monotonic()
        members = [m for m in members if m != victim]
        t = torch.full((8,), rank + 1, dtype=torch.int64)
        smaller.all_reduce(t, ReduceOp.SUM, False)
        good = time.monotonic()
        wrong += int(int(t[0]) != sum(m + 1 for m in members))
        seen = [torch.zeros(1, dtype=torch.int64) for _ in range(smaller.get_size())]
        smaller.all_gather(seen, torch.tensor([rank]), False)
        wrong += int([int(s) for s in seen] != members)
        killed = float(store.get(f"killed/{round_}").decode())
        q.put(
            (
                "round",
                rank,
                round_,
                kind,
                detected - killed,
                shrunk - killed,
                good - killed,
                len(members),
            )
        )
        comm.abort()
        comm.finalize()
        comm = smaller
        count = 0
    q.put(("done", rank, wrong))
    comm.finalize()
    os._exit(0)


def _trial(world: int, placement: str, rng: random.Random) -> dict[str, Any]:
    with served_store() as port:
        return _run_trial(world, port, placement, rng)


def _run_trial(world: int, port: int, placement: str, rng: random.Random) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    q = ctx.SimpleQueue()  # put() writes at once: ranks end with os._exit
    order = list(range(world))
    rng.shuffle(order)
    victims = order[:-1]
    kill_after = [rng.randint(3, 30) for _ in victims]
    procs = [
        ctx.Process(target=_rank, args=(r, world, port, placement, victims, kill_after, q))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    rounds: list[tuple[Any, ...]] = []
    wrong = 0
    done = False
    deadline = time.monotonic() + TRIAL_DEADLINE_S
    while time.monotonic() < deadline:
        if q.empty():
            if all(not p.is_alive() for p in procs):
                break
            time.sleep(0.01)
            continue
        msg = q.get()
        if msg[0] == "round":
            rounds.append(msg[1:])
        else:
            wrong += msg[2]
            done = True
            break
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)
    return {"rounds": rounds, "wrong": wrong, "hang": not done, "victims": victims}


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--placements", default=",".join(PLACEMENTS))
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--json")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    rows: dict[str, Any] = {}
    for placement in args.placements.split(","):
        samples: dict[str, list[float]] = {"detect": [], "shrink": [], "good": []}
        kinds: dict[str, int] = {}
        hangs = wrong = missing = 0
        for _ in range(args.trials):
            got = _trial(args.world, placement, rng)
            hangs += int(got["hang"])
            wrong += got["wrong"]
            # every survivor of every round must have reported it
            want = sum(args.world - 1 - r for r in range(len(got["victims"])))
            missing += want - len(got["rounds"])
            for _rank_id, _round, kind, detect, shrink, good, _size in got["rounds"]:
                kinds[kind] = kinds.get(kind, 0) + 1
                samples["detect"].append(detect)
                samples["shrink"].append(shrink)
                samples["good"].append(good)
        row: dict[str, Any] = {"trials": args.trials, "hangs": hangs, "wrong": wrong}
        row["missing_reports"] = missing
        row["errors_seen"] = kinds
        for name, values in samples.items():
            if values:
                row[f"{name}_p50_s"] = round(statistics.median(values), 4)
                row[f"{name}_p99_s"] = round(_pct(values, 0.99), 4)
                row[f"{name}_max_s"] = round(max(values), 4)
        row["samples"] = len(samples["good"])
        rows[placement] = row
        good = samples["good"] or [float("nan")]
        print(
            f"{placement:10s} kill -> first good collective p50 {statistics.median(good):.3f} s "
            f"p99 {_pct(good, 0.99):.3f} s max {max(good):.3f} s  n={len(samples['good'])}  "
            f"hangs={hangs} wrong={wrong} missing={missing} errors={kinds}",
            flush=True,
        )
    if args.json:
        write_doc(
            args.json,
            "python benchmarks/diagnostics/recovery_times.py "
            f"--trials {args.trials} --world {args.world} --placements {args.placements} "
            f"--seed {args.seed}",
            rows,
            what="seconds from the SIGKILL to: the op's error (detect), shrink() returning "
            "(shrink), the first right collective on the shrunk comm (good)",
        )


if __name__ == "__main__":
    main()
