"""What the failure machinery costs: the same build with it on and off, in one run.

For each transport (shm, tcp), calls interleaved one by one in a rotated order (so
every variant sees the same moment of the machine), on communicators over the same ranks:

* ``on``: the defaults;
* ``off``: a second communicator with ``TORCHCOMM_MISMATCH_CHECK=0`` and, on tcp, a
  liveness period of an hour (its watcher never runs);
* ``off2``: a third like ``off``, the A/A control: what two identical communicators
  differ by here (segment placement, connection order), the noise floor of ``cost``;
* ``same``: the ``on`` communicator with its mismatch check switched off for the call:
  the check alone, free of any difference between communicators (liveness stays on);
* raw ProcessGroupGloo.

    python benchmarks/diagnostics/check_overhead.py [--nproc 2] [--blocks 10] [--iters 200]
        [--transports shm,tcp] [--sizes 8,4096,1048576] [--json out.json]

Prints per (transport, size) the median over blocks of the mean per call: on, off,
``cost`` (on - off, paired per block), ``control`` (off2 - off), ``check`` (on - same)
and gloo.  Reaches into the backend to switch the check (``_check_switch``).
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

SIZES = (8, 4096, 1 << 20)
TRANSPORTS = ("shm", "tcp")
STATES = ("on", "off", "off2")  # one communicator each; "same" reuses "on"
VARIANTS = (*STATES, "same")


def _check_switch(comm: Any) -> Any:
    """The object whose ``check`` attribute turns the mismatch check of ``comm`` on/off."""
    ops = comm._backend._ops
    return getattr(ops, "coll", ops)  # shm: its ShmCollectives; tcp: the TcpOps


def _worker(
    rank: int,
    size: int,
    path: str,
    blocks: int,
    iters: int,
    transports: tuple[str, ...],
    sizes: tuple[int, ...],
    q: object,
) -> None:
    os.environ.update(TORCHCOMM_RANK=str(rank), TORCHCOMM_SIZE=str(size))
    torch.set_num_threads(1)
    import torchcomms
    from torchcomms.transport.gloo import process_group as gloo

    store = dist.FileStore(path, size)
    timeout = datetime.timedelta(seconds=120)
    comms = {}
    for transport in transports:
        for state in STATES:
            os.environ["TORCHCOMM_MISMATCH_CHECK"] = "1" if state == "on" else "0"
            os.environ["TORCHCOMM_LIVENESS_PERIOD_MS"] = "50" if state == "on" else "3600000"
            comms[f"{transport}-{state}"] = torchcomms.new_comm(
                "gloo",
                torch.device("cpu"),
                name=f"c_{transport}_{state}",
                store=store,
                timeout=timeout,
                hints={"transport": transport},
            )
    _, device = gloo.choose_device({}, ["h"] * size, "h", None)
    pg = gloo.new_process_group(dist.PrefixStore("raw", store), rank, size, timeout, device)
    times: dict[str, list[float]] = {}
    for _block in range(blocks):
        for nbytes in sizes:
            t = torch.ones(nbytes // 4, dtype=torch.float32)
            for transport in transports:
                on = comms[f"{transport}-on"]
                switch = _check_switch(on)
                runs = [(v, comms[f"{transport}-{v if v != 'same' else 'on'}"]) for v in VARIANTS]
                spent = dict.fromkeys(VARIANTS, 0.0)
                for state in STATES:
                    comms[f"{transport}-{state}"].barrier(False)
                for i in range(iters):  # call by call, in a rotated order: paired finely
                    shift = i % len(runs)
                    for variant, comm in runs[shift:] + runs[:shift]:
                        switch.check = variant != "same"
                        start = time.perf_counter()
                        comm.all_reduce(t, torchcomms.ReduceOp.SUM, False)
                        spent[variant] += time.perf_counter() - start
                switch.check = True
                for variant in VARIANTS:
                    times.setdefault(f"{transport}-{variant}/{nbytes}", []).append(
                        spent[variant] / iters * 1e6
                    )
            pg.barrier().wait()
            start = time.perf_counter()
            for _ in range(iters):
                pg.allreduce([t]).wait()
            times.setdefault(f"gloo/{nbytes}", []).append(
                (time.perf_counter() - start) / iters * 1e6
            )
    for comm in comms.values():
        comm.finalize()
    if rank == 0:
        q.put(times)  # type: ignore[attr-defined]


def _paired(a: list[float], b: list[float]) -> float:
    """The median over blocks of ``a - b`` in the same block."""
    return statistics.median(x - y for x, y in zip(a, b, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--transports", default=",".join(TRANSPORTS))
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="bytes, comma-separated")
    ap.add_argument("--json")
    args = ap.parse_args()
    transports = tuple(args.transports.split(","))
    sizes = tuple(int(x) for x in args.sizes.split(","))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    path = tempfile.mktemp(prefix="check_overhead_")
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, args.nproc, path, args.blocks, args.iters, transports, sizes, q),
        )
        for r in range(args.nproc)
    ]
    for p in procs:
        p.start()
    times = q.get(timeout=1800)
    for p in procs:
        p.join()
    rows = {}
    for transport in transports:
        for nbytes in sizes:
            blocks = {v: times[f"{transport}-{v}/{nbytes}"] for v in VARIANTS}
            on = statistics.median(blocks["on"])
            off = statistics.median(blocks["off"])
            cost = _paired(blocks["on"], blocks["off"])
            floor = _paired(blocks["off2"], blocks["off"])
            check = _paired(blocks["on"], blocks["same"])
            gloo_p50 = statistics.median(times[f"gloo/{nbytes}"])
            rows[f"{transport}/{nbytes}"] = {
                "on_us": round(on, 2),
                "off_us": round(off, 2),
                "cost_us": round(cost, 2),
                "cost_pct": round(100 * cost / off, 1),
                "control_us": round(floor, 2),
                "control_pct": round(100 * floor / off, 1),
                "check_us": round(check, 2),
                "check_pct": round(100 * check / off, 1),
                "gloo_us": round(gloo_p50, 2),
            }
            print(
                f"{transport:4s} {nbytes:>8d} B  on {on:9.2f}  off {off:9.2f}  "
                f"cost {cost:+8.2f} ({100 * cost / off:+5.1f} %)  control {floor:+8.2f}  "
                f"check {check:+8.2f} ({100 * check / off:+5.1f} %)  gloo {gloo_p50:9.2f}  (us)"
            )
    if args.json:
        write_doc(
            args.json,
            f"python benchmarks/diagnostics/check_overhead.py --nproc {args.nproc} "
            f"--blocks {args.blocks} --iters {args.iters} --transports {args.transports} "
            f"--sizes {args.sizes}",
            rows,
        )


if __name__ == "__main__":
    main()
