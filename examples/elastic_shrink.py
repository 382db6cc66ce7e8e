"""Data-parallel training that survives a killed rank: shrink the communicator and go on.

    python examples/elastic_shrink.py [--nproc 4] [--steps 12] [--kill-rank 2] [--kill-step 5]

The script starts its ranks itself (a launcher such as torchrun would stop every worker
when one dies) and serves their store from this process, so the store outlives any rank.
Each rank trains the same tiny model on its own shard, averaging gradients with
``all_reduce``.  At ``--kill-step`` rank ``--kill-rank`` SIGKILLs itself.  The others'
``all_reduce`` raises ``PeerFailureError`` naming it; they call ``comm.shrink()`` (they
agree on who failed), get a communicator of the survivors with contiguous ranks, redo the
step on it and train on.  At the end every survivor checks that all of them hold the same
parameters, and rank 0 prints the losses.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from _training import LR, batch, build_model

import torchcomms
from torchcomms import ReduceOp, TorchComm


def _average_gradients(comm: TorchComm, model: torch.nn.Module) -> None:
    for p in model.parameters():
        assert p.grad is not None
        comm.all_reduce(p.grad, ReduceOp.AVG, False)


def rank_main(rank: int, world: int, port: int, steps: int, kill: tuple[int, int], q: Any) -> None:
    os.environ.update(TORCHCOMM_RANK=str(rank), TORCHCOMM_SIZE=str(world))
    os.environ["TORCHCOMM_ABORT_ON_ERROR"] = "0"  # raise on a peer failure, do not exit

    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=60))
    comm = torchcomms.new_comm(
        "gloo", torch.device("cpu"), name="train", store=store, timeout=timedelta(seconds=20)
    )
    model = build_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    step = 0
    while step < steps:
        if (rank, step) == kill:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(step, comm.get_rank())
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        try:
            _average_gradients(comm, model)
        except torchcomms.PeerFailureError as exc:
            print(f"rank {rank}: step {step}: {type(exc).__name__}: lost rank(s) {exc.ranks}")
            smaller = comm.shrink()  # the survivors agree on who failed
            comm.abort()
            comm.finalize()
            comm = smaller
            print(f"rank {rank}: now rank {comm.get_rank()} of {comm.get_size()}; redoing step")
            continue  # redo this step on the survivors (no gradient was applied)
        opt.step()
        losses.append(loss.item())
        step += 1
    # Every survivor holds the same parameters.
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    low, high = flat.clone(), flat.clone()
    comm.all_reduce(low, ReduceOp.MIN, False)
    comm.all_reduce(high, ReduceOp.MAX, False)
    assert torch.equal(low, high), "survivors diverged"
    if comm.get_rank() == 0:
        print(f"survivors: {comm.get_size()}; losses: " + " ".join(f"{v:.4f}" for v in losses))
    q.put((rank, comm.get_size(), losses[-1]))
    comm.finalize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--kill-rank", type=int, default=2)
    ap.add_argument("--kill-step", type=int, default=5)
    args = ap.parse_args()
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    # Ranks fork from a server that imported torch once (2 s per interpreter saved); where
    # there is no fork server (Windows), each rank is a new interpreter.
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["__main__", "torch"])
    else:
        ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    kill = (args.kill_rank, args.kill_step)
    procs = [
        ctx.Process(target=rank_main, args=(r, args.nproc, store.port, args.steps, kill, q))
        for r in range(args.nproc)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    codes = {r: p.exitcode for r, p in enumerate(procs)}
    survivors = [r for r in range(args.nproc) if r != args.kill_rank]
    assert codes[args.kill_rank] == -signal.SIGKILL, codes
    assert all(codes[r] == 0 for r in survivors), codes
    results = [q.get() for _ in survivors]
    assert all(size == len(survivors) for _, size, _ in results), results
    print(
        f"ok: rank {args.kill_rank} was killed at step {args.kill_step}; "
        f"{len(survivors)} ranks finished {args.steps} steps with identical parameters"
    )


if __name__ == "__main__":
    main()
