"""Two-rank tcp ops with and without the ring's receive low-water mark, in the same processes.

    python benchmarks/diagnostics/tcp_low_water.py [--ops broadcast,reduce,all_reduce]
        [--sizes 1M,4M,16M,64M] [--blocks 12] [--iters 6] [--load N] [--hosts 2] [--json OUT]

Two ranks over tcp (a ``FileStore``, one torch thread each), on this host or, with
``--hosts 2`` (root), one on each of two simulated hosts (network namespaces and a bridge,
as ``bench --hosts``), run sync ops back to back, ``--iters`` per block, the blocks
alternating between two settings of the same code:

* ``mark``: as shipped: a ring step that only streams into a tensor (a broadcast's
  receiver) asks ``poll`` to wake it once the rest of its block, at most
  ``sockets.LOW_WATER_BYTES``, is queued;
* ``segment``: ``LOW_WATER_BYTES`` 0, so it wakes at the first byte, as before (woken for
  every segment that lands).

A two-rank reduce's root combines what arrives and keeps the default mark in both
settings (a control; with a 1 MiB mark it lost between simulated hosts).

Each figure is the median over the calls of the per-call maximum of the two ranks, and each
rank's CPU time per call (``time.process_time``).  ``--load N`` starts N spinning processes
beside the ranks, as the bench's ``--load`` (benchmarks/results/issue53/NOTES.md, step 15).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _doc import write_doc
from _ranks import gather_local_ranks

_CHILD = "TCP_LOW_WATER_CHILD"
_OUT = "TCP_LOW_WATER_OUT"
_MODES = ("mark", "segment")
_UNITS = {"K": 1 << 10, "M": 1 << 20}


def _size(text: str) -> int:
    unit = _UNITS.get(text[-1:].upper(), 1)
    return int(text[:-1] if unit > 1 else text) * unit


def _call(comm: Any, op: str, rank: int, nbytes: int) -> Callable[[], None]:
    from torchcomms import ReduceOp

    t = torch.full((nbytes // 4,), float(rank + 1))
    if op == "broadcast":
        return lambda: comm.broadcast(t, 0, False)
    if op == "reduce":
        return lambda: comm.reduce(t, 0, ReduceOp.SUM, False)
    if op == "all_reduce":
        return lambda: comm.all_reduce(t, ReduceOp.SUM, False)
    raise SystemExit(f"unknown op {op!r}: broadcast, reduce or all_reduce")


def _child(ops: list[str], sizes: list[int], blocks: int, iters: int) -> None:
    import torchcomms
    from torchcomms.transport.tcp import sockets

    shipped = {"mark": sockets.LOW_WATER_BYTES, "segment": 0}
    rank = int(os.environ["TORCHCOMM_RANK"])
    torch.set_num_threads(1)
    comm = torchcomms.new_comm(
        "gloo", torch.device("cpu"), name="low_water", timeout=timedelta(seconds=300)
    )
    results: dict[str, Any] = {}
    for op in ops:
        for nbytes in sizes:
            call = _call(comm, op, rank, nbytes)
            wall: dict[str, list[float]] = {m: [] for m in _MODES}
            cpu: dict[str, float] = dict.fromkeys(_MODES, 0.0)
            for block in range(blocks * len(_MODES)):
                mode = _MODES[block % len(_MODES)]
                sockets.LOW_WATER_BYTES = shipped[mode]
                call()  # the first after a switch is not counted
                comm.barrier(False)
                c0 = time.process_time()
                for _ in range(iters):
                    t0 = time.perf_counter()
                    call()
                    wall[mode].append(time.perf_counter() - t0)
                cpu[mode] += time.process_time() - c0
                comm.barrier(False)
            per_call = {m: cpu[m] / len(wall[m]) for m in _MODES}
            results[f"{op} {nbytes}"] = {"wall": wall, "cpu": per_call}
    sockets.LOW_WATER_BYTES = shipped["mark"]
    comm.finalize()
    Path(f"{os.environ[_OUT]}.{rank}").write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="broadcast,reduce,all_reduce")
    parser.add_argument("--sizes", default="1M,4M,16M,64M")
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--load", type=int, default=0)
    parser.add_argument("--hosts", type=int, default=1, help="one rank per simulated host (root)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    ops, sizes = args.ops.split(","), [_size(s) for s in args.sizes.split(",")]
    if os.environ.get(_CHILD):
        _child(ops, sizes, args.blocks, args.iters)
        return
    os.environ["TORCHCOMM_TRANSPORT"] = "tcp"
    spin = "import os, sys\nwhile os.getppid() == int(sys.argv[1]): pass"
    load = [
        subprocess.Popen([sys.executable, "-c", spin, str(os.getpid())]) for _ in range(args.load)
    ]
    try:
        ranks = gather_local_ranks(__file__, _CHILD, _OUT, hosts=args.hosts)
    finally:
        for p in load:
            p.kill()
            p.wait()
    results: dict[str, Any] = {}
    for key in ranks[0]:
        op, nbytes = key.split()
        row: dict[str, Any] = {}
        for mode in _MODES:
            pairs = zip(ranks[0][key]["wall"][mode], ranks[1][key]["wall"][mode], strict=True)
            p50 = statistics.median(max(a, b) for a, b in pairs) * 1e6
            cpu = [round(r[key]["cpu"][mode] * 1e6, 1) for r in ranks]
            row[mode] = {"p50_us": round(p50, 1), "cpu_us_per_call": cpu}
        row["segment/mark"] = round(row["segment"]["p50_us"] / row["mark"]["p50_us"], 2)
        results[key] = row
        print(
            f"{op:>10s} {int(nbytes) >> 10:>6d} KiB  mark {row['mark']['p50_us']:9.1f} us "
            f"cpu {row['mark']['cpu_us_per_call']}  segment {row['segment']['p50_us']:9.1f} us "
            f"cpu {row['segment']['cpu_us_per_call']}  segment/mark {row['segment/mark']:.2f}"
        )
    if args.json:
        write_doc(
            args.json, " ".join(sys.argv), results, load=args.load, hosts=args.hosts,
            blocks=args.blocks, iters=args.iters,
        )  # fmt: skip


if __name__ == "__main__":
    main()
