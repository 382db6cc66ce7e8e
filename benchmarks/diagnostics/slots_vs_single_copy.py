"""Which 2-rank shm path is faster, copying through the slots or once by cross-memory attach,
launch after launch.

    python benchmarks/diagnostics/slots_vs_single_copy.py [--launches 6] [--sizes 256K,1M,4M]
        [--ops broadcast,all_reduce,reduce,all_gather,all_to_all] [--blocks 4] [--iters 25]
        [--json OUT]

Each launch starts two local ranks (a ``FileStore``) and first times the launch's *state*: a
1 MiB broadcast through the slots (the root rewrites the slot its peer read two rounds
before), p50 of 100.  Then, per op and size, it alternates blocks of ``--iters`` sync calls
on the slot path (``SingleCopy.usable`` off: one-shot rounds, the slot loops) and on the single
copy (on: every op that can take it at that size), and prints each path's p50 (the slower
rank's).  Sizes are bytes per rank (all_gather's output, all_to_all's input); ``sendrecv``
(not in the default ops) times a round trip of that size each way, through the pair rings or
by rendezvous (``transport.shm.p2p``).

What it shows on the dev VM (benchmarks/results/issue40/NOTES.md, fifth round): the state is
bimodal.  While the host runs both vCPUs on one shared cache, the slot broadcast takes
35-60 us and the slot path wins by 10-40 %; when it does not, a rewritten line must first be
taken back from the other core's cache, the slot broadcast takes 350-560 us and the slot
path loses 4-9x, while the single copy (which writes only the reader's own memory) is as
fast as before.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _doc import write_doc
from _ranks import gather_local_ranks, round_trip

from torchcomms.bench.metrics import format_size, parse_size

_CHILD = "SLOTS_VS_SINGLE_COPY_CHILD"
_OUT = "SLOTS_VS_SINGLE_COPY_OUT"


def _call(comm: Any, op: str, nbytes: int, rank: int) -> Callable[[], object]:
    from torchcomms import ReduceOp

    n = nbytes // 4
    t = torch.ones(n)
    if op == "broadcast":
        return lambda: comm.broadcast(t, 0, False)
    if op == "all_reduce":
        return lambda: comm.all_reduce(t, ReduceOp.MAX, False)
    if op == "reduce":
        return lambda: comm.reduce(t, 0, ReduceOp.MAX, False)
    if op == "sendrecv":  # a round trip: through the pair rings, or by rendezvous
        got = torch.empty(n)
        return lambda: round_trip(comm, rank, t, got)
    if op == "all_gather":  # in place: this rank's row of the output
        row = t[rank * (n // 2) : (rank + 1) * (n // 2)]
        return lambda: comm.all_gather_single(t, row, False)
    out = torch.empty(n)
    return lambda: comm.all_to_all_single(out, t, False)


def _p50(call: Callable[[], object], iters: int, skip: int = 2) -> list[int]:
    times = []
    for i in range(iters + skip):
        t0 = time.perf_counter_ns()
        call()
        if i >= skip:
            times.append(time.perf_counter_ns() - t0)
    return times


def _child(ops: list[str], sizes: list[int], blocks: int, iters: int) -> None:
    import torchcomms

    rank = int(os.environ["TORCHCOMM_RANK"])
    torch.set_num_threads(1)
    os.environ["TORCHCOMM_SHM_P2P_RENDEZVOUS"] = "1"  # sendrecv's single copy (when usable)
    comm = torchcomms.new_comm(
        "gloo", torch.device("cpu"), name="paths", timeout=timedelta(seconds=60)
    )
    coll = comm.get_backend_impl()._ops.coll
    single = coll.single

    def use(single_copy: bool) -> None:
        single.usable = single_copy
        coll.oneshot.bcast_plans.clear()  # a one-shot plan, once kept, would win either way
        comm.barrier(False)

    slot_bcast = torch.ones((1 << 20) // 4)
    half = slot_bcast[rank * len(slot_bcast) // 2 : (rank + 1) * len(slot_bcast) // 2]
    comm.all_gather_single(slot_bcast, half, False)  # the probe (who has a core of their own)
    assert single.usable, "cross-memory attach is not available here"
    use(False)
    state = statistics.median(_p50(lambda: comm.broadcast(slot_bcast, 0, False), 100)) / 1e3
    results: dict[str, Any] = {"slot broadcast 1 MiB": state}
    for op in ops:
        for nbytes in sizes:
            call = _call(comm, op, nbytes, rank)
            got: dict[str, list[int]] = {"slots": [], "single copy": []}
            for _ in range(blocks):
                for path in got:
                    use(path == "single copy")
                    got[path] += _p50(call, iters)
            results[f"{op} {format_size(nbytes)}"] = {
                path: statistics.median(times) / 1e3 for path, times in got.items()
            }
    use(True)
    comm.finalize()
    Path(f"{os.environ[_OUT]}.{rank}").write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=6)
    parser.add_argument("--sizes", default="256K,1M,4M")
    parser.add_argument("--ops", default="broadcast,all_reduce,reduce,all_gather,all_to_all")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--iters", type=int, default=25)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    ops = args.ops.split(",")
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if os.environ.get(_CHILD):
        _child(ops, sizes, args.blocks, args.iters)
        return
    launches = []
    for launch in range(args.launches):
        ranks = gather_local_ranks(__file__, _CHILD, _OUT)
        slower: dict[str, Any] = {}
        for key, value in ranks[0].items():
            if isinstance(value, dict):
                slower[key] = {p: max(r[key][p] for r in ranks) for p in value}
            else:
                slower[key] = max(r[key] for r in ranks)
        launches.append(slower)
        cells = [f"slot broadcast 1 MiB {slower['slot broadcast 1 MiB']:.0f} us"]
        cells += [
            f"{k} {v['slots']:.0f} / {v['single copy']:.0f}"
            for k, v in slower.items()
            if isinstance(v, dict)
        ]
        print(f"launch {launch}: " + " | ".join(cells), flush=True)
    print("(per op and size: slots / single copy, p50 us of the slower rank)")
    if args.json:
        write_doc(args.json, " ".join(sys.argv), {"launches": launches})


if __name__ == "__main__":
    main()
