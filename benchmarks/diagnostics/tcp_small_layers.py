"""Where a small two-rank tcp all_reduce's time goes, layer by layer, in the same processes.

    python benchmarks/diagnostics/tcp_small_layers.py [--bytes 16] [--blocks 10] [--iters 300]
        [--json OUT]

Two local ranks over tcp (a ``FileStore``, one torch thread each) run sync in-place SUM
all_reduces of ``--bytes`` float32, ``--iters`` per block, one layer per block in turn:

* ``api``: ``TorchComm.all_reduce`` (validation, op id, flight recorder, the backend);
* ``ops``: the tcp ops object (``TcpOps.all_reduce``: staging, the exchange, the reduction);
* ``exchange+reduce``: the header exchange with the payload, then the rows reduced;
* ``exchange``: the header exchange with the payload alone (the two ranks' bytes cross).

Each figure is the median over the calls of the per-call maximum of the two ranks, and the
CPU time a call took on the slower rank (``time.process_time``).  Wall and CPU time agree:
the waits spin, and a small op's time is the work of both ranks in turn.  The differences
between rows are each layer's own cost as it runs between socket calls, 3-4 times what the
same code costs in a warm loop (``latency_breakdown.py``, one rank): the torch calls after a
``recv`` run on cold caches (benchmarks/results/issue53/NOTES.md, step 14).
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
from _ranks import gather_local_ranks

_CHILD = "TCP_SMALL_LAYERS_CHILD"
_OUT = "TCP_SMALL_LAYERS_OUT"
_LAYERS = ("api", "ops", "exchange+reduce", "exchange")


def _calls(comm: Any, t: torch.Tensor) -> dict[str, Callable[[], None]]:
    from torchcomms import ReduceOp
    from torchcomms.backends.cpu.reductions import reduce_rows
    from torchcomms.runtime import fingerprint as F
    from torchcomms.runtime.deadline import Deadline

    ops = comm.get_backend_impl()._ops
    exchange, n, total = ops.exchange, t.numel(), timedelta(seconds=120)
    s = ReduceOp.SUM

    def exchanged() -> None:
        ops.enter(F.make(F.ALL_REDUCE, t.dtype, n, redop=s), Deadline(total), t)

    def reduced() -> None:
        exchanged()
        reduce_rows(exchange.payload(t.dtype, 0, n), t, s)

    return {
        "api": lambda: comm.all_reduce(t, s, False),
        "ops": lambda: ops.all_reduce(t, s, Deadline(total)),
        "exchange+reduce": reduced,
        "exchange": exchanged,
    }


def _child(nbytes: int, blocks: int, iters: int) -> None:
    import torchcomms

    rank = int(os.environ["TORCHCOMM_RANK"])
    torch.set_num_threads(1)
    comm = torchcomms.new_comm(
        "gloo", torch.device("cpu"), name="small_layers", timeout=timedelta(seconds=120)
    )
    t = torch.ones(max(nbytes // 4, 1))
    calls = _calls(comm, t)
    for call in calls.values():
        for _ in range(100):
            call()
    wall: dict[str, list[float]] = {k: [] for k in _LAYERS}
    cpu: dict[str, float] = dict.fromkeys(_LAYERS, 0.0)
    for block in range(blocks * len(_LAYERS)):
        layer = _LAYERS[block % len(_LAYERS)]
        call, sink = calls[layer], wall[layer]
        c0 = time.process_time()
        for _ in range(iters):
            t0 = time.perf_counter()
            call()
            sink.append(time.perf_counter() - t0)
        cpu[layer] += time.process_time() - c0
    comm.finalize()
    per_call_cpu = {k: cpu[k] / len(wall[k]) for k in _LAYERS}
    Path(f"{os.environ[_OUT]}.{rank}").write_text(json.dumps({"wall": wall, "cpu": per_call_cpu}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if os.environ.get(_CHILD):
        _child(args.bytes, args.blocks, args.iters)
        return
    os.environ["TORCHCOMM_TRANSPORT"] = "tcp"
    ranks = gather_local_ranks(__file__, _CHILD, _OUT)
    results: dict[str, dict[str, float]] = {}
    for layer in _LAYERS:
        pairs = zip(ranks[0]["wall"][layer], ranks[1]["wall"][layer], strict=True)
        p50 = statistics.median(max(a, b) for a, b in pairs) * 1e6
        cpu = max(r["cpu"][layer] for r in ranks) * 1e6
        results[layer] = {"p50_us": round(p50, 1), "cpu_us_per_call": round(cpu, 1)}
        print(f"{layer:>16s}  p50 {p50:7.1f} us   cpu {cpu:7.1f} us per call")
    if args.json:
        write_doc(args.json, " ".join(sys.argv), {"bytes": args.bytes, "layers": results})


if __name__ == "__main__":
    main()
