"""Where a large 2-rank shm op's time goes: the copy, the meeting rounds, the layers above.

    python benchmarks/diagnostics/single_copy_phases.py [--sizes 1M,4M] [--iters 300]
        [--ops all_gather,all_to_all,all_reduce] [--json OUT]

Two local ranks (a ``FileStore``) time ``--iters`` sync calls per op and size, after 100
warm-up calls, with timers around the pieces of the shm path they take: for all_gather (in
place: the input is this rank's row of the output) and all_to_all (a separate input), the
single-copy path's address round (``_addresses``: this rank's own part is copied there),
its reads from the peer (``_read``) and the closing round (``_done``); for all_reduce, the
same on the two-rank path (``_combine``: read, add, write back) from 512 KiB, and below it the
one-shot round (``run``; ``_meet`` is its meeting).  ``layers`` is the whole call less the
path's own method: the TorchComm, backend and shm layers above it.  Sizes are bytes per rank
(all_gather's output).  Prints each rank's medians in µs; compare with ``python
benchmarks/diagnostics/cma_speed.py`` (what a read costs alone) and MPI's time for the same
op (``mpirun -n 2 python -m torchcomms.bench --vs mpi``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _doc import write_doc
from _ranks import run_local_ranks

from torchcomms.bench.metrics import format_size, parse_size

_CHILD = "SINGLE_COPY_PHASES_CHILD"
_OUT = "SINGLE_COPY_PHASES_OUT"
_WARMUP = 100


def _timed(cls: type, name: str, sink: dict[str, list[int]]) -> None:
    """Wrap ``cls.name`` so each call's duration lands in ``sink[name]``."""
    inner = getattr(cls, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return inner(*args, **kwargs)
        finally:
            sink.setdefault(name, []).append(time.perf_counter_ns() - t0)

    setattr(cls, name, wrapper)


def _calls(comm: Any, op: str, nbytes: int, rank: int) -> Callable[[], object]:
    n = nbytes // 4
    if op == "all_gather":
        out = torch.ones(n)
        row = out[rank * (n // 2) : (rank + 1) * (n // 2)]
        return lambda: comm.all_gather_single(out, row, False)
    if op == "all_to_all":
        out, inp = torch.empty(n), torch.ones(n)
        return lambda: comm.all_to_all_single(out, inp, False)
    import torchcomms

    t = torch.ones(n)
    return lambda: comm.all_reduce(t, torchcomms.ReduceOp.SUM, False)


def _child(ops: list[str], sizes: list[int], iters: int) -> None:
    import torchcomms
    from torchcomms.backends.cpu.shm import oneshot, single_copy

    rank = int(os.environ["TORCHCOMM_RANK"])
    torch.set_num_threads(1)
    sink: dict[str, list[int]] = {}
    for name in ("_addresses", "_read", "_combine", "_done"):
        _timed(single_copy.SingleCopy, name, sink)
    for name in ("all_gather", "all_to_all", "all_reduce_pair"):
        _timed(single_copy.SingleCopy, name, sink)
    _timed(oneshot.OneShot, "run", sink)
    _timed(oneshot.OneShot, "_meet", sink)
    comm = torchcomms.new_comm(
        "gloo", torch.device("cpu"), name="phases", timeout=timedelta(seconds=60)
    )
    results: dict[str, dict[str, float]] = {}
    for op in ops:
        for nbytes in sizes:
            call = _calls(comm, op, nbytes, rank)
            for _ in range(_WARMUP):
                call()
            sink.clear()
            whole = []
            for _ in range(iters):
                t0 = time.perf_counter_ns()
                call()
                whole.append(time.perf_counter_ns() - t0)
            row = {"total": statistics.median(whole) / 1e3}
            for name, times in sink.items():
                row[name] = statistics.median(times) / 1e3 * len(times) / iters  # per call
            path = next(
                (k for k in ("all_gather", "all_to_all", "all_reduce_pair", "run") if k in row),
                None,
            )
            if path is not None:
                row["layers"] = row["total"] - row[path]
            results[f"{op} {format_size(nbytes)}"] = row
    comm.finalize()
    Path(f"{os.environ[_OUT]}.{rank}").write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1M,4M")
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--ops", default="all_gather,all_to_all,all_reduce")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    ops = args.ops.split(",")
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if os.environ.get(_CHILD):
        _child(ops, sizes, args.iters)
        return
    out = os.path.join(tempfile.mkdtemp(), "phases.json")
    os.environ[_OUT] = out
    if run_local_ranks(__file__, _CHILD) != 0:
        sys.exit("a rank failed")
    results = {f"rank {r}": json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1)}
    print("median us per call (a piece called twice per op counts twice)")
    for case in results["rank 0"]:
        for who, by_case in results.items():
            cells = "  ".join(f"{k} {v:7.1f}" for k, v in by_case[case].items())
            print(f"{case:18s} {who}  {cells}")
    if args.json:
        write_doc(args.json, " ".join(sys.argv), results)


if __name__ == "__main__":
    main()
