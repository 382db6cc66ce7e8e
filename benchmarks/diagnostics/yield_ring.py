"""A token passed around N processes through shared memory, waiting with sched_yield.

    python benchmarks/diagnostics/yield_ring.py 2
    python benchmarks/diagnostics/yield_ring.py 4

The OS-level floor for hand-overs between processes that do nothing else: prints the time
per hop.
"""

from __future__ import annotations

import mmap
import os
import sys
import time

ROUNDS = 2000


def run(mm: mmap.mmap, index: int, n: int) -> None:
    word = memoryview(mm).cast("q")
    for r in range(ROUNDS):
        target = r * n + index
        while word[0] != target:
            os.sched_yield()
        word[0] = target + 1


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    mm = mmap.mmap(-1, 4096)
    pids = []
    for index in range(1, n):
        pid = os.fork()
        if pid == 0:
            run(mm, index, n)
            os._exit(0)
        pids.append(pid)
    t0 = time.perf_counter()
    run(mm, 0, n)
    elapsed = time.perf_counter() - t0
    for pid in pids:
        os.waitpid(pid, 0)
    print(f"{n} processes: {elapsed / ROUNDS / n * 1e6:.1f} us per hop")


if __name__ == "__main__":
    main()
