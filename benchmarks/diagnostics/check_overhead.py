"""What the failure machinery costs: the same build with it on and off, in one run.

For each transport (shm, tcp) two communicators over the same ranks: ``on`` (the
defaults) and ``off`` (``TORCHCOMM_MISMATCH_CHECK=0``, and on tcp a liveness period of an
hour, so the watcher never runs), plus raw ProcessGroupGloo.  Every block times
``--iters`` back-to-back sync all_reduces per (variant, size), the variants in a rotated
order per block; the figure per variant is the median over blocks of the mean per call.

    python benchmarks/diagnostics/check_overhead.py [--nproc 2] [--blocks 10] [--iters 200]
        [--json out.json]

Prints per (transport, size): on, off, the cost (the median over blocks of on - off in
the same block, microseconds and percent of off), and gloo.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _doc import write_doc

SIZES = (8, 4096, 1 << 20)
TRANSPORTS = ("shm", "tcp")


def _worker(
    rank: int,
    size: int,
    path: str,
    blocks: int,
    iters: int,
    transports: tuple[str, ...],
    sizes: tuple[int, ...],
    q: object,
) -> None:
    os.environ.update(TORCHCOMM_RANK=str(rank), TORCHCOMM_SIZE=str(size))
    torch.set_num_threads(1)
    import torchcomms
    from torchcomms.transport import gloo

    store = dist.FileStore(path, size)
    timeout = datetime.timedelta(seconds=120)
    comms = {}
    for transport in transports:
        for state in ("on", "off"):
            os.environ["TORCHCOMM_MISMATCH_CHECK"] = "1" if state == "on" else "0"
            os.environ["TORCHCOMM_LIVENESS_PERIOD_MS"] = "50" if state == "on" else "3600000"
            comms[f"{transport}-{state}"] = torchcomms.new_comm(
                "gloo",
                torch.device("cpu"),
                name=f"c_{transport}_{state}",
                store=store,
                timeout=timeout,
                hints={"transport": transport},
            )
    _, device = gloo.choose_device({}, ["h"] * size, "h", None)
    pg = gloo.new_process_group(dist.PrefixStore("raw", store), rank, size, timeout, device)
    times: dict[str, list[float]] = {}
    names = list(comms)
    for block in range(blocks):
        for nbytes in sizes:
            t = torch.ones(nbytes // 4, dtype=torch.float32)
            shift = block % len(names)
            for name in names[shift:] + names[:shift]:
                comm = comms[name]
                comm.barrier(False)
                start = time.perf_counter()
                for _ in range(iters):
                    comm.all_reduce(t, torchcomms.ReduceOp.SUM, False)
                times.setdefault(f"{name}/{nbytes}", []).append(
                    (time.perf_counter() - start) / iters * 1e6
                )
            pg.barrier().wait()
            start = time.perf_counter()
            for _ in range(iters):
                pg.allreduce([t]).wait()
            times.setdefault(f"gloo/{nbytes}", []).append(
                (time.perf_counter() - start) / iters * 1e6
            )
    for comm in comms.values():
        comm.finalize()
    if rank == 0:
        q.put(times)  # type: ignore[attr-defined]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--transports", default=",".join(TRANSPORTS))
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="bytes, comma-separated")
    ap.add_argument("--json")
    args = ap.parse_args()
    transports = tuple(args.transports.split(","))
    sizes = tuple(int(x) for x in args.sizes.split(","))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    path = tempfile.mktemp(prefix="check_overhead_")
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, args.nproc, path, args.blocks, args.iters, transports, sizes, q),
        )
        for r in range(args.nproc)
    ]
    for p in procs:
        p.start()
    times = q.get(timeout=1800)
    for p in procs:
        p.join()
    rows = {}
    for transport in transports:
        for nbytes in sizes:
            on_blocks = times[f"{transport}-on/{nbytes}"]
            off_blocks = times[f"{transport}-off/{nbytes}"]
            on = statistics.median(on_blocks)
            off = statistics.median(off_blocks)
            # Paired per block (the same minute of the machine): the robust figure.
            paired = statistics.median(a - b for a, b in zip(on_blocks, off_blocks, strict=True))
            gloo_p50 = statistics.median(times[f"gloo/{nbytes}"])
            rows[f"{transport}/{nbytes}"] = {
                "on_us": round(on, 2),
                "off_us": round(off, 2),
                "cost_us": round(paired, 2),
                "cost_pct": round(100 * paired / off, 1),
                "gloo_us": round(gloo_p50, 2),
            }
            print(
                f"{transport:4s} {nbytes:>8d} B  on {on:9.2f} us  off {off:9.2f} us  "
                f"cost {paired:+8.2f} us ({100 * paired / off:+5.1f} %)  gloo {gloo_p50:9.2f} us"
            )
    if args.json:
        write_doc(
            args.json,
            f"python benchmarks/diagnostics/check_overhead.py --nproc {args.nproc} "
            f"--blocks {args.blocks} --iters {args.iters} --transports {args.transports} "
            f"--sizes {args.sizes}",
            rows,
        )


if __name__ == "__main__":
    main()
