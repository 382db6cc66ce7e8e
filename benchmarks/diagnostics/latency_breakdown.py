"""Where a small sync op's time goes, layer by layer, on a 1-rank shm communicator.

    python benchmarks/diagnostics/latency_breakdown.py [--calls 20000] [--rounds 7] [--json OUT]

For an 8-byte all_reduce it times the TorchComm API (flight recorder on, no user hooks:
the sync lane), the gloo backend (``impl.all_reduce``), the transport's ops object
(``ShmOps.all_reduce``) and the one-shot algorithm (``ShmCollectives.all_reduce``); the
differences are each layer's own cost.  broadcast, reduce and barrier are timed through
the API and the backend.  The general path (any op with hints, a timeout or a user hook)
is timed with ``hints={}``, and split by two more communicators: one with no observer at
all (validation, op id, options, work) and one whose only observer does nothing (adds
the op record's life cycle); the flight recorder's entry is the rest.

Each row is the best of ``--rounds`` rounds of ``--calls`` calls; the rows are
interleaved round by round, so a noisy neighbour slows every row alike rather than one.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch

import torchcomms
from torchcomms import ReduceOp
from torchcomms.runtime.deadline import Deadline
from torchcomms.types import OpOptions

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _doc import write_doc


class _NoOpObserver:
    def op_scheduled(self, record: object) -> None:
        pass

    def op_finished(self, record: object) -> None:
        pass


def time_rows(rows: dict[str, Callable[[], object]], calls: int, rounds: int) -> dict[str, float]:
    """Best per-call time (µs) of each row, rows interleaved within every round."""
    best = dict.fromkeys(rows, float("inf"))
    for fn in rows.values():  # warm up every path once
        for _ in range(1000):
            fn()
    for _ in range(rounds):
        for label, fn in rows.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best[label] = min(best[label], (time.perf_counter() - t0) / calls * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    os.environ.update(
        TORCHCOMM_RANK="0", TORCHCOMM_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0"
    )
    torch.set_num_threads(1)
    comm = torchcomms.new_comm("gloo", torch.device("cpu"), name="breakdown")
    impl = comm.get_backend_impl()
    shm = impl._ops  # type: ignore[attr-defined]  # the comm's ShmOps
    transport = str(impl.transport)  # type: ignore[attr-defined]
    t = torch.ones(2)
    op = ReduceOp.SUM
    opts = OpOptions(timedelta(seconds=60), None, "all_reduce", 1)
    deadline = Deadline(timedelta(hours=1))
    rows: dict[str, Callable[[], object]] = {
        "api all_reduce": lambda: comm.all_reduce(t, op, False),
        "backend all_reduce": lambda: impl.all_reduce(t, op, False, opts),
        "shm ops all_reduce": lambda: shm.all_reduce(t, op, deadline),
        "algorithm all_reduce": lambda: shm.coll.all_reduce(t, op, deadline),
        "api all_reduce, general path": lambda: comm.all_reduce(t, op, False, hints={}),
        "api broadcast": lambda: comm.broadcast(t, 0, False),
        "backend broadcast": lambda: impl.broadcast(t, 0, False, opts),
        "api reduce": lambda: comm.reduce(t, 0, op, False),
        "backend reduce": lambda: impl.reduce(t, 0, op, False, opts),
        "api barrier": lambda: comm.barrier(False),
        "backend barrier": lambda: impl.barrier(False, opts),
        # The backend's sync path with the grad mode switched off and on around the body
        # (a tensor that requires grad) and left alone (none does: the hot ops' case).
        "sync path, grad mode switched": lambda: impl._run_sync(  # type: ignore[attr-defined]
            opts, shm.all_reduce, (t, op), (), False
        ),
        "sync path, grad mode left alone": lambda: impl._run_sync(  # type: ignore[attr-defined]
            opts, shm.all_reduce, (t, op), (), True
        ),
    }
    bare = torchcomms.new_comm("gloo", torch.device("cpu"), name="breakdown_bare")
    bare._set_observers(())  # type: ignore[attr-defined]  # internal: no flight recorder
    null = torchcomms.new_comm("gloo", torch.device("cpu"), name="breakdown_null")
    null._set_observers((_NoOpObserver(),))  # type: ignore[attr-defined]
    rows["api all_reduce, no observer"] = lambda: bare.all_reduce(t, op, False)
    rows["api all_reduce, no-op observer"] = lambda: null.all_reduce(t, op, False)
    us = time_rows(rows, args.calls, args.rounds)
    for c in (comm, bare, null):
        c.finalize()
    backend = us["backend all_reduce"]
    layers = {
        "TorchComm layer (all_reduce)": us["api all_reduce"] - backend,
        "backend + shm adapter (all_reduce)": backend - us["algorithm all_reduce"],
        "TorchComm layer (broadcast)": us["api broadcast"] - us["backend broadcast"],
        "TorchComm layer (reduce)": us["api reduce"] - us["backend reduce"],
        "TorchComm layer (barrier)": us["api barrier"] - us["backend barrier"],
        "general path (hints given), flight recorder": us["api all_reduce, general path"] - backend,
        "switching the grad mode": us["sync path, grad mode switched"]
        - us["sync path, grad mode left alone"],
        "  of which validation, op id, options, work": us["api all_reduce, no observer"] - backend,
        "  of which the op record's life cycle": us["api all_reduce, no-op observer"]
        - us["api all_reduce, no observer"],
        "  of which the flight recorder's entry": us["api all_reduce, general path"]
        - us["api all_reduce, no-op observer"],
    }
    print("transport:", transport)
    for label, value in us.items():
        print(f"{label:44s} {value:7.2f} us")
    print("-- each layer's own cost")
    for label, value in layers.items():
        print(f"{label:44s} {value:7.2f} us")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_doc(
            str(args.json),
            " ".join(["python", *sys.argv]),
            {"us": us, "layers_us": layers},
            what="best-of-rounds per-call time of sync 8-byte ops on a 1-rank shm comm",
            calls=args.calls,
            rounds=args.rounds,
            transport=transport,
            python=platform.python_version(),
        )
        print("wrote", args.json)


if __name__ == "__main__":
    main()
