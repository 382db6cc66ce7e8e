"""A/B two source trees on a real 2-rank world: sync op p50 over shm and tcp, alternating.

    python benchmarks/diagnostics/ab_world.py A_SRC B_SRC [--blocks 6] [--iters 300]
        [--ops all_reduce,broadcast,reduce,sendrecv,barrier,all_gather_single,all_to_all_single,
               reduce_scatter_single]
        [--sizes 8,4K,1M] [--transports shm,tcp] [--json out.json]

``A_SRC``/``B_SRC`` are ``src`` folders of two checkouts (e.g. a ``git worktree`` of the
commit before a change, and this one).  Per block, each tree in turn runs one fresh
2-process job (``TORCHCOMM_RANK``/``SIZE``, a ``FileStore``) that times ``--iters`` sync
calls of each op (``--ops``, default all_reduce) per (transport, size) and reports the median
per-call time of rank 0 (``sendrecv``: rank 0 sends and then receives, rank 1 the reverse,
one round trip per call; ``barrier`` has no size; a size is bytes per rank, all_to_all's
total, reduce_scatter's output).  The
blocks run A, B, then B, A, and so on, so a shared machine's drift and the order hit both; the
result is the
median over blocks per tree and B - A in microseconds and percent.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from _doc import write_doc

from torchcomms.bench.metrics import parse_size

OPS = (
    "all_reduce",
    "broadcast",
    "reduce",
    "sendrecv",
    "barrier",
    "all_gather_single",
    "all_to_all_single",
    "reduce_scatter_single",
)

_CHILD = r"""
import json, os, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
import torchcomms
torch.set_num_threads(1)
rank = int(os.environ["TORCHCOMM_RANK"])
store = dist.FileStore(os.environ["AB_STORE"], 2)
iters = int(os.environ["AB_ITERS"])
SUM = torchcomms.ReduceOp.SUM

def call(comm, name, t, out):
    if name == "all_reduce":
        comm.all_reduce(t, SUM, False)
    elif name == "broadcast":
        comm.broadcast(t, 0, False)
    elif name == "reduce":
        comm.reduce(t, 0, SUM, False)
    elif name == "barrier":
        comm.barrier(False)
    elif name == "all_gather_single":
        comm.all_gather_single(out, t, False)
    elif name == "all_to_all_single":
        comm.all_to_all_single(out[: t.numel()], t, False)
    elif name == "reduce_scatter_single":
        comm.reduce_scatter_single(t, out, SUM, False)
    elif rank == 0:  # sendrecv: one round trip
        comm.send(t, 1, False)
        comm.recv(t, 1, False)
    else:
        comm.recv(t, 0, False)
        comm.send(t, 0, False)

out = {}
sizes = [int(x) for x in os.environ["AB_SIZES"].split(",")]
for transport in os.environ["AB_TRANSPORTS"].split(","):
    comm = torchcomms.new_comm("gloo", torch.device("cpu"), name="ab_" + transport,
        store=store, timeout=timedelta(seconds=120), hints={"transport": transport})
    for name in os.environ["AB_OPS"].split(","):
        for nbytes in ((0,) if name == "barrier" else sizes):
            t = torch.ones(max(nbytes // 4, 1))
            gathered = torch.zeros(2 * t.numel())
            for _ in range(max(iters // 10, 5)):
                call(comm, name, t, gathered)
            comm.barrier(False)
            times = []
            for _ in range(iters):
                s = time.perf_counter()
                call(comm, name, t, gathered)
                times.append(time.perf_counter() - s)
            times.sort()
            key = f"{transport}/{nbytes}" if name == "all_reduce" else f"{transport}/{name}/{nbytes}"
            out[key] = times[len(times) // 2] * 1e6
    comm.finalize()
if rank == 0:
    print("RESULT " + json.dumps(out), flush=True)
"""


def _job(src: str, iters: int, ops: str, sizes: str, transports: str) -> dict[str, float]:
    path = tempfile.mktemp(prefix="ab_world_")
    procs = []
    for rank in range(2):
        env = dict(os.environ, PYTHONPATH=src, TORCHCOMM_RANK=str(rank), TORCHCOMM_SIZE="2")
        env.update(AB_STORE=path, AB_ITERS=str(iters), AB_OPS=ops, OMP_NUM_THREADS="1")
        env.update(AB_SIZES=sizes, AB_TRANSPORTS=transports)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _CHILD], env=env, stdout=subprocess.PIPE, text=True
            )
        )
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for line in outs[0].splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT ") :]))
    raise RuntimeError(f"no result from {src}: {outs[0][-2000:]}")


def _tree(src: str) -> str:
    """A source tree by its git commit, not by a path that exists on one machine only."""
    run = subprocess.run
    commit = run(["git", "-C", src, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = run(["git", "-C", src, "status", "--porcelain", "."], capture_output=True, text=True)
    label = commit.stdout.strip() or "an unknown commit"
    return f"src at {label}{' with uncommitted changes' if dirty.stdout.strip() else ''}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("a_src")
    ap.add_argument("b_src")
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--ops", default="all_reduce", help="comma-separated: " + ",".join(OPS))
    ap.add_argument("--sizes", default="8,4K,1M", help="bytes per rank, comma-separated")
    ap.add_argument("--transports", default="shm,tcp")
    ap.add_argument("--json")
    args = ap.parse_args()
    sizes = ",".join(str(parse_size(x)) for x in args.sizes.split(","))
    runs: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    pair = (("A", args.a_src), ("B", args.b_src))
    for block in range(args.blocks):
        # A, B then B, A: whichever runs second in a block finds the machine warmer.
        for tree, src in pair if block % 2 == 0 else pair[::-1]:
            runs[tree].append(
                _job(os.path.abspath(src), args.iters, args.ops, sizes, args.transports)
            )
    rows = {}
    for key in runs["A"][0]:
        if key in runs["B"][0]:
            a = statistics.median(r[key] for r in runs["A"])
            b = statistics.median(r[key] for r in runs["B"])
            rows[key] = {
                "a_us": round(a, 2),
                "b_us": round(b, 2),
                "b_minus_a_us": round(b - a, 2),
                "b_over_a": round(b / a, 3),
            }
            print(f"{key:14s} A {a:9.2f} us  B {b:9.2f} us  B-A {b - a:+8.2f} us  B/A {b / a:.3f}")
    if args.json:
        write_doc(
            args.json,
            f"python benchmarks/diagnostics/ab_world.py A B --blocks {args.blocks} "
            f"--iters {args.iters} --ops {args.ops} --sizes {args.sizes} "
            f"--transports {args.transports}",
            rows,
            a_src=_tree(args.a_src),
            b_src=_tree(args.b_src),
        )


if __name__ == "__main__":
    main()
