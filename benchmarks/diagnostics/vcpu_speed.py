"""How fast each CPU runs plain Python, sampled over time: is a slow launch the machine's?

    python benchmarks/diagnostics/vcpu_speed.py [--seconds 30] [--every-ms 50] [--json OUT]

One process per usable CPU, each pinned to its CPU, all at once (as the ranks of a job
run): every ``--every-ms`` each times a loop of 20000 integer additions five times and keeps
the fastest, in ns per iteration.  Nothing is shared or communicated, so a CPU whose loop
takes longer than before runs slower for reasons outside the process: on a VM, the host's
placement of that vCPU (another guest on the same physical core, another frequency).
Prints per CPU the fastest, median, 90th percentile and slowest sample, the share of samples
at least 1.3x that CPU's fastest (*slow*), how often it changed between slow and fast, and
its longest slow stretch; then the share of time every CPU was fast at once.  Compare a
launch's small-message times (``python benchmarks/diagnostics/python_floor.py``, ``python -m
torchcomms.bench``) with what its CPUs were doing.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _doc import write_doc

_LOOP = 20000
_SLOW = 1.3  # a sample this many times the CPU's fastest counts as slow


def _loop_ns() -> float:
    """ns per iteration of a plain Python loop, best of five."""
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter_ns()
        x = 0
        for i in range(_LOOP):
            x += i
        best = min(best, (time.perf_counter_ns() - t0) / _LOOP)
    return best


def _sampler(cpu: int, start: float, seconds: float, every_s: float, out: Connection) -> None:
    """Runs in its own process, pinned to ``cpu``; sends (time since start, ns) pairs."""
    os.sched_setaffinity(0, {cpu})
    samples: list[tuple[float, float]] = []
    while time.monotonic() < start:
        time.sleep(0.001)
    tick = start
    while True:
        now = time.monotonic()
        if now - start >= seconds:
            break
        samples.append((now - start, _loop_ns()))
        tick += every_s
        pause = tick - time.monotonic()
        if pause > 0:
            time.sleep(pause)
    out.send(samples)
    out.close()


def _stretches(slow: list[bool], times: list[float]) -> tuple[int, float]:
    """How often the state changed, and the longest slow stretch in seconds."""
    changes = sum(1 for a, b in itertools.pairwise(slow) if a != b)
    longest, begun = 0.0, None
    for is_slow, t in zip(slow, times, strict=True):
        if is_slow and begun is None:
            begun = t
        elif not is_slow and begun is not None:
            longest = max(longest, t - begun)
            begun = None
    if begun is not None:  # slow to the end
        longest = max(longest, times[-1] - begun)
    return changes, longest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--every-ms", type=float, default=50.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    start = time.monotonic() + 0.5
    ctx = mp.get_context("fork")
    pipes, procs = [], []
    for cpu in cpus:
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_sampler, args=(cpu, start, args.seconds, args.every_ms / 1e3, send)
        )
        proc.start()
        pipes.append(recv)
        procs.append(proc)
    series = {cpu: pipe.recv() for cpu, pipe in zip(cpus, pipes, strict=True)}
    for proc in procs:
        proc.join()
    results: dict[str, object] = {}
    slow_at: dict[int, list[tuple[float, bool]]] = {}
    for cpu, samples in series.items():
        times = [t for t, _ in samples]
        ns = [v for _, v in samples]
        fastest = min(ns)
        slow = [v >= _SLOW * fastest for v in ns]
        changes, longest = _stretches(slow, times)
        deciles = statistics.quantiles(ns, n=10)
        row = {
            "samples": len(ns),
            "fastest_ns": fastest,
            "p50_ns": statistics.median(ns),
            "p90_ns": deciles[8],
            "slowest_ns": max(ns),
            "slow_share": sum(slow) / len(slow),
            "changes": changes,
            "longest_slow_s": longest,
            "series": samples,
        }
        results[f"cpu{cpu}"] = row
        slow_at[cpu] = list(zip(times, slow, strict=True))
        print(
            f"cpu{cpu}: {len(ns)} samples, ns/iter fastest {fastest:.1f} p50 {row['p50_ns']:.1f}"
            f" p90 {deciles[8]:.1f} slowest {max(ns):.1f}; slow (>= {_SLOW}x fastest)"
            f" {100 * row['slow_share']:.0f} % of samples, {changes} changes, longest slow"
            f" stretch {longest:.2f} s"
        )
    # Every CPU fast at once: sample i of each series (they tick together).
    count = min(len(v) for v in slow_at.values())
    together = sum(1 for i in range(count) if not any(s[i][1] for s in slow_at.values()))
    results["all_fast_share"] = together / count if count else 0.0
    print(f"every CPU fast at once: {100 * together / max(count, 1):.0f} % of sample times")
    if args.json:
        write_doc(args.json, " ".join(["python", *sys.argv]), results)


if __name__ == "__main__":
    main()
