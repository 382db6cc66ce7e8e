"""Quick start: every rank creates a communicator, runs a few collectives, and checks the results.

    torchrun --nproc-per-node 2 examples/quickstart.py
"""

from __future__ import annotations

import torch

from torchcomms import ReduceOp, new_comm


def main() -> None:
    comm = new_comm("gloo", torch.device("cpu"), name="main")
    rank, size = comm.get_rank(), comm.get_size()

    # Synchronous all_reduce: the result is in place when the call returns.
    t = torch.full((1024,), float(rank + 1))
    comm.all_reduce(t, ReduceOp.SUM, async_op=False)
    assert torch.all(t == size * (size + 1) / 2), t

    # Asynchronous all_gather_single: wait() returns once the data has arrived.
    out = torch.empty(size * 4)
    work = comm.all_gather_single(out, torch.full((4,), float(rank)), async_op=True)
    work.wait()
    assert torch.equal(out, torch.arange(size).repeat_interleave(4).float()), out

    # A sub-communicator of the first two ranks (or the only one); the others pass [] and get None.
    first_two = list(range(min(size, 2)))
    pair = comm.split(first_two if rank in first_two else [], "pair")
    if pair is not None:
        x = torch.ones(8)
        pair.all_reduce(x, ReduceOp.SUM, async_op=False)
        assert torch.all(x == min(size, 2)), x
        pair.finalize()

    comm.barrier(async_op=False)
    if rank == 0:
        print(f"quickstart OK: {size} ranks, all_reduce/all_gather_single/split checked")
    comm.finalize()


if __name__ == "__main__":
    main()
