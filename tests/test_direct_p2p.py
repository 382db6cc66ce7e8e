"""The direct path of a sync send/recv (issue 15), on shm and tcp, 2 real processes.

A sync untagged ``send``/``recv`` goes straight to the transport: on shm, ``send_now``
and ``recv_now`` move one small message through the pair ring with byte slice
assignments while nothing else is posted; on tcp, the engine reads into the caller's
tensor through a non-owning byte view.  Everything the direct path does not take must
still work through ``post``, in order:

* sizes around the ring's chunk (0 B, 1 B, a chunk, a chunk + 1, several chunks) and
  dtypes numpy has no type for (bfloat16, bool), exact;
* a message that arrived before its receive, and a sender three messages ahead of its
  receiver (a full ring on shm: the third send waits in ``post``);
* async sends and receives posted around sync ones: issue order is kept;
* a tagged message ahead of an untagged sync receive is set aside for its own receive;
* a receive of the wrong size fails naming both sizes, and nothing is written;
* a receive bumps the tensor's autograd version, as an in-place op would;
* on shm, the direct path really took messages on both ranks, so the cases above test it.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.harness import RankContext, run_ranks
from tests.test_lane import _comm
from torchcomms import CommError


def _payload(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    return torch.randn(n, generator=g).to(dtype) * 100


def _direct(ctx: RankContext, transport: str) -> dict[str, object]:
    comm = _comm(ctx, f"direct-{transport}", transport)
    rank, peer = comm.get_rank(), 1 - comm.get_rank()
    ops = comm.get_backend_impl()._ops  # type: ignore[attr-defined]
    chunk = ops.p2p._chunk if transport == "shm" else 8192
    taken = {"send_now": 0, "recv_now": 0}
    if transport == "shm":  # count the messages the direct path took (it is not replaced)
        for name in taken:
            real = getattr(ops.p2p, name)

            def counted(*args: object, _real=real, _name=name) -> bool:  # type: ignore[no-untyped-def]
                took = _real(*args)
                taken[_name] += took
                return took

            setattr(ops.p2p, name, counted)
    cases = [
        (0, torch.float32),
        (1, torch.uint8),
        (2, torch.float32),
        (chunk // 4, torch.float32),
        (chunk + 1, torch.uint8),
        (3 * chunk // 2 + 3, torch.int64),
        (33, torch.bfloat16),
        (65, torch.bool),
    ]
    bad: list[str] = []
    # 1. Sizes and dtypes, ping-pong: rank 0 sends, rank 1 sends it back.
    for seed, (n, dtype) in enumerate(cases):
        want = _payload(n, dtype, seed)
        got = torch.zeros_like(want)
        if rank == 0:
            comm.send(want, peer, False)
            comm.recv(got, peer, False)
        else:
            comm.recv(got, peer, False)
            comm.send(got, peer, False)
        if not torch.equal(got, want):
            bad.append(f"ping-pong {n} x {dtype}")
    # 2. Arrived before its receive; a sender three messages ahead (a full ring on shm).
    msgs = [_payload(16, torch.float32, 100 + i) for i in range(3)]
    if rank == 0:
        for m in msgs:
            comm.send(m, peer, False)
    else:
        time.sleep(0.3)  # every send is posted (or waits for room) by now
        for i, m in enumerate(msgs):
            got = torch.zeros(16)
            comm.recv(got, peer, False)
            if not torch.equal(got, m):
                bad.append(f"ahead {i}")
    # 3. Async ops posted around sync ones keep issue order.
    a, b, c = (_payload(8, torch.float32, 200 + i) for i in range(3))
    if rank == 0:
        w = comm.send(a, peer, True)
        comm.send(b, peer, False)
        w.wait()
        comm.send(c, peer, False)
    else:
        ga, gb, gc = torch.zeros(8), torch.zeros(8), torch.zeros(8)
        w = comm.recv(ga, peer, True)
        comm.recv(gb, peer, False)
        w.wait()
        comm.recv(gc, peer, False)
        for name, got, want in (("a", ga, a), ("b", gb, b), ("c", gc, c)):
            if not torch.equal(got, want):
                bad.append(f"order {name}")
    # 3b. A tagged message ahead of an untagged one: the direct receive leaves it in the
    # ring (its tag is not for it), the general path sets it aside, the tagged receive
    # takes it after.
    tagged, plain = _payload(5, torch.float32, 300), _payload(5, torch.float32, 301)
    if rank == 0:
        w = comm.send(tagged, peer, True, hints={"tag": "7"})
        comm.send(plain, peer, False)
        w.wait()
    else:
        time.sleep(0.2)  # both messages are in the ring before the receive
        got_plain, got_tagged = torch.zeros(5), torch.zeros(5)  # one size: the tag decides
        comm.recv(got_plain, peer, False)
        comm.recv(got_tagged, peer, False, hints={"tag": "7"})
        if not (torch.equal(got_plain, plain) and torch.equal(got_tagged, tagged)):
            bad.append("tagged ahead of untagged")
    # 4. The autograd version moves on a receive.
    t = torch.zeros(4)
    before = t._version
    if rank == 0:
        comm.send(torch.ones(4), peer, False)
    else:
        comm.recv(t, peer, False)
        if t._version == before or not torch.equal(t, torch.ones(4)):
            bad.append(f"version {before} -> {t._version}")
    # 5. A receive of the wrong size fails naming both sizes; nothing is written.
    mismatch = ""
    if rank == 0:
        comm.send(torch.ones(8), peer, False)
    else:
        small = torch.zeros(4)
        try:
            comm.recv(small, peer, False)
            mismatch = "returned"
        except CommError as exc:
            mismatch = str(exc)
        if torch.count_nonzero(small):
            bad.append("the failed receive wrote into the tensor")
    return {"bad": bad, "mismatch": mismatch, "taken": taken}


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_direct_sends_and_receives_stay_exact_and_in_order(transport: str) -> None:
    results = run_ranks(_direct, 2, transport, timeout=120)
    for rank, r in enumerate(results):
        assert r["bad"] == [], (rank, r["bad"])
    text = results[1]["mismatch"]
    assert "32" in text and "16" in text, text
    if transport == "shm":  # the direct path took the small ones, on both sides
        for r in results:
            assert r["taken"]["send_now"] >= 4 and r["taken"]["recv_now"] >= 4, results
