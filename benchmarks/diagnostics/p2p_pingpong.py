"""The tcp point-to-point engine alone (``transport/tcp/p2p``): one-way latency of a
2-rank ping-pong of 8-byte messages, without the TorchComm and backend layers.

    python benchmarks/diagnostics/p2p_pingpong.py [--calls 2000]

Prints, per receive spin (0, the default 100 µs, 1 ms), the best of 3 rounds of
``--calls`` round trips, as microseconds per one-way message.  Compare with
``python -m torchcomms.bench --op sendrecv --vs gloo`` (the same ping-pong through
``TorchComm.send``/``recv``) to see what the layers above the engine cost.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import time

import torch
import torch.distributed as dist

from torchcomms.transport.tcp import lane as tcp_lane
from torchcomms.transport.tcp.p2p import P2P
from torchcomms.transport.tcp.ring import as_bytes


def _rank(rank: int, port: int, spin_s: float, calls: int, q: mp.SimpleQueue) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, wait_for_workers=False)
    listener = tcp_lane.listen("127.0.0.1")
    store.set(f"p2p/{rank}", f"t{rank} {listener.getsockname()[1]}")

    def address_of(r: int) -> tuple[str, int, str]:
        store.wait([f"p2p/{r}"])
        token, p = store.get(f"p2p/{r}").decode().split()
        return "127.0.0.1", int(p), token

    engine = P2P(rank, listener, f"t{rank}", address_of, spin_s)
    view = as_bytes(torch.zeros(2))
    peer = 1 - rank

    def nothing() -> None:
        return None

    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            if rank == 0:
                engine.wait([engine.post_send(peer, 0, view)], nothing)
                engine.wait([engine.post_recv(peer, 0, view)], nothing)
            else:
                engine.wait([engine.post_recv(peer, 0, view)], nothing)
                engine.wait([engine.post_send(peer, 0, view)], nothing)
        best = min(best, (time.perf_counter() - start) / calls / 2)
    if rank == 0:
        q.put(best * 1e6)
        store.wait(["done/1"])  # rank 0 serves the store: it leaves last
    else:
        store.set("done/1", "1")
    engine.close()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    ctx = mp.get_context("fork")
    for spin_s in (0.0, tcp_lane.SPIN_S, 1e-3):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        q = ctx.SimpleQueue()
        procs = [ctx.Process(target=_rank, args=(r, port, spin_s, args.calls, q)) for r in (0, 1)]
        for p in procs:
            p.start()
        one_way = q.get()
        for p in procs:
            p.join(30)
        print(f"spin {spin_s * 1e6:7.0f} us   one-way {one_way:7.1f} us", flush=True)


if __name__ == "__main__":
    main()
