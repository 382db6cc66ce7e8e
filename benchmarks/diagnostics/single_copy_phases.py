"""Where a 2-rank shm all_gather or all_to_all on the single-copy path spends its time.

    python benchmarks/diagnostics/single_copy_phases.py [--launches 3] [--sizes 256K,1M,4M]
        [--iters 200] [--json OUT]

Each launch starts two local ranks (a ``FileStore``, one torch thread each) and, per op and
size (bytes of the output, as the bench counts them), times ``--iters`` sync out-of-place
calls through the API, the phases of ``backends.cpu.shm.single_copy.SingleCopy`` inside
them, and a bare ``process_vm_readv`` of the same bytes out of the peer's idle input:

* ``addresses``: the first meeting (publish this rank's address, copy its own part into the
  output meanwhile, wait for every other rank's address);
* ``reads``: the cross-memory reads of the peers' parts;
* ``done``: the second meeting (every rank has finished reading);
* ``above``: the rest of the call, the layers above the single-copy path (API, validation,
  the flight recorder, dispatch, the fingerprint);
* ``bare read``: ``transport.cma.copy`` of one peer part, with the peer waiting at a
  barrier (the copy's floor on this machine).

Every figure is the median over the calls of the slower rank.  This is the table behind
docs/benchmark.md's account of the shared-memory cells at 1-4 MiB against Open MPI.
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

from torchcomms.bench.metrics import format_size, parse_size

_CHILD = "SINGLE_COPY_PHASES_CHILD"
_OUT = "SINGLE_COPY_PHASES_OUT"
_PHASES = ("addresses", "reads", "done")


def _timed(cls: Any, name: str, into: dict[str, list[int]], key: str) -> None:
    """Wrap ``cls.name`` so each call adds its duration (ns) to ``into[key][-1]``."""
    inner = getattr(cls, name)

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return inner(self, *args, **kwargs)
        finally:
            into[key][-1] += time.perf_counter_ns() - t0

    setattr(cls, name, wrapper)


def _call(comm: Any, op: str, nbytes: int) -> tuple[Callable[[], object], torch.Tensor]:
    """The op at ``nbytes`` of output, and this rank's input (what a peer reads of it)."""
    size = comm.get_size()
    out = torch.empty(nbytes // 4)
    if op == "all_gather":
        inp = torch.rand(out.numel() // size)
        return lambda: comm.all_gather_single(out, inp, False), inp
    inp = torch.rand(out.numel())
    return lambda: comm.all_to_all_single(out, inp, False), inp[: inp.numel() // size]


def _child(sizes: list[int], iters: int) -> None:
    import torchcomms
    from torchcomms.backends.cpu.shm import single_copy
    from torchcomms.transport import cma

    rank = int(os.environ["TORCHCOMM_RANK"])
    torch.set_num_threads(1)
    spent: dict[str, list[int]] = {p: [] for p in _PHASES}
    for name, key in (("_addresses", "addresses"), ("_read", "reads"), ("_done", "done")):
        _timed(single_copy.SingleCopy, name, spent, key)
    comm = torchcomms.new_comm(
        "gloo", torch.device("cpu"), name="phases", timeout=timedelta(seconds=60)
    )
    pids = comm.get_backend_impl()._ops.coll.chan.pids  # type: ignore[attr-defined]
    peer = 1 - rank
    results: dict[str, Any] = {}
    for op in ("all_gather", "all_to_all"):
        for nbytes in sizes:
            call, part = _call(comm, op, nbytes)
            for _ in range(10):  # warm up (and the path's probe)
                for times in spent.values():
                    times.append(0)
                call()
            for times in spent.values():
                times.clear()
            totals = []
            for _ in range(iters):
                for times in spent.values():
                    times.append(0)
                t0 = time.perf_counter_ns()
                call()
                totals.append(time.perf_counter_ns() - t0)
            assert all(spent["reads"]), "the op did not take the single-copy path"
            row = {p: statistics.median(spent[p]) / 1e3 for p in _PHASES}
            row["total"] = statistics.median(totals) / 1e3
            above = [t - sum(spent[p][i] for p in _PHASES) for i, t in enumerate(totals)]
            row["above"] = statistics.median(above) / 1e3
            # The bare read: every rank publishes its part's address, then rank 0 reads
            # rank 1's while rank 1 waits at a barrier, and the other way round.
            addresses = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
            comm.all_gather(addresses, torch.tensor([part.data_ptr()]), False)
            scratch = torch.empty_like(part)
            bare = []
            for reader in (0, 1):
                if rank == reader:
                    for _ in range(iters):
                        t0 = time.perf_counter_ns()
                        _, err = cma.copy(
                            False,
                            pids[peer],
                            scratch.data_ptr(),
                            int(addresses[peer].item()),
                            part.numel() * part.element_size(),
                        )
                        bare.append(time.perf_counter_ns() - t0)
                        assert err == 0, os.strerror(err)
                comm.barrier(False)
            row["bare read"] = statistics.median(bare) / 1e3
            results[f"{op} {format_size(nbytes)}"] = row
    comm.finalize()
    Path(f"{os.environ[_OUT]}.{rank}").write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument("--sizes", default="256K,1M,4M")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if os.environ.get(_CHILD):
        _child(sizes, args.iters)
        return
    os.environ.setdefault("TORCHCOMM_TRANSPORT", "shm")
    launches = []
    for launch in range(args.launches):
        ranks = gather_local_ranks(__file__, _CHILD, _OUT)
        slower = {
            key: {k: max(r[key][k] for r in ranks) for k in row} for key, row in ranks[0].items()
        }
        launches.append(slower)
        print(f"launch {launch} (us, slower rank's median):")
        for key, row in slower.items():
            cells = " ".join(f"{k} {v:.0f}" for k, v in row.items())
            print(f"  {key:16s} {cells}", flush=True)
    if args.json:
        write_doc(args.json, " ".join(sys.argv), {"launches": launches})


if __name__ == "__main__":
    main()
