"""Which two-rank tcp all_reduce is faster at each size: one exchange of the whole tensor, or
the ring's two steps (reduce-scatter, then all-gather), in the same processes.

    python benchmarks/diagnostics/pair_all_reduce_paths.py [--sizes 512K,1M,2M,4M,8M,16M]
        [--blocks 8] [--iters 15] [--op all_reduce|reduce] [--json OUT]

Two local ranks over tcp (a ``FileStore``, one torch thread each) run ``--iters`` sync
in-place calls per block, the path alternating block by block (both ranks switch together:
``backends.cpu.tcp.ring_ops.PAIR_RING_BYTES`` is set to send every size one way, then the
other), so a slow phase of the machine slows both paths alike.  Each figure is the median
over the calls of the per-call maximum of the two ranks.  ``--op reduce`` compares the
reduce's one transfer to the root with the ring's halves the same way
(``PAIR_REDUCE_RING_BYTES``).

This is the measurement behind ``PAIR_RING_BYTES`` (the ring from 1 MiB to below 8 MiB) and
``PAIR_REDUCE_RING_BYTES`` (never) (benchmarks/results/issue53/NOTES.md, step 12).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _doc import write_doc
from _ranks import gather_local_ranks

from torchcomms.bench.metrics import format_size, parse_size

_CHILD = "PAIR_ALL_REDUCE_PATHS_CHILD"
_OUT = "PAIR_ALL_REDUCE_PATHS_OUT"
#: ``PAIR_RING_BYTES`` that sends every size to the exchange, and every size to the ring.
_WINDOWS = {"exchange": (0, 0), "ring": (0, 1 << 62)}


def _child(sizes: list[int], blocks: int, iters: int, op_name: str) -> None:
    import torchcomms
    from torchcomms import ReduceOp
    from torchcomms.backends.cpu.tcp import ring_ops

    rank = int(os.environ["TORCHCOMM_RANK"])
    torch.set_num_threads(1)
    comm = torchcomms.new_comm(
        "gloo", torch.device("cpu"), name="pair_paths", timeout=timedelta(seconds=120)
    )
    window = "PAIR_RING_BYTES" if op_name == "all_reduce" else "PAIR_REDUCE_RING_BYTES"
    results: dict[str, Any] = {}
    for nbytes in sizes:
        t = torch.rand(nbytes // 4)
        times: dict[str, list[float]] = {path: [] for path in _WINDOWS}
        for block in range(blocks):
            path = list(_WINDOWS)[block % 2]
            setattr(ring_ops, window, _WINDOWS[path])  # read at every call
            for i in range(iters + 2):
                t0 = time.perf_counter()
                if op_name == "all_reduce":
                    comm.all_reduce(t, ReduceOp.SUM, False)
                else:
                    comm.reduce(t, 0, ReduceOp.SUM, False)
                if i >= 2:
                    times[path].append(time.perf_counter() - t0)
        results[format_size(nbytes)] = times
    comm.finalize()
    Path(f"{os.environ[_OUT]}.{rank}").write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="512K,1M,2M,4M,8M,16M")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--op", choices=("all_reduce", "reduce"), default="all_reduce")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if os.environ.get(_CHILD):
        _child(sizes, args.blocks, args.iters, args.op)
        return
    os.environ["TORCHCOMM_TRANSPORT"] = "tcp"
    ranks = gather_local_ranks(__file__, _CHILD, _OUT)
    results: dict[str, dict[str, float]] = {}
    for size in ranks[0]:
        row = {}
        for path in _WINDOWS:
            pairs = zip(ranks[0][size][path], ranks[1][size][path], strict=True)
            row[path] = statistics.median(max(a, b) for a, b in pairs) * 1e6
        results[size] = row
        print(f"{size:>8s}  exchange {row['exchange']:8.0f} us   ring {row['ring']:8.0f} us")
    if args.json:
        write_doc(args.json, " ".join(sys.argv), {"op": args.op, "p50_us": results})


if __name__ == "__main__":
    main()
