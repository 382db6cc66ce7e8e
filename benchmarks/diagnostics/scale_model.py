"""Project ``new_comm``'s store load to 1k, 10k and 100k ranks from measured constants.

    python benchmarks/diagnostics/scale_model.py \
        [--counts benchmarks/results/issue17/scale_counts_o1.json[,FILE...]] \
        [--lazy-counts benchmarks/results/issue17/scale_counts_o1_lazy.json] \
        [--hier-lazy-counts benchmarks/results/issue17/scale_counts_o1_hier_lazy.json] \
        [--detection detection_stop_w8.json,...] [--clients 8] [--ops 4000] [--json out.json]

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
4. Per member, from scale counts that report bytes per member (``scale_counts.py`` now:
   ``bytes_rank0``, ``bytes_others_max``, ...; any file of ``--counts`` that has them, any
   transport in it), per transport and phase (``new_comm``, ``split``, ``reconfigure``):
   a member's round trips (the largest other than rank 0) as a constant, its bytes as
   a + b*ceil(log2 N) (b comes out about 0 since the lane's handshakes carry the
   neighbours' addresses), each with the data's largest relative deviation from a pure
   constant; rank 0's round trips as a constant and its bytes as a member's + a + c*(U - 1),
   U the units it hears from (``backends/cpu/hier/leaders.py``): the hosts' leaders (N / ranks
   per host), or every member when they share one host.  Projects at 1k/10k/100k (with
   the counts' ranks per host) the total round trips and bytes, the store's busy time,
   rank 0's own serial time (its bytes over the bandwidth plus 2 round trips), and checks
   bootstrap (``new_comm``) against 60 s at 100,000 ranks: if it misses, the store
   throughput (ops/s) it would need.
5. "Naming the missing" (a timed-out op naming the ranks that never entered it): the
   design before (every member published its sequence number, the comm's publishes
   capped at 5,000/s; the timed-out rank waited two periods and read all N in one
   ``multi_get``) against the census now (``backends/cpu/tcp/census.py``): its overshoot
   measured with a stopped rank (``detection_times.py --faults stop``, one world size
   per ``--detection`` file), fitted as a + b*log2(N) and projected, against 2 s.

Files of ``--counts`` without per-member bytes feed 2. and 3. (its eager-gloo rows; the
first such file); when none does, those read the committed ``scale_counts_o1.json``.

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
#: The committed counts the first model reads when ``--counts`` names none of its format.
LEGACY_COUNTS = "benchmarks/results/issue17/scale_counts_o1.json"
#: Phases fitted per member.
MEMBER_PHASES = ("new_comm", "split", "reconfigure", "shrink")
#: Bootstrap (``new_comm``) should take under this many seconds at ``TARGET_N`` ranks.
BOOTSTRAP_TARGET_S = 60.0
TARGET_N = 100_000
#: Naming the ranks that never entered a timed-out op should take under this.
NAMING_TARGET_S = 2.0
#: One liveness publish's bytes (key and value) when the counts measured none.
PUBLISH_BYTES_DEFAULT = 32
#: One more member's sequence number in a host leader's summary (decimal and separator).


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


def _clog2(n: float) -> int:
    """ceil(log2 N): a tcp member's lane neighbours."""
    return math.ceil(math.log2(n)) if n > 1 else 0


def _deviation(ys: list[float]) -> float:
    """The data's largest relative deviation from its mean (0: a pure constant)."""
    mean = sum(ys) / len(ys)
    return max(abs(y - mean) for y in ys) / mean if mean else 0.0


def _residual(xs: list[float], ys: list[float], a: float, b: float) -> float:
    """The largest relative deviation of the data from the fit ``a + b x``."""
    return max(
        (abs(y - (a + b * x)) / y if y else 0.0 for x, y in zip(xs, ys, strict=True)),
        default=0.0,
    )


def _per_member_format(rows: dict[str, Any]) -> bool:
    """Counts with bytes per member (``scale_counts.py``'s ``bytes_others_max``)."""
    return any(isinstance(r, dict) and "bytes_others_max" in r for r in rows.values())


def fit_member(rows: dict[str, Any], transport: str, phase: str) -> dict[str, Any] | None:
    """One transport's and phase's per-member fits from per-member-bytes counts.

    Sizes whose comm got another transport than the largest size's (``hier`` at N = 2:
    one host of two is shm) are left out, and so is a split whose halves have one rank.
    """
    sizes = sorted(
        int(k.split("/")[1])
        for k in rows
        if k.startswith(f"{transport}/") and k.endswith(f"/{phase}")
    )
    if not sizes:
        return None
    kind = {n: rows[f"{transport}/{n}/{phase}"].get("transport_kind") for n in sizes}
    excluded: dict[str, str] = {}
    for n in sizes:
        if phase == "split" and n // 2 < 2:
            excluded[str(n)] = "halves of one rank"
        if phase == "shrink" and n - 1 < 2:
            excluded[str(n)] = "one survivor"
    kept = [n for n in sizes if str(n) not in excluded]
    if not kept:
        return None
    want = kind[kept[-1]]
    for n in kept:
        if kind[n] != want:
            excluded[str(n)] = f"got {kind[n]}, not {want}"
    kept = [n for n in kept if str(n) not in excluded]
    row = [rows[f"{transport}/{n}/{phase}"] for n in kept]
    rt = [float(r["ops_others_max"]) for r in row]
    rt0 = [float(r["ops_rank0"]) for r in row]
    mb = [float(r["bytes_others_max"]) for r in row]
    b0 = [float(r["bytes_rank0"]) for r in row]
    logs = [float(_clog2(n)) for n in kept]
    a_mb, b_mb = _fit_line(logs, mb)
    # Rank 0 does what a member does, plus what it hears from each other host's leader
    # and, as its own host's leader, from each member there (``backends/cpu/hier/leaders.py``):
    # fitted against the units it hears from, U - 1 (U: the hosts, or the members when
    # they share one host), the intercept holding its own host's share.
    per_host = int(rows[f"{transport}/{kept[-1]}/{phase}"].get("ranks_per_host") or 0)
    units = [float(_units(n, per_host, phase) - 1) for n in kept]
    extra0 = [b - m for b, m in zip(b0, mb, strict=True)]
    a_b0, c_b0 = _fit_line(units, extra0)
    return {
        "transport_got": want,
        "transport": rows[f"{transport}/{kept[-1]}/{phase}"].get("transport"),
        "sizes": kept,
        "excluded_sizes": excluded,
        "round_trips_member_measured": [round(v) for v in rt],
        "round_trips_member": round(sum(rt) / len(rt), 2),
        "round_trips_member_deviation": round(_deviation(rt), 4),
        "round_trips_rank0_measured": [round(v) for v in rt0],
        "round_trips_rank0": round(sum(rt0) / len(rt0), 2),
        "round_trips_rank0_deviation": round(_deviation(rt0), 4),
        "bytes_member_measured": [round(v) for v in mb],
        "bytes_member_a": round(a_mb, 1),
        "bytes_member_b_per_log2n": round(b_mb, 2),
        "bytes_member_fit": f"{a_mb:.0f} + {b_mb:.1f} * ceil(log2 N)",
        "bytes_member_fit_residual": round(_residual(logs, mb, a_mb, b_mb), 4),
        "bytes_member_deviation": round(_deviation(mb), 4),
        "bytes_rank0_measured": [round(v) for v in b0],
        "ranks_per_host": per_host,
        "bytes_rank0_a": round(a_b0, 1),
        "bytes_rank0_per_unit": round(c_b0, 2),
        "bytes_rank0_fit": f"member + {a_b0:.0f} + {c_b0:.1f} * (U - 1)",
        "bytes_rank0_units": "U: hosts (N / ranks per host), or N on one host",
        # Against rank 0's bytes (a member's + the fit), not the small extra alone.
        "bytes_rank0_fit_residual": round(
            max(
                abs(b - (m + a_b0 + c_b0 * u)) / b
                for b, m, u in zip(b0, mb, units, strict=True)
            ),
            4,
        ),
        "bytes_rank0_deviation": round(_deviation(b0), 4),
    }


def _units(n: int, per_host: int, phase: str) -> int:
    """Whom rank 0 hears from at ``n`` ranks: each host's leader, or every member when
    they share one host (``per_host`` 0); a shrink has one rank less."""
    size = n - 1 if phase == "shrink" else n
    if per_host <= 0:
        return size
    return max(math.ceil(size / per_host), 1)


def project_member(model: dict[str, Any], store: dict[str, float]) -> dict[str, Any]:
    """Store round trips, bytes and time at ``PROJECT``'s sizes from ``fit_member``'s fits.

    ``bootstrap_s`` is the store's busy time plus rank 0's serial time, as if nothing
    overlapped (rank 0's bytes count in both): a bound, checked against the target.
    """
    throughput, bandwidth, rtt = (
        store["throughput_ops_s"],
        store["bandwidth_bytes_s"],
        store["rtt_s"],
    )
    out: dict[str, Any] = {}
    for n in PROJECT:
        member_bytes = model["bytes_member_a"] + model["bytes_member_b_per_log2n"] * _clog2(n)
        units = _units(n, model["ranks_per_host"], "new_comm")
        rank0_bytes = member_bytes + model["bytes_rank0_a"] + model["bytes_rank0_per_unit"] * (
            units - 1
        )
        round_trips = (n - 1) * model["round_trips_member"] + model["round_trips_rank0"]
        total_bytes = (n - 1) * member_bytes + rank0_bytes
        busy = round_trips / throughput + total_bytes / bandwidth
        rank0 = rank0_bytes / bandwidth + 2 * rtt
        bootstrap = busy + rank0
        left = BOOTSTRAP_TARGET_S - total_bytes / bandwidth - rank0
        out[str(n)] = {
            "round_trips_total": round(round_trips),
            "bytes_member": round(member_bytes),
            "hosts_rank0_hears_from": units,
            "bytes_rank0": round(rank0_bytes),
            "bytes_total": round(total_bytes),
            "store_busy_s": round(busy, 3),
            "store_busy_round_trips_s": round(round_trips / throughput, 3),
            "store_busy_bytes_s": round(total_bytes / bandwidth, 3),
            "rank0_serial_s": round(rank0, 4),
            "bootstrap_s": round(bootstrap, 3),
            "meets_target": bootstrap <= BOOTSTRAP_TARGET_S,
            # The throughput that would bring it under the target (None: the bytes alone
            # do not fit).
            "throughput_needed_ops_s": round(round_trips / left) if left > 0 else None,
        }
    return out


#: ``backends.cpu.tcp.census``: the census's budget, and what a silent node costs.
CENSUS_BUDGET_S = 1.5
CENSUS_ACK_S = 0.25


def store_publish_naming_s(
    n: int,
    period_s: float = LIVENESS_PERIOD_S,
    budget_per_s: float = LIVENESS_BUDGET_PER_S,
    *,
    bandwidth_bytes_s: float,
    publish_bytes: float = PUBLISH_BYTES_DEFAULT,
) -> dict[str, float]:
    """The design before the census: every member published its op sequence number at
    most once per ``max(period_s, n / budget_per_s)`` s; the timed-out rank waited two
    periods, then read all n numbers in one ``multi_get``."""
    period = max(period_s, n / budget_per_s)
    return {
        "store_publish_s": 2 * period + n * publish_bytes / bandwidth_bytes_s,
        "store_publish_period_s": period,
    }


def census_fit(detection: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Per placement, the census's measured overshoot (error time - op deadline, a stopped
    rank; ``detection_times.py --faults stop``) and the time per hop it implies.

    A census with one stopped rank waits ``2 * CENSUS_ACK_S`` for it and runs about
    ``4 * log2(N)`` hops; the rest of the overshoot, over the hops, is the time per hop.
    Measured on a machine of ``cores`` cores, it grows with the ranks per core (each hop
    is a process waiting to be scheduled): fitted as ``h1 + k * (N / cores - 1)``, so
    ``h1`` is the hop with a core per rank, as in a deployment (never less than the best
    measured hop divided by its ranks per core)."""
    points: dict[str, list[tuple[int, float, float, int]]] = {}
    for doc in detection:
        world = int(doc["command"].split("--world ")[1].split()[0])
        cores = int(doc.get("machine", {}).get("cores") or os.cpu_count() or 1)
        for key, row in doc["results"].items():
            placement, _, fault = key.partition("/")
            if fault == "stop" and not row.get("unexpected"):
                points.setdefault(placement, []).append((world, row["p50_s"], row["p99_s"], cores))
    if not points:
        return None
    out: dict[str, Any] = {}
    for placement, rows in points.items():
        fits: dict[str, Any] = {}
        for name, idx in (("p50", 1), ("p99", 2)):
            xs = [w / c - 1 for w, *_, c in rows]
            ys = [max(r[idx] - 2 * CENSUS_ACK_S, 0.0) / (4 * math.log2(r[0])) for r in rows]
            if len(set(xs)) > 1:
                mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
                k = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
                    (x - mx) ** 2 for x in xs
                )
                h1 = my - k * mx
            else:
                h1, k = ys[0], 0.0
            fits[name] = {
                "hop_s_per_rank_per_core": [round(y, 5) for y in ys],
                # The intercept, or (if larger) the best measured hop scaled down to a
                # core per rank, as if a hop took time in proportion to ranks per core.
                "hop_s_one_rank_per_core": round(
                    max(h1, min(y / (x + 1) for x, y in zip(xs, ys, strict=True))), 6
                ),
                "hop_s_growth_per_rank_per_core": round(k, 6),
            }
        out[placement] = {"measured": sorted(r[:3] for r in rows), **fits}
    return out


def census_naming_s(n: int, fit: dict[str, Any]) -> dict[str, float]:
    """Projected overshoot of a census with one stopped rank at ``n`` ranks, a core each:
    its two waits for the stopped rank plus ``4 * log2(n)`` hops (p99 hop), and the bound
    the census keeps by construction (its budget, then one more acknowledgement wait)."""
    hop = fit["p99"]["hop_s_one_rank_per_core"]
    projected = 2 * CENSUS_ACK_S + 4 * math.log2(n) * hop
    return {"census_p99_s": projected, "census_bound_s": CENSUS_BUDGET_S + CENSUS_ACK_S}


def _publish_bytes(docs: list[tuple[str, dict[str, Any]]]) -> tuple[float, str]:
    """One liveness publish's bytes, from ``ops_loop`` rows with publishes and no polls."""
    seen = [
        r["poll_bytes_total"] / r["liveness_total"]
        for _, doc in docs
        for k, r in doc["results"].items()
        if k.endswith("/ops_loop")
        and r.get("liveness_total")
        and not r.get("polls_total")
        and "poll_bytes_total" in r
    ]
    if seen:
        return max(seen), "measured: ops_loop's poll_bytes / liveness publishes (largest)"
    return float(PUBLISH_BYTES_DEFAULT), "assumed (no ops_loop publishes counted)"


def _label(transport: str, doc: dict[str, Any], path: str, taken: set[str]) -> str:
    gloo = doc.get("placement", {}).get("gloo_connect")
    if gloo is None:
        command = doc.get("command", "")
        gloo = "eager" if "--eager" in command else "lazy" if "--lazy" in command else "default"
    label = transport if gloo == "default" else f"{transport}-{gloo}"
    if label in taken:
        label = f"{label}@{os.path.basename(path)}"
    taken.add(label)
    return label


def per_member_models(
    docs: list[tuple[str, dict[str, Any]]], store: dict[str, float]
) -> dict[str, Any]:
    """``fit_member`` and ``project_member`` for every transport and phase of ``docs``."""
    out: dict[str, Any] = {}
    taken: set[str] = set()
    for path, doc in docs:
        rows = doc["results"]
        placement = doc.get("placement", {})
        for transport in dict.fromkeys(k.split("/")[0] for k in rows):
            label = _label(transport, doc, path, taken)
            entry: dict[str, Any] = {
                "file": path,
                "transport_asked": transport,
                "placement": placement.get(transport),
                "phases": {},
            }
            for phase in MEMBER_PHASES:
                model = fit_member(rows, transport, phase)
                if model is not None:
                    model["projection"] = project_member(model, store)
                    entry["phases"][phase] = model
            out[label] = entry
    return out


def _print_member(label: str, entry: dict[str, Any]) -> None:
    k = (entry.get("placement") or {}).get("ranks_per_host")
    print(f"{label} ({entry['file']}; ranks per host {k}):")
    for phase, m in entry["phases"].items():
        skipped = ", ".join(f"N={n} ({why})" for n, why in m["excluded_sizes"].items())
        print(
            f"  {phase} over {m['transport_got']}, N = {m['sizes']}"
            + (f" (left out: {skipped})" if skipped else "")
        )
        print(
            f"    round trips per member {m['round_trips_member']:g} "
            f"(measured {m['round_trips_member_measured']}, largest deviation from a "
            f"constant {m['round_trips_member_deviation']:.1%}); rank 0 "
            f"{m['round_trips_rank0']:g} ({m['round_trips_rank0_deviation']:.1%})"
        )
        print(
            f"    bytes per member a + b*ceil(log2 N): a = {m['bytes_member_a']:g}, "
            f"b = {m['bytes_member_b_per_log2n']:g} (measured {m['bytes_member_measured']}, "
            f"largest deviation from a constant {m['bytes_member_deviation']:.1%}, "
            f"from the fit {m['bytes_member_fit_residual']:.1%})"
        )
        print(
            f"    bytes of rank 0 {m['bytes_rank0_fit']} ({m['bytes_rank0_units']}; "
            f"measured {m['bytes_rank0_measured']}, largest deviation from the fit "
            f"{m['bytes_rank0_fit_residual']:.1%})"
        )
        for n, row in m["projection"].items():
            verdict = ""
            if phase == "new_comm" and int(n) == TARGET_N:
                verdict = (
                    f"; target {BOOTSTRAP_TARGET_S:.0f} s: "
                    + ("met" if row["meets_target"] else "MISSED")
                    + (
                        ""
                        if row["meets_target"]
                        else f", needs {row['throughput_needed_ops_s']:,} ops/s"
                        if row["throughput_needed_ops_s"]
                        else ", the bytes alone take longer"
                    )
                )
            print(
                f"    N={int(n):>7,}: {row['round_trips_total']:>10,} round trips, "
                f"{row['bytes_total'] / 1e6:>9,.1f} MB (member {row['bytes_member']:,} B, "
                f"rank 0 {row['bytes_rank0'] / 1e6:,.2f} MB), store busy "
                f"{row['store_busy_s']:8.2f} s, rank 0 serial {row['rank0_serial_s']:.3f} s, "
                f"bootstrap <= {row['bootstrap_s']:.2f} s{verdict}"
            )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--counts",
        default=LEGACY_COUNTS,
        help="scale_counts JSON file(s), comma-separated: files with per-member bytes feed "
        "the per-member model; one without (eager gloo's committed counts) the first model",
    )
    ap.add_argument("--lazy-counts", default="benchmarks/results/issue17/scale_counts_o1_lazy.json")
    ap.add_argument(
        "--hier-lazy-counts",
        default="benchmarks/results/issue17/scale_counts_o1_hier_lazy.json",
    )
    ap.add_argument(
        "--detection",
        default="",
        help="detection_times.py JSON file(s) with the stop fault, comma-separated: the "
        "census's measured overshoot, one world size per file",
    )
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--ops", type=int, default=4000)
    ap.add_argument("--json")
    args = ap.parse_args()
    member_docs: list[tuple[str, dict[str, Any]]] = []
    legacy_counts = None
    for path in args.counts.split(","):
        with open(path) as f:
            doc = json.load(f)
        if _per_member_format(doc["results"]):
            member_docs.append((path, doc))
        elif legacy_counts is None:
            legacy_counts = path
    legacy_counts = legacy_counts or LEGACY_COUNTS
    store = measure_store(args.clients, args.ops)
    print(
        f"TCPStore here: round trip {store['rtt_s'] * 1e6:.0f} us, "
        f"{store['throughput_ops_s']:.0f} ops/s with {args.clients} clients, "
        f"{store['bandwidth_bytes_s'] / 1e6:.0f} MB/s with 1 MiB values",
        flush=True,
    )
    results: dict[str, Any] = {"store": store}
    for label, path, transport in (
        ("shm", legacy_counts, "auto"),
        ("tcp-eager", legacy_counts, "tcp"),
        ("tcp-lazy", args.lazy_counts, "tcp"),
        ("hierarchical-eager", legacy_counts, "hier"),
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
    if member_docs:
        print(
            f"\nPer member (round trips: the largest member but rank 0; bootstrap <= store "
            f"busy + rank 0 serial; target {BOOTSTRAP_TARGET_S:.0f} s at {TARGET_N:,}):"
        )
        members = per_member_models(member_docs, store)
        for label, entry in members.items():
            _print_member(label, entry)
        results["per_member"] = members
    publish_bytes, publish_source = _publish_bytes(member_docs)
    detection = []
    for path in filter(None, args.detection.split(",")):
        with open(path) as f:
            detection.append(json.load(f))
    fits = census_fit(detection)
    naming: dict[str, Any] = {
        "publish_bytes": round(publish_bytes, 1),
        "publish_bytes_source": publish_source,
        "target_s": NAMING_TARGET_S,
        "census_fit": fits,
        "projection": {},
    }
    print(
        f"\nNaming the missing (a timed-out op names who never entered it; target: within "
        f"{NAMING_TARGET_S:g} s of the timeout):\n"
        f"  before: every member published its number, the comm within "
        f"{LIVENESS_BUDGET_PER_S:,.0f}/s; wait 2 periods, read N in one multi_get\n"
        f"  now: a census over the members' listeners (backends/cpu/tcp/census.py): "
        f"2 x {CENSUS_ACK_S} s for the stopped rank + 4*log2(N) hops, a core per rank; "
        f"bounded by {CENSUS_BUDGET_S + CENSUS_ACK_S} s by construction"
    )
    for placement, placed in (fits or {}).items():
        measured = ", ".join(
            f"N={w}: p50 {p50 * 1e3:.0f} ms, p99 {p99 * 1e3:.0f} ms"
            for w, p50, p99 in placed["measured"]
        )
        p99_fit = placed["p99"]
        hops = ", ".join(f"{h * 1e3:.2f}" for h in p99_fit["hop_s_per_rank_per_core"])
        print(
            f"  measured {placement}: {measured}; p99 per hop {hops} ms, fitted "
            f"{p99_fit['hop_s_one_rank_per_core'] * 1e3:.2f} ms with a core per rank"
        )
    for n in PROJECT:
        got: dict[str, Any] = store_publish_naming_s(
            n,
            bandwidth_bytes_s=store["bandwidth_bytes_s"],
            publish_bytes=publish_bytes,
        )
        got = {key: round(v, 4) for key, v in got.items()}
        got["store_publish_within_target"] = got["store_publish_s"] <= NAMING_TARGET_S
        for placement, placed in (fits or {}).items():
            census = census_naming_s(n, placed)
            got[f"census_{placement}_p99_s"] = round(census["census_p99_s"], 4)
            got[f"census_{placement}_within_target"] = census["census_p99_s"] <= NAMING_TARGET_S
        naming["projection"][str(n)] = got
        line = (
            f"  N={n:>7,}: before {got['store_publish_s']:8.3f} s "
            f"(publish every {got['store_publish_period_s']:g} s) "
            f"{'within' if got['store_publish_within_target'] else 'OVER'}"
        )
        for placement in fits or {}:
            line += (
                f"; census {placement} p99 {got[f'census_{placement}_p99_s']:.3f} s "
                f"{'within' if got[f'census_{placement}_within_target'] else 'OVER'}"
            )
        print(line)
    results["naming_the_missing"] = naming
    results["targets"] = {
        "bootstrap_s": BOOTSTRAP_TARGET_S,
        "bootstrap_at_n": TARGET_N,
        "naming_s": NAMING_TARGET_S,
    }
    if args.json:
        write_doc(
            args.json,
            f"python benchmarks/diagnostics/scale_model.py --clients {args.clients} "
            f"--ops {args.ops}"
            + (f" --counts {args.counts}" if args.counts != LEGACY_COUNTS else "")
            + (f" --detection {args.detection}" if args.detection else ""),
            results,
            what="fits of new_comm's per-rank store operations; projections at 1k/10k/100k; "
            "per_member: per transport and phase, round trips and bytes per member and of "
            "rank 0, projected against the bootstrap target; naming_the_missing: the "
            "store-publish design before, and the census's measured fit and projection",
        )


if __name__ == "__main__":
    main()
