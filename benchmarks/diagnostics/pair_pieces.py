"""Two-rank single-copy reductions with different read piece sizes, interleaved in one run.

    python benchmarks/diagnostics/pair_pieces.py 2M reduce 256K,1M,4M
    python benchmarks/diagnostics/pair_pieces.py 8M all_reduce 256K,1M,4M

Each rank is pinned to its own CPU, as ``mpirun`` binds them.  Rounds cycle through the
piece sizes (three ops of each per round, 60 rounds), so a slow spell of the machine lands on
every size alike; rank 0 prints the p25 and p50 of its op time per piece size.  Backs the
choice of ``_PIECE_BYTES`` in ``backends.cpu.shm.single_copy``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import run_local_ranks

from torchcomms.bench.metrics import parse_size


def child() -> None:
    import torch

    import torchcomms
    from torchcomms.backends.cpu.shm import single_copy

    torch.set_num_threads(1)
    rank = int(os.environ["TORCHCOMM_RANK"])
    os.sched_setaffinity(0, {rank % os.cpu_count()})  # type: ignore[operator]
    comm = torchcomms.new_comm("gloo", torch.device("cpu"), name="pair_pieces")
    nbytes, op = parse_size(sys.argv[1]), sys.argv[2]
    pieces = [parse_size(p) for p in sys.argv[3].split(",")]
    tensor = torch.ones(nbytes // 4)
    times: dict[int, list[float]] = {p: [] for p in pieces}
    for _ in range(60):
        for piece in pieces:
            single_copy._PIECE_BYTES = piece  # read at each op
            for _ in range(3):
                comm.barrier(False)
                t0 = time.perf_counter()
                if op == "all_reduce":
                    comm.all_reduce(tensor, torchcomms.ReduceOp.SUM, False)
                else:
                    comm.reduce(tensor, 0, torchcomms.ReduceOp.SUM, False)
                times[piece].append(time.perf_counter() - t0)
            tensor.fill_(1.0)
    if rank == 0:
        for piece in pieces:
            got = sorted(times[piece])
            p25, p50 = got[len(got) // 4] * 1e6, got[len(got) // 2] * 1e6
            print(f"{op} {sys.argv[1]} piece {piece >> 10} KiB: p50 {p50:.0f} us, p25 {p25:.0f} us")
    comm.finalize()


if __name__ == "__main__":
    if os.environ.get("PAIR_PIECES_CHILD"):
        child()
    else:
        sys.exit(run_local_ranks(__file__, "PAIR_PIECES_CHILD"))
