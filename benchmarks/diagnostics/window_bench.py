"""Window put/get latency and bandwidth per size, same host and across hosts, beside memcpy.

    python benchmarks/diagnostics/window_bench.py [--out benchmarks/results/issue14/window_bench.json]

Two ranks, two placements: ``same_host`` (the peers map each other's window: put/get are
copies through shared memory) and ``two_hosts`` (``TORCHCOMM_HOST_ID`` gives the ranks
different host identities on this machine, so the window server carries every op over
TCP on loopback: the network path minus a real wire).  Per size, measured on rank 0:

* ``put_rtt_us``: ``put(S) + signal`` to rank 1, which ``wait_signal``s and signals back
  (median of the round trips): the time to hand data to a peer and hear it arrived;
* ``put_GBps``: ``N`` back-to-back puts of ``S`` bytes, one signal, wait for the ack;
* ``get_us`` / ``get_GBps``: sync ``get(S)`` from rank 1 while rank 1 sits in
  ``wait_signal`` (so, across hosts, its server thread answers);
* ``memcpy_us`` / ``memcpy_GBps``: ``dst.copy_(src)`` of ``S`` bytes in one process, the
  ceiling of a same-host put or get.

GB = 1e9 bytes.  Times are medians of repeated blocks; the machine description is in the
JSON (``_doc.write_doc``).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

SIZES = [8, 64, 512, 4 << 10, 32 << 10, 256 << 10, 2 << 20, 16 << 20, 64 << 20]
PLACEMENTS = {"same_host": ("h0", "h0"), "two_hosts": ("h0", "h1")}


def _iters(nbytes: int) -> int:
    return max(5, min(400, (64 << 20) // max(nbytes, 1)))


def parent() -> None:
    out = "benchmarks/results/issue14/window_bench.json"
    if "--out" in sys.argv:
        out = sys.argv[sys.argv.index("--out") + 1]
    results: dict[str, Any] = {}
    for placement, hosts in PLACEMENTS.items():
        store = os.path.join(tempfile.mkdtemp(), "store")
        report = os.path.join(tempfile.mkdtemp(), "report.json")
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--child", report],
                env={
                    **os.environ,
                    "TORCHCOMM_RANK": str(rank),
                    "TORCHCOMM_SIZE": "2",
                    "TORCHCOMM_STORE_PATH": store,
                    "TORCHCOMM_HOST_ID": hosts[rank],
                    "OMP_NUM_THREADS": "1",
                },
            )
            for rank in range(2)
        ]
        if max(p.wait() for p in procs):
            sys.exit(f"window_bench: a rank failed ({placement})")
        import json

        with open(report) as f:
            results[placement] = json.load(f)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _doc import write_doc

    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    write_doc(out, " ".join(["python", *sys.argv]), results, ranks=2, gb=1e9)
    _print(results)


def _print(results: dict[str, Any]) -> None:
    for placement, rows in results.items():
        print(f"\n{placement}: {rows[0]['transport']}")
        print(
            f"{'size':>10} {'put rtt us':>11} {'put GB/s':>9} {'get us':>9} {'get GB/s':>9} "
            f"{'memcpy us':>10} {'memcpy GB/s':>12}"
        )
        for r in rows:
            print(
                f"{r['bytes']:>10} {r['put_rtt_us']:>11.1f} {r['put_GBps']:>9.3f} "
                f"{r['get_us']:>9.1f} {r['get_GBps']:>9.3f} {r['memcpy_us']:>10.1f} "
                f"{r['memcpy_GBps']:>12.3f}"
            )


def child(report: str) -> None:
    import json

    import torch

    import torchcomms

    torch.set_num_threads(1)
    comm = torchcomms.new_comm(
        "gloo", torch.device("cpu"), name="window_bench", timeout=timedelta(seconds=120)
    )
    rank = comm.get_rank()
    peer = 1 - rank
    biggest = max(SIZES)
    win = comm.new_window(torch.zeros(biggest, dtype=torch.uint8))
    rows = []
    for nbytes in SIZES:
        src = torch.full((nbytes,), 7, dtype=torch.uint8)
        dst = torch.empty(nbytes, dtype=torch.uint8)
        n = _iters(nbytes)
        comm.barrier(False)
        # put + signal, answered by a signal: round trip
        rtts = []
        for _ in range(n):
            if rank == 0:
                t0 = time.perf_counter()
                win.put(src, peer, 0, False)
                win.signal(peer, False)
                win.wait_signal(peer, False)
                rtts.append(time.perf_counter() - t0)
            else:
                win.wait_signal(peer, False)
                win.signal(peer, False)
        # streamed puts: n puts, one signal, one ack
        comm.barrier(False)
        blocks = []
        for _ in range(3):
            if rank == 0:
                t0 = time.perf_counter()
                for _ in range(n):
                    win.put(src, peer, 0, False)
                win.signal(peer, False)
                win.wait_signal(peer, False)
                blocks.append((time.perf_counter() - t0) / n)
            else:
                win.wait_signal(peer, False)
                win.signal(peer, False)
        # gets while the peer waits for a signal
        comm.barrier(False)
        gets = []
        if rank == 0:
            for _ in range(n):
                t0 = time.perf_counter()
                win.get(dst, peer, 0, False)
                gets.append(time.perf_counter() - t0)
            win.signal(peer, False)
        else:
            win.wait_signal(peer, False)
        copies = []
        for _ in range(n):
            t0 = time.perf_counter()
            dst.copy_(src)
            copies.append(time.perf_counter() - t0)
        if rank == 0:
            put_s, get_s, cp_s = min(blocks), statistics.median(gets), statistics.median(copies)
            rows.append(
                {
                    "bytes": nbytes,
                    "iters": n,
                    "transport": str(win.get_attr(peer).access_type.name),
                    "put_rtt_us": statistics.median(rtts) * 1e6,
                    "put_GBps": nbytes / put_s / 1e9,
                    "get_us": get_s * 1e6,
                    "get_GBps": nbytes / get_s / 1e9,
                    "memcpy_us": cp_s * 1e6,
                    "memcpy_GBps": nbytes / cp_s / 1e9,
                }
            )
    comm.barrier(False)
    win.tensor_deregister()
    comm.finalize()
    if rank == 0:
        with open(report, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    if "--child" in sys.argv:
        child(sys.argv[sys.argv.index("--child") + 1])
    else:
        parent()
