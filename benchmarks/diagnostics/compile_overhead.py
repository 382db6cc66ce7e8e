"""What a compiled communicator call costs per call, against the same call run eagerly.

Two ranks (spawned with ``TORCHCOMMS_PATCH_FOR_COMPILE=1``), a small float32 tensor, one
all_reduce per call.  Variants, interleaved call by call in a rotated order on
communicators over the same ranks:

* ``plain``: eager ``all_reduce`` on a plain ``TorchComm`` (what the flag unset gives);
* ``eager``: eager ``all_reduce`` on the traceable communicator the flag creates (the
  ``torch.compiler.is_compiling()`` check is its only extra work);
* ``compiled``: ``torch.compile(fullgraph=True)`` (Inductor) of a function doing that
  all_reduce and returning the tensor: guards, the AOT wrapper, the custom op;
* ``eager_async`` / ``compiled_async``: ``async_op=True`` then ``wait()`` (compiled: both in
  the graph, the op issued on a private copy and written back at the wait).

    python benchmarks/diagnostics/compile_overhead.py [--blocks 10] [--iters 200]
        [--transports shm,tcp] [--numel 8] [--json out.json]

Prints, per transport, the median over blocks of the mean per call, and the paired
difference to ``eager`` / ``plain``.  Reaches into ``torchcomms.comm`` to create the plain
communicator next to the traceable ones (``_set_comm_class``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _doc import write_doc

TRANSPORTS = ("shm", "tcp")
VARIANTS = ("plain", "eager", "compiled", "eager_async", "compiled_async")


def _worker(
    rank: int,
    size: int,
    path: str,
    blocks: int,
    iters: int,
    transports: tuple[str, ...],
    numel: int,
    q: Any,
) -> None:
    os.environ.update(TORCHCOMM_RANK=str(rank), TORCHCOMM_SIZE=str(size))
    torch.set_num_threads(1)
    import torchcomms
    from torchcomms import comm as comm_module

    assert torchcomms.functional.is_torch_compile_supported_and_enabled()
    store = dist.FileStore(path, size)
    timeout = datetime.timedelta(seconds=120)
    SUM = torchcomms.ReduceOp.SUM
    times: dict[str, list[float]] = {}
    for transport in transports:
        traceable = torchcomms.new_comm(
            "gloo", torch.device("cpu"), f"tr_{transport}", store=store, timeout=timeout,
            hints={"transport": transport},
        )  # fmt: skip
        traceable_class = comm_module._comm_class
        comm_module._set_comm_class(comm_module.TorchComm)
        plain = torchcomms.new_comm(
            "gloo", torch.device("cpu"), f"pl_{transport}", store=store, timeout=timeout,
            hints={"transport": transport},
        )  # fmt: skip
        comm_module._set_comm_class(traceable_class)

        def sync(t: torch.Tensor, comm: Any = traceable) -> torch.Tensor:
            comm.all_reduce(t, SUM, False)
            return t

        def async_(t: torch.Tensor, comm: Any = traceable) -> torch.Tensor:
            comm.all_reduce(t, SUM, True).wait()
            return t

        compiled = torch.compile(sync, fullgraph=True)
        compiled_async = torch.compile(async_, fullgraph=True)
        calls = {
            "plain": lambda t, c=plain: c.all_reduce(t, SUM, False),
            "eager": lambda t, c=traceable: c.all_reduce(t, SUM, False),
            "compiled": compiled,
            "eager_async": lambda t, c=traceable: c.all_reduce(t, SUM, True).wait(),
            "compiled_async": compiled_async,
        }
        t = torch.ones(numel)
        for fn in calls.values():  # compile, warm up
            for _ in range(3):
                fn(t)
        runs = list(calls.items())
        for _block in range(blocks):
            spent = dict.fromkeys(VARIANTS, 0.0)
            traceable.barrier(False)
            for i in range(iters):
                shift = i % len(runs)
                for variant, fn in runs[shift:] + runs[:shift]:
                    t.fill_(1.0)
                    start = time.perf_counter()
                    fn(t)
                    spent[variant] += time.perf_counter() - start
                    if t[0].item() != size:
                        raise RuntimeError(f"{variant}: wrong result {t[0].item()}")
            for variant in VARIANTS:
                times.setdefault(f"{transport}-{variant}", []).append(spent[variant] / iters * 1e6)
        traceable.finalize()
        plain.finalize()
    if rank == 0:
        q.put(times)


def _paired(a: list[float], b: list[float]) -> float:
    return statistics.median(x - y for x, y in zip(a, b, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--transports", default=",".join(TRANSPORTS))
    ap.add_argument("--numel", type=int, default=8, help="float32 elements per call")
    ap.add_argument("--json")
    args = ap.parse_args()
    transports = tuple(args.transports.split(","))
    os.environ["TORCHCOMMS_PATCH_FOR_COMPILE"] = "1"  # inherited by the spawned ranks
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    path = tempfile.mktemp(prefix="compile_overhead_")
    size = 2
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, size, path, args.blocks, args.iters, transports, args.numel, q),
        )
        for r in range(size)
    ]
    for p in procs:
        p.start()
    times = q.get(timeout=1800)
    for p in procs:
        p.join()
    rows: dict[str, Any] = {}
    for transport in transports:
        blocks = {v: times[f"{transport}-{v}"] for v in VARIANTS}
        row: dict[str, float] = {
            f"{v}_us": round(statistics.median(blocks[v]), 2) for v in VARIANTS
        }
        row["eager_minus_plain_us"] = round(_paired(blocks["eager"], blocks["plain"]), 2)
        row["compiled_minus_eager_us"] = round(_paired(blocks["compiled"], blocks["eager"]), 2)
        row["compiled_async_minus_eager_async_us"] = round(
            _paired(blocks["compiled_async"], blocks["eager_async"]), 2
        )
        rows[transport] = row
        print(
            f"{transport:4s} {args.numel * 4} B  "
            + "  ".join(f"{v} {row[f'{v}_us']:8.2f}" for v in VARIANTS)
            + f"  | eager-plain {row['eager_minus_plain_us']:+.2f}"
            f"  compiled-eager {row['compiled_minus_eager_us']:+.2f}"
            f"  async: compiled-eager {row['compiled_async_minus_eager_async_us']:+.2f}  (us)"
        )
    if args.json:
        write_doc(
            args.json,
            f"python benchmarks/diagnostics/compile_overhead.py --blocks {args.blocks} "
            f"--iters {args.iters} --transports {args.transports} --numel {args.numel}",
            rows,
            ranks=size,
            nbytes=args.numel * 4,
        )


if __name__ == "__main__":
    main()
