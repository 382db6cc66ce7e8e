"""Project ``new_comm``'s store load to 1k, 10k and 100k ranks from measured constants.

    python benchmarks/diagnostics/scale_model.py \
        [--counts benchmarks/results/issue17/scale_counts_o1.json] \
        [--lazy-counts benchmarks/results/issue17/scale_counts_o1_lazy.json] \
        [--hier-lazy-counts benchmarks/results/issue17/scale_counts_o1_hier_lazy.json] \
        [--clients 8] [--ops 4000] [--json out.json]

1. Measures one TCPStore here: the round-trip time of one client's ``set``/``get``/
   ``check``, and the throughput of ``--clients`` forked clients hammering it at once.
2. Takes the per-rank store operations of ``new_comm`` from the scale counts
   (``scale_counts.py``): a member other than rank 0 as a + b*log2(N) and rank 0 as
   a + c*N, fitted over N = 2 ... 64 (both constant since every gather is one
   ``multi_get``: b and c come out 0), and the bytes per rank as a + b*N + c*N² (linear
   where a member reads a list of all members; eager gloo's keys hold an address per
   pair, so a rank reads O(N) bytes from each of N peers: quadratic per rank).
3. Projects, per N: total round trips; the store's busy time (round trips over the
   throughput, plus the bytes over the bandwidth measured with large values); rank 0's
   part, which is serial (its round trips x round trip time, plus the gathered bytes over
   the bandwidth); and the liveness watcher's load while ops run: one ``set`` per
   member per publish period, the comm's total capped at ``PUBLISH_BUDGET_PER_S``
   (``backends.cpu_liveness``), so at scale the period stretches and the timeout path's
   "who never entered" waits two of them.

The model is only as good as its inputs: a 2-core VM's throughput is a floor, and a real
deployment's network round trip replaces the loopback one.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from _doc import write_doc
from _store_server import served_store

PROJECT = (1_000, 10_000, 100_000)
LIVENESS_PERIOD_S = 0.05
#: ``backends.cpu_liveness.PUBLISH_BUDGET_PER_S``: a comm's liveness publishes per second.
LIVENESS_BUDGET_PER_S = 5000.0


def _client(port: int, index: int, ops: int, start: Any, q: Any) -> None:
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=60))
    start.wait()
    t0 = time.monotonic()
    for i in range(ops // 2):
        store.set(f"c{index}/{i % 64}", "x" * 32)
        store.get(f"c{index}/{i % 64}")
    q.put(time.monotonic() - t0)
    os._exit(0)


def measure_store(clients: int, ops: int) -> dict[str, float]:
    """One client's round trip, and ``clients`` clients' aggregate ops/s, on one server."""
    ctx = mp.get_context("fork")
    with served_store() as port:
        one = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=60))
        one.set("warm", "1")
        t0 = time.monotonic()
        for _ in range(1000):
            one.check(["warm"])
        rtt = (time.monotonic() - t0) / 1000
        start = ctx.Event()
        q = ctx.SimpleQueue()
        procs = [ctx.Process(target=_client, args=(port, i, ops, start, q)) for i in range(clients)]
        for p in procs:
            p.start()
        time.sleep(1.0)  # every client connected
        t0 = time.monotonic()
        start.set()
        for _ in procs:
            q.get()
        wall = time.monotonic() - t0
        for p in procs:
            p.join(10)
        big = b"x" * (1 << 20)
        t0 = time.monotonic()
        for i in range(20):
            one.set(f"big{i % 2}", big)
            one.get(f"big{i % 2}")
        bandwidth = 40 * len(big) / (time.monotonic() - t0)
        return {
            "rtt_s": rtt,
            "throughput_ops_s": clients * (ops // 2) * 2 / wall,
            "bandwidth_bytes_s": bandwidth,
        }


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x``."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - b * mx, b


def _fit_quadratic(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares ``y = a + b x + c x²`` (the normal equations, by Cramer's rule)."""
    s = [sum(x**k for x in xs) for k in range(5)]
    t = [sum(y * x**k for x, y in zip(xs, ys, strict=True)) for k in range(3)]
    m = [[s[0], s[1], s[2]], [s[1], s[2], s[3]], [s[2], s[3], s[4]]]

    def det(a: list[list[float]]) -> float:
        return (
            a[0][0] * (a[1][1] * a[2][2] - a[1][2] * a[2][1])
            - a[0][1] * (a[1][0] * a[2][2] - a[1][2] * a[2][0])
            + a[0][2] * (a[1][0] * a[2][1] - a[1][1] * a[2][0])
        )

    d = det(m)
    coef = []
    for col in range(3):
        mc = [row[:] for row in m]
        for i in range(3):
            mc[i][col] = t[i]
        coef.append(det(mc) / d)
    return coef[0], coef[1], coef[2]


def _x(n: float, form: str) -> float:
    return math.log2(n) if form == "log" else n


def fit(path: str, transport: str, form: str) -> dict[str, Any]:
    """Fits over the measured sizes: a member as ``a + b*f(N)`` (f: log2 or N), rank 0
    as ``a + c*N``."""
    with open(path) as f:
        rows = json.load(f)["results"]
    sizes = sorted(
        int(k.split("/")[1]) for k in rows if k.startswith(f"{transport}/") and "new_comm" in k
    )
    if transport == "hier":  # one rank per simulated host (N = 2) is flat tcp
        sizes = [n for n in sizes if n >= 4]
    others = [rows[f"{transport}/{n}/new_comm"]["ops_others_max"] for n in sizes]
    rank0 = [rows[f"{transport}/{n}/new_comm"]["ops_rank0"] for n in sizes]
    per_rank_bytes = [rows[f"{transport}/{n}/new_comm"]["bytes_total"] / n for n in sizes]
    a_o, b_o = _fit_line([_x(n, form) for n in sizes], [float(v) for v in others])
    a_0, c_0 = _fit_line([float(n) for n in sizes], [float(v) for v in rank0])
    a_b, b_b, c_b = _fit_quadratic([float(n) for n in sizes], per_rank_bytes)
    if c_b < 0:  # no quadratic term in the data: a negative one would turn bytes negative
        (a_b, b_b), c_b = _fit_line([float(n) for n in sizes], per_rank_bytes), 0.0
    return {
        "sizes": sizes,
        "others_measured": others,
        "rank0_measured": rank0,
        "bytes_per_rank_measured": [round(b) for b in per_rank_bytes],
        "others_fit": f"{a_o:.1f} + {b_o:.2f} * {'log2(N)' if form == 'log' else 'N'}",
        "rank0_fit": f"{a_0:.1f} + {c_0:.2f} * N",
        "bytes_per_rank_fit": f"{a_b:.0f} + {b_b:.1f} * N + {c_b:.2f} * N^2",
        "_others": (a_o, b_o, form),
        "_rank0": (a_0, c_0),
        "_bytes": (a_b, b_b, c_b),
    }


def project(model: dict[str, Any], store: dict[str, float]) -> dict[str, Any]:
    a_o, b_o, form = model["_others"]
    a_0, c_0 = model["_rank0"]
    a_b, b_b, c_b = model["_bytes"]
    out = {}
    for n in PROJECT:
        others = a_o + b_o * _x(n, form)
        rank0 = a_0 + c_0 * n
        total = (n - 1) * others + rank0
        per_rank_bytes = a_b + b_b * n + c_b * n * n
        bandwidth = store["bandwidth_bytes_s"]
        liveness = min(n / LIVENESS_PERIOD_S, LIVENESS_BUDGET_PER_S)
        publish_period_s = max(LIVENESS_PERIOD_S, n / LIVENESS_BUDGET_PER_S)
        out[str(n)] = {
            "ops_per_member": round(others, 1),
            "ops_rank0": round(rank0),
            "ops_total": round(total),
            "bytes_total": round(per_rank_bytes * n),
            "store_busy_s": round(
                total / store["throughput_ops_s"] + per_rank_bytes * n / bandwidth, 2
            ),
            "rank0_serial_s": round(rank0 * store["rtt_s"] + per_rank_bytes / bandwidth, 2),
            "liveness_ops_s_while_ops_run": round(liveness),
            "liveness_share_of_store": round(liveness / store["throughput_ops_s"], 2),
            "liveness_publish_period_s": round(publish_period_s, 3),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--counts", default="benchmarks/results/issue17/scale_counts_o1.json")
    ap.add_argument(
        "--lazy-counts", default="benchmarks/results/issue17/scale_counts_o1_lazy.json"
    )
    ap.add_argument(
        "--hier-lazy-counts",
        default="benchmarks/results/issue17/scale_counts_o1_hier_lazy.json",
    )
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--ops", type=int, default=4000)
    ap.add_argument("--json")
    args = ap.parse_args()
    store = measure_store(args.clients, args.ops)
    print(
        f"TCPStore here: round trip {store['rtt_s'] * 1e6:.0f} us, "
        f"{store['throughput_ops_s']:.0f} ops/s with {args.clients} clients, "
        f"{store['bandwidth_bytes_s'] / 1e6:.0f} MB/s with 1 MiB values",
        flush=True,
    )
    results: dict[str, Any] = {"store": store}
    for label, path, transport in (
        ("shm", args.counts, "auto"),
        ("tcp-eager", args.counts, "tcp"),
        ("tcp-lazy", args.lazy_counts, "tcp"),
        ("hierarchical-eager", args.counts, "hier"),
        ("hierarchical-lazy", args.hier_lazy_counts, "hier"),
    ):
        form = "log"
        model = fit(path, transport, form)
        proj = project(model, store)
        results[label] = {k: v for k, v in model.items() if not k.startswith("_")}
        results[label]["projection"] = proj
        print(
            f"{label}: member {model['others_fit']}, rank 0 {model['rank0_fit']}, "
            f"bytes per rank {model['bytes_per_rank_fit']}"
        )
        for n, row in proj.items():
            print(
                f"  N={int(n):>7,}: total {row['ops_total']:>9,} round trips, "
                f"{row['bytes_total'] / 1e6:>10,.1f} MB, store busy {row['store_busy_s']:9.2f} s, "
                f"rank 0 serial {row['rank0_serial_s']:8.2f} s, liveness "
                f"{row['liveness_ops_s_while_ops_run']:>5,} sets/s "
                f"({row['liveness_share_of_store']:.2f}x the store, every "
                f"{row['liveness_publish_period_s']} s)"
            )
    if args.json:
        write_doc(
            args.json,
            f"python benchmarks/diagnostics/scale_model.py --clients {args.clients} "
            f"--ops {args.ops}",
            results,
            what="fits of new_comm's per-rank store operations; projections at 1k/10k/100k",
        )


if __name__ == "__main__":
    main()
