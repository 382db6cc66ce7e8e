"""gloo's ``monitored_barrier`` over the members' store, for the c10d bridge.

Each member but rank 0 writes an arrival key and waits for rank 0's release key; rank 0
waits for every arrival under one deadline, then releases them.  A rank that does not
arrive in time is named in gloo's words (``"[Rank 0]: Rank 2 failed to pass
monitoredBarrier in 1000 ms"``, or with ``wait_all_ranks`` every missing rank:
``"[Rank 0]: Ranks 1, 2 failed to pass ..."``), raised as ``CommTimeoutError``.

A timed-out monitored barrier is its expected result (a debugging tool finding a
straggler), not a communicator failure: it goes through the store, never the transport,
so it neither poisons the communicator nor ends the process under
``TORCHCOMM_ABORT_ON_ERROR``, and the communicator stays usable, as c10d's gloo group
does.  Arrivals match like gloo's messages: a member's n-th arrival is rank 0's n-th
consumed arrival from it, so a straggler that arrives late completes rank 0's next
barrier rather than being lost.  Runs on the caller's thread.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from datetime import timedelta

import torch
from torch._C import _distributed_c10d as c10d

from torchcomms.comm import TorchComm
from torchcomms.errors import CommTimeoutError
from torchcomms.runtime.deadline import Deadline


@dataclass
class _Counts:
    """This rank's monitored-barrier counters on one communicator."""

    arrivals: int = 0  # a member: how many times it arrived
    consumed: dict[int, int] = field(default_factory=dict)  # rank 0: arrivals taken per peer


_counts: weakref.WeakKeyDictionary[TorchComm, _Counts] = weakref.WeakKeyDictionary()


def monitored_barrier(comm: TorchComm, timeout: timedelta | None, wait_all_ranks: bool) -> None:
    timeout = timeout or comm.get_options().timeout
    rank, size = comm.get_rank(), comm.get_size()
    if size == 1:
        return
    store = comm._backend.members_store()
    if store is None:
        raise RuntimeError(
            f"monitored_barrier: backend {comm.get_backend()!r} has no store shared by its "
            "members, which the monitored barrier runs through; use barrier()"
        )
    counts = _counts.setdefault(comm, _Counts())
    ms = int(timeout.total_seconds() * 1000)
    deadline = Deadline(timeout)
    if rank != 0:
        counts.arrivals += 1
        store.set(f"monitored_barrier/arrived/{rank}/{counts.arrivals}", "1")
        released = f"monitored_barrier/released/{rank}/{counts.arrivals}"
        if not _arrived(store, released, deadline):
            raise CommTimeoutError(
                f"[Rank {rank}]: Rank 0 did not release monitoredBarrier within {ms} ms"
            )
        store.delete_key(released)
        return
    missing: list[int] = []
    for peer in range(1, size):
        arrival = counts.consumed.get(peer, 0) + 1
        key = f"monitored_barrier/arrived/{peer}/{arrival}"
        if _arrived(store, key, deadline):
            store.delete_key(key)
            # Arrivals of rounds this rank gave up on: the peer waits only for its latest.
            while store.check([f"monitored_barrier/arrived/{peer}/{arrival + 1}"]):
                arrival += 1
                store.delete_key(f"monitored_barrier/arrived/{peer}/{arrival}")
            counts.consumed[peer] = arrival
            continue
        if not wait_all_ranks:
            raise CommTimeoutError(
                f"[Rank 0]: Rank {peer} failed to pass monitoredBarrier in {ms} ms"
            )
        missing.append(peer)
    if missing:
        raise CommTimeoutError(
            f"[Rank 0]: Ranks {', '.join(map(str, missing))} failed to pass monitoredBarrier "
            f"in {ms} ms"
        )
    for peer in range(1, size):
        store.set(f"monitored_barrier/released/{peer}/{counts.consumed[peer]}", "1")


def _arrived(store: c10d.Store, key: str, deadline: Deadline) -> bool:
    """Wait for ``key`` until ``deadline``; past it, one last look without waiting."""
    left = deadline.left_s()
    if left > 0:
        try:
            store.wait([key], timedelta(seconds=left))
            return True
        except torch._C._DistStoreError:  # the wait timed out
            pass
    return bool(store.check([key]))
