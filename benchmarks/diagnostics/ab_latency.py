"""A/B the Python cost of a small sync all_reduce between two source trees, layer by layer.

    python benchmarks/diagnostics/ab_latency.py A_SRC B_SRC [--trials 40] [--calls 2000]

``A_SRC`` and ``B_SRC`` are ``src`` folders of two checkouts (e.g. a ``git worktree`` of
the commit before a change, and this one).  One long-lived process per tree, each with a
1-rank shm communicator, takes turns with the other: per trial each times ``--calls``
sync 8-byte all_reduces through each layer it has (``TorchComm.all_reduce``, the backend's
``all_reduce``).  Alternating short trials and keeping the minimum per layer cancels most
of a shared machine's drift (steal time, frequency changes), which a best-of-5 of two
separate runs does not.  Prints min and median per layer for A and B, and B/A of the mins.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

_CHILD = r"""
import os, sys, time
from datetime import timedelta
import torch
import torchcomms
from torchcomms import ReduceOp
from torchcomms.types import OpOptions
os.environ.update(TORCHCOMM_RANK="0", TORCHCOMM_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
comm = torchcomms.new_comm("gloo", torch.device("cpu"), name="ab")
impl = comm.get_backend_impl()
t = torch.ones(2)
op = ReduceOp.SUM
opts = OpOptions(timedelta(seconds=60), None, "all_reduce", 1)
layers = [
    ("TorchComm.all_reduce", lambda: comm.all_reduce(t, op, False)),
    ("backend all_reduce", lambda: impl.all_reduce(t, op, False, opts)),
]
print("ready", flush=True)
for line in sys.stdin:
    calls = int(line)
    out = []
    for _, fn in layers:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    print(" ".join(f"{v:.4f}" for v in out), flush=True)
comm.finalize()
"""
_LAYERS = ("TorchComm.all_reduce", "backend all_reduce")


def _start(src: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=src)
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _trial(proc: subprocess.Popen[str], calls: int) -> list[float]:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(f"{calls}\n")
    proc.stdin.flush()
    return [float(v) for v in proc.stdout.readline().split()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a_src")
    parser.add_argument("b_src")
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    procs = {"A": _start(args.a_src), "B": _start(args.b_src)}
    samples: dict[str, list[list[float]]] = {"A": [], "B": []}
    for i in range(args.trials):
        order = ("A", "B") if i % 2 == 0 else ("B", "A")
        for name in order:
            samples[name].append(_trial(procs[name], args.calls))
    for proc in procs.values():
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait()
    print(f"{args.trials} alternating trials of {args.calls} calls; us per call")
    print(f"{'layer':22s} {'A min':>8s} {'A med':>8s} {'B min':>8s} {'B med':>8s} {'B/A min':>8s}")
    for j, layer in enumerate(_LAYERS):
        a = [s[j] for s in samples["A"]]
        b = [s[j] for s in samples["B"]]
        print(
            f"{layer:22s} {min(a):8.2f} {statistics.median(a):8.2f} {min(b):8.2f} "
            f"{statistics.median(b):8.2f} {min(b) / min(a):8.3f}"
        )


if __name__ == "__main__":
    main()
