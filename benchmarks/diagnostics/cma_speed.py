"""How fast one process reads another's memory by cross-memory attach, against a memcpy.

    python benchmarks/diagnostics/cma_speed.py [--sizes 128K,512K,2M,8M] [--pieces 4K,64K,512K]

A forked child fills buffers and waits; the parent times ``process_vm_readv`` of each buffer
(``transport.cma``, what the shm single-copy path uses) into its own memory, 200 times, and a
``Tensor.copy_`` of the same size inside the parent, cache-warm both.  Then it reads the
largest size in pieces of ``--pieces`` bytes, one call each: fewer, larger calls pin the
peer's pages in fewer passes.  One process reads, so this is the best case; in a collective
both ranks read at once.  Prints the p50 and its GB/s per row.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch

from torchcomms.bench.metrics import format_size, parse_size
from torchcomms.transport import cma

_REPS = 200


def _p50(samples: list[float]) -> float:
    return sorted(samples)[len(samples) // 2]


def _timed(call: Callable[[], object], reps: int = _REPS) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return _p50(times)


def _row(label: str, nbytes: int, seconds: float) -> str:
    return f"{label:44s} p50 {seconds * 1e6:8.1f} us ({nbytes / seconds / 1e9:5.1f} GB/s)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="128K,512K,2M,8M")
    ap.add_argument("--pieces", default="4K,64K,512K")
    args = ap.parse_args()
    sizes = [parse_size(x) for x in args.sizes.split(",")]
    pieces = [parse_size(x) for x in args.pieces.split(",")]
    if not cma.available():
        raise SystemExit("process_vm_readv is not available here")
    torch.set_num_threads(1)
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the peer: buffers written once, then idle until the parent is done
        buffers = [torch.ones(n, dtype=torch.uint8) for n in sizes]
        os.write(ready_w, ",".join(str(b.data_ptr()) for b in buffers).encode() + b"\n")
        os.read(done_r, 1)
        os._exit(0)
    remote = [int(x) for x in os.read(ready_r, 4096).decode().split(",")]
    try:
        for n, address in zip(sizes, remote, strict=True):
            local, source = torch.empty(n, dtype=torch.uint8), torch.ones(n, dtype=torch.uint8)
            read = _timed(lambda: cma.copy(False, pid, local.data_ptr(), address, n))  # noqa: B023
            copy = _timed(lambda: local.copy_(source))  # noqa: B023
            print(_row(f"read {format_size(n)} from the peer, one call", n, read))
            print(_row(f"copy {format_size(n)} in this process", n, copy))
        n, address = sizes[-1], remote[-1]
        local = torch.empty(n, dtype=torch.uint8)
        for piece in (p for p in pieces if p <= n):

            def in_pieces(piece: int = piece) -> None:
                for at in range(0, n, piece):
                    cma.copy(False, pid, local.data_ptr() + at, address + at, min(piece, n - at))

            print(
                _row(
                    f"read {format_size(n)} in {format_size(piece)} pieces",
                    n,
                    _timed(in_pieces, 50),
                )
            )
    finally:
        os.write(done_w, b"x")
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
