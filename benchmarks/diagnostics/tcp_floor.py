"""Where the floor of a small tcp send/recv lies: one-way latency of a 2-rank ping-pong of
8-byte messages over loopback, through each layer, interleaved in one run.

    python benchmarks/diagnostics/tcp_floor.py [--calls 1000] [--rounds 7] [--json OUT]

Rows (each round runs every row once, so a slow phase of the machine hits them alike):

* ``socket, blocking recv``: a plain Python socket pair, ``recv`` sleeping in the kernel;
* ``socket, spinning recv``: the same with ``MSG_DONTWAIT`` reads in a loop (what a
  waiter that spins pays at least);
* ``gloo send/recv``: ``ProcessGroupGloo.send/recv(...).wait()``, the bench's baseline;
* ``engine``: ``transport/tcp/p2p.P2P`` alone (post and wait, default spin);
* ``TorchComm send/recv``: a comm on ``TORCHCOMM_TRANSPORT=tcp``, sync ``send``/``recv``.

Prints the median and best one-way time over the rounds, in microseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import run_local_ranks

_CHILD = "TCP_FLOOR_CHILD"


def _raw_pair(store: object, rank: int) -> socket.socket:
    import torch.distributed as dist

    assert isinstance(store, dist.Store)
    if rank == 1:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        store.set("raw", str(listener.getsockname()[1]))
        sock, _ = listener.accept()
        listener.close()
    else:
        store.wait(["raw"])
        sock = socket.create_connection(("127.0.0.1", int(store.get("raw"))))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def child(calls: int, rounds: int, json_path: str | None) -> None:
    os.environ["TORCHCOMM_TRANSPORT"] = "tcp"
    import torch
    import torch.distributed as dist

    import torchcomms
    from torchcomms.transport.tcp.ring import as_bytes

    rank = int(os.environ["TORCHCOMM_RANK"])
    peer = 1 - rank
    comm = torchcomms.new_comm("gloo", torch.device("cpu"), name="tcp_floor")
    store = dist.FileStore(os.environ["TORCHCOMM_STORE_PATH"] + ".floor", 2)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("pg", store), rank, 2, timedelta(seconds=60))
    sock = _raw_pair(store, rank)
    engine = comm.get_backend_impl()._ops.p2p  # type: ignore[attr-defined]
    buf = torch.zeros(2)
    view = as_bytes(buf)
    raw = bytearray(8)
    first = rank == 0

    def blocking() -> None:
        if first:
            sock.sendall(raw)
        got = 0
        while got < 8:
            got += sock.recv_into(memoryview(raw)[got:])
        if not first:
            sock.sendall(raw)

    def spinning() -> None:
        if first:
            sock.sendall(raw)
        got = 0
        target = memoryview(raw)
        while got < 8:
            try:  # noqa: SIM105  (suppress() would add its own cost to the floor)
                got += sock.recv_into(target[got:], 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                pass
        if not first:
            sock.sendall(raw)

    def gloo() -> None:
        if first:
            pg.send([buf], peer, 7).wait()
        pg.recv([buf], peer, 7).wait()
        if not first:
            pg.send([buf], peer, 7).wait()

    def nothing() -> None:
        return None

    tag = 1 << 40  # a tag the backend's own sequence numbers never reach

    def engine_alone() -> None:
        if first:
            engine.wait([engine.post_send(peer, tag, view)], nothing)
        engine.wait([engine.post_recv(peer, tag, view)], nothing)
        if not first:
            engine.wait([engine.post_send(peer, tag, view)], nothing)

    def torchcomm() -> None:
        if first:
            comm.send(buf, peer, False)
        comm.recv(buf, peer, False)
        if not first:
            comm.send(buf, peer, False)

    rows: dict[str, Callable[[], None]] = {
        "socket, blocking recv": blocking,
        "socket, spinning recv": spinning,
        "gloo send/recv": gloo,
        "engine": engine_alone,
        "TorchComm send/recv": torchcomm,
    }
    times: dict[str, list[float]] = {name: [] for name in rows}
    for fn in rows.values():  # warm-up: connections, caches
        for _ in range(50):
            fn()
    for _ in range(rounds):
        for name, fn in rows.items():
            comm.barrier(False)
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls / 2 * 1e6)
    comm.barrier(False)
    sock.close()
    comm.finalize()
    if rank == 0:
        summary = {
            name: {"median_us": statistics.median(v), "best_us": min(v)}
            for name, v in times.items()
        }
        for name, r in summary.items():
            print(
                f"{name:24s} one-way median {r['median_us']:6.1f} us, best {r['best_us']:6.1f} us"
            )
        if json_path:
            with open(json_path, "w") as f:
                json.dump(
                    {
                        "command": " ".join(
                            ["python", "benchmarks/diagnostics/tcp_floor.py", *sys.argv[1:]]
                        ),
                        "results": summary,
                        "machine": os.uname().release,
                        "cpus": os.cpu_count(),
                    },
                    f,
                    indent=1,
                )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if os.environ.get(_CHILD):
        child(args.calls, args.rounds, args.json)
        return
    sys.exit(run_local_ranks(__file__, _CHILD))


if __name__ == "__main__":
    main()
