"""Where a small all_reduce's time goes, layer by layer, on a 1-rank shm communicator.

    python benchmarks/diagnostics/latency_breakdown.py

Prints the best of 5 rounds of 20,000 sync 8-byte all_reduces through: the TorchComm API,
the gloo backend (`impl.all_reduce`), the transport's ops object (`ShmOps.all_reduce`) and the
one-shot algorithm (`ShmCollectives.all_reduce`). The differences are each layer's own cost.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta

import torch

import torchcomms
from torchcomms import ReduceOp
from torchcomms.deadline import Deadline
from torchcomms.types import OpOptions


def best_us(fn: Callable[[], object], calls: int = 20_000, rounds: int = 5) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def main() -> None:
    os.environ.update(
        TORCHCOMM_RANK="0", TORCHCOMM_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0"
    )
    comm = torchcomms.new_comm("gloo", torch.device("cpu"), name="breakdown")
    impl = comm.get_backend_impl()
    shm = impl._ops  # type: ignore[attr-defined]  # the comm's ShmOps
    print("transport:", impl.transport)  # type: ignore[attr-defined]
    t = torch.ones(2)
    op = ReduceOp.SUM
    opts = OpOptions(timedelta(seconds=60), None, "all_reduce", 1)
    deadline = Deadline(timedelta(hours=1))
    rows = [
        ("TorchComm.all_reduce", lambda: comm.all_reduce(t, op, False)),
        ("backend all_reduce", lambda: impl.all_reduce(t, op, False, opts)),
        ("shm ops object", lambda: shm.all_reduce(t, op, deadline)),
        ("one-shot algorithm", lambda: shm.coll.all_reduce(t, op, deadline)),
    ]
    for label, fn in rows:
        print(f"{label:22s} {best_us(fn):6.2f} us")
    comm.finalize()


if __name__ == "__main__":
    main()
