"""The OS floor of a hand-over between two processes that share one core.

    python benchmarks/diagnostics/handover_floor.py

Two forked processes, both pinned to the first allowed core, pass a turn counter in shared
memory 2,000 times each way: once waiting with ``sched_yield``, once sleeping on a futex
(the peer wakes it). They run no torch code between turns, so this is what a switch costs
with warm caches; ``pingpong.py --same-core`` is the same exchange through the communicator.
"""

from __future__ import annotations

import mmap
import os
import sys
import time

import torch

from torchcomms.transport.shm import futex

ROUNDS = 2000


def run(mode: str, words: memoryview, base: int, me: int) -> None:
    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    other = 1 - me
    for i in range(ROUNDS):
        turn = 2 * i + me  # this process moves when the counter equals its turn
        while words[0] != turn:
            if mode == "yield":
                os.sched_yield()
                continue
            seen = words[8 + me]
            words[16 + me] = 1  # "asleep", then re-check before sleeping
            if words[0] != turn:
                futex.wait(base + (8 + me) * 8, seen, 0.01)
            words[16 + me] = 0
        words[0] = turn + 1
        if mode == "futex" and words[16 + other]:
            words[8 + other] += 1
            futex.wake(base + (8 + other) * 8)


def measure(mode: str) -> float:
    mm = mmap.mmap(-1, 4096)
    base = torch.frombuffer(mm, dtype=torch.uint8).data_ptr()
    words = memoryview(mm).cast("q")
    pid = os.fork()
    if pid == 0:
        run(mode, words, base, 1)
        os._exit(0)
    t0 = time.perf_counter()
    run(mode, words, base, 0)
    os.waitpid(pid, 0)
    return (time.perf_counter() - t0) / (2 * ROUNDS) * 1e6


def main() -> None:
    if not futex.AVAILABLE:
        sys.exit("needs Linux futexes")
    for mode in ("yield", "futex"):
        print(f"{mode:5s}: {measure(mode):6.1f} us per hand-over (both processes on one core)")


if __name__ == "__main__":
    main()
