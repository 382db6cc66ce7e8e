"""How long a futex wake-up takes to reach a sleeping process on this machine.

    python benchmarks/diagnostics/futex_wake.py

A child process stores a timestamp, then wakes the parent blocked in FUTEX_WAIT; the parent
prints, sorted, the 20 delays between the child's wake call and its own return.
"""

from __future__ import annotations

import mmap
import os
import time

import torch

from torchcomms.transport.shm import futex


def main() -> None:
    mm = mmap.mmap(-1, 4096)
    base = torch.frombuffer(mm, dtype=torch.uint8).data_ptr()
    words = memoryview(mm).cast("q")
    delays = []
    for _ in range(20):
        words[0] = words[1] = 0
        pid = os.fork()
        if pid == 0:
            time.sleep(0.01)
            words[1] = time.perf_counter_ns()
            words[0] = 1
            futex.wake(base, 1)
            os._exit(0)
        futex.wait(base, 0, 1.0)
        woke = time.perf_counter_ns()
        os.waitpid(pid, 0)
        delays.append((woke - words[1]) / 1000)
    print("wake-up delays (us):", " ".join(f"{d:.0f}" for d in sorted(delays)))


if __name__ == "__main__":
    main()
