"""What the mismatch check costs on tcp: the same all_reduce on a comm with the header
exchange on, one with it off (``TORCHCOMM_MISMATCH_CHECK=0``) and raw ProcessGroupGloo,
alternating blocks in one run.  Also the shm path (its check is always on) for scale.

    python benchmarks/diagnostics/check_overhead.py [--nproc 2] [--blocks 10] [--iters 200]
        [--json out.json]

Prints p50 per (variant, size) in microseconds; ratios against raw gloo.
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

SIZES = (8, 1024, 1 << 20)


def _worker(rank: int, size: int, path: str, blocks: int, iters: int, q: object) -> None:
    os.environ.update(TORCHCOMM_RANK=str(rank), TORCHCOMM_SIZE=str(size))
    torch.set_num_threads(1)
    import torchcomms
    from torchcomms.transport import gloo

    store = dist.FileStore(path, size)
    timeout = datetime.timedelta(seconds=120)
    comms = {}
    for name, env, transport in (("on", "1", "tcp"), ("off", "0", "tcp"), ("shm", "1", "shm")):
        os.environ["TORCHCOMM_MISMATCH_CHECK"] = env
        comms[name] = torchcomms.new_comm(
            "gloo",
            torch.device("cpu"),
            name=f"c_{name}",
            store=store,
            timeout=timeout,
            hints={"transport": transport},
        )
    _, device = gloo.choose_device({}, ["h"] * size, "h", None)
    pg = gloo.new_process_group(dist.PrefixStore("raw", store), rank, size, timeout, device)
    times: dict[str, list[float]] = {}
    for _ in range(blocks):
        for nbytes in SIZES:
            t = torch.ones(nbytes // 4, dtype=torch.float32)
            for name, comm in comms.items():
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
    ap.add_argument("--json")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    path = tempfile.mktemp(prefix="check_overhead_")
    procs = [
        ctx.Process(target=_worker, args=(r, args.nproc, path, args.blocks, args.iters, q))
        for r in range(args.nproc)
    ]
    for p in procs:
        p.start()
    times = q.get(timeout=1800)
    for p in procs:
        p.join()
    rows = {}
    for nbytes in SIZES:
        gloo_p50 = statistics.median(times[f"gloo/{nbytes}"])
        for name in ("on", "off", "shm", "gloo"):
            p50 = statistics.median(times[f"{name}/{nbytes}"])
            rows[f"{name}/{nbytes}"] = {
                "p50_us": round(p50, 2),
                "vs_gloo": round(gloo_p50 / p50, 3),
            }
            print(f"{name:5s} {nbytes:>8d} B  p50 {p50:9.2f} us  gloo/ours {gloo_p50 / p50:6.3f}")
    if args.json:
        write_doc(
            args.json,
            f"python benchmarks/diagnostics/check_overhead.py --nproc {args.nproc} --blocks {args.blocks} --iters {args.iters}",
            rows,
        )


if __name__ == "__main__":
    main()
