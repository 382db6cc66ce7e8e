"""gloo's ``monitored_barrier`` over a communicator's send/recv, for the c10d bridge.

Rank 0 posts a receive from every other rank, waits for each under one deadline, then
releases them; a rank that does not arrive in time is named in gloo's words
(``"[Rank 0]: Rank 2 failed to pass monitoredBarrier in 1000 ms"``, or with
``wait_all_ranks`` every missing rank: ``"[Rank 0]: Ranks 1, 2 failed to pass ..."``).
A timed-out receive poisons the communicator like any transport timeout, so after a
failed monitored barrier the group is unusable (the job is failing anyway).
"""

from __future__ import annotations

from datetime import timedelta

import torch

from torchcomms.comm import TorchComm
from torchcomms.errors import CommError, CommTimeoutError


def monitored_barrier(comm: TorchComm, timeout: timedelta | None, wait_all_ranks: bool) -> None:
    timeout = timeout or comm.get_options().timeout
    rank, size = comm.get_rank(), comm.get_size()
    if size == 1:
        return
    ms = int(timeout.total_seconds() * 1000)
    device = comm.get_device()
    if rank != 0:
        arrive = comm.send(
            torch.ones(1, dtype=torch.int32, device=device), 0, True, timeout=timeout
        )
        release = torch.zeros(1, dtype=torch.int32, device=device)
        try:
            comm.recv(release, 0, True, timeout=timeout).wait()
            arrive.wait()
        except CommError as exc:
            raise CommTimeoutError(
                f"[Rank {rank}]: Rank 0 did not release monitoredBarrier within {ms} ms: {exc}"
            ) from exc
        return
    buffers = {r: torch.zeros(1, dtype=torch.int32, device=device) for r in range(1, size)}
    works = {r: comm.recv(buffers[r], r, True, timeout=timeout) for r in buffers}
    missing: list[int] = []
    for r, work in works.items():
        try:
            work.wait()
        except CommError as exc:
            if not wait_all_ranks:
                raise CommTimeoutError(
                    f"[Rank 0]: Rank {r} failed to pass monitoredBarrier in {ms} ms"
                ) from exc
            missing.append(r)
    if missing:
        raise CommTimeoutError(
            f"[Rank 0]: Ranks {', '.join(map(str, missing))} failed to pass monitoredBarrier "
            f"in {ms} ms"
        )
    token = torch.ones(1, dtype=torch.int32, device=device)
    for work in [comm.send(token, r, True, timeout=timeout) for r in range(1, size)]:
        work.wait()
