"""What bounds an op, measured in the same run: the ceilings ``%ceil`` is taken against.

* memory: copy (``b = a``) and add (``c = a + b``) on buffers far larger than the LLC, rank 0
  alone and then every rank at once.  Bytes are counted as the kernel moves them (a copy
  reads ``M`` and writes ``M``: 2M; an add 3M), as the op table's traffic models count them.
  The ceiling of the shared-memory transport.
* wire: a plain TCP stream between rank 0 and the furthest rank (the last rank on another
  host than rank 0's, else rank 1 over loopback), one direction at a time (simplex) and both
  at once (duplex, GB/s per direction).  The ceiling on busbw when the transport is tcp or
  the ranks span hosts: duplex for ops where every rank sends and receives at once, simplex
  for the others (``OpSpec.exchange``).

Everything runs on each rank's main thread, except the duplex stream's sending half, which a
helper thread runs while the main thread receives (its error is re-raised on the main thread).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import struct
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch

from torchcomms import ReduceOp, TorchComm
from torchcomms.bench import metrics
from torchcomms.bench.cases import OpSpec
from torchcomms.transport.gloo import process_group as gloo

_MIB = 1 << 20
#: The wire probe's stream: far more than the socket buffers, so the wire is what is timed.
WIRE_BYTES = 64 * _MIB


def llc_bytes() -> int | None:
    """Size of the largest CPU cache of cpu0, from sysfs (``None`` if unknown)."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    best = None
    try:
        entries = os.listdir(base)
    except OSError:
        return None
    for entry in entries:
        try:
            with open(os.path.join(base, entry, "size")) as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
        digits = text.rstrip("KMGkmg")
        if digits.isdigit():
            size = int(digits) * scale
            best = size if best is None else max(best, size)
    return best


def probe_bytes(quick: bool) -> int:
    """Buffer size: 8x the LLC, at least 64 MiB, at most 512 MiB; in quick mode 2x the LLC, at
    least 32 MiB, at most 64 MiB (a quick run stays quick on a VM that reports a 480 MiB LLC,
    at the price of a ceiling that may count cache bandwidth)."""
    llc = llc_bytes() or 32 * _MIB
    if quick:
        return min(max(2 * llc, 32 * _MIB), 64 * _MIB)
    return min(max(8 * llc, 64 * _MIB), 512 * _MIB)


class Probe:
    """Three buffers of ``nbytes`` each, touched once so page faults are not timed."""

    def __init__(self, nbytes: int) -> None:
        n = max(nbytes // 4, 1)
        self.nbytes = n * 4
        self.a = torch.ones(n, dtype=torch.float32)
        self.b = torch.ones(n, dtype=torch.float32)
        self.c = torch.zeros(n, dtype=torch.float32)

    def copy(self, reps: int) -> tuple[float, int]:
        """Median seconds of one copy over ``reps`` (after a warm-up), and the bytes it moves."""
        return _median_time(lambda: self.b.copy_(self.a), reps), 2 * self.nbytes

    def add(self, reps: int) -> tuple[float, int]:
        """Median seconds of one add over ``reps`` (after a warm-up), and the bytes it moves."""
        return _median_time(lambda: torch.add(self.a, self.b, out=self.c), reps), 3 * self.nbytes


def _median_time(kernel: Callable[[], object], reps: int) -> float:
    kernel()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        kernel()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_memory(comm: TorchComm, rank: int, size: int, quick: bool) -> dict[str, Any]:
    """Copy/add bandwidth in GB/s: rank 0 alone, then all ranks at once (aggregate)."""
    nbytes = probe_bytes(quick)
    reps = 3 if quick else 5
    probe = Probe(nbytes)
    result: dict[str, Any] = {"probe_bytes": probe.nbytes, "reps": reps, "procs": size}
    comm.barrier(False)
    if rank == 0:
        t, b = probe.copy(reps)
        result["copy_1p_GBps"] = b / t / metrics.GB
        t, b = probe.add(reps)
        result["add_1p_GBps"] = b / t / metrics.GB
    comm.barrier(False)
    tc, bc = probe.copy(reps)
    comm.barrier(False)
    ta, ba = probe.add(reps)
    slowest = torch.tensor([tc, ta], dtype=torch.float64)
    comm.all_reduce(slowest, ReduceOp.MAX, False)
    result["copy_np_GBps"] = size * bc / float(slowest[0]) / metrics.GB
    result["add_np_GBps"] = size * ba / float(slowest[1]) / metrics.GB
    del probe
    return result


# -- the wire ----------------------------------------------------------------------------------------
def wire_peer(hosts: Sequence[str]) -> int | None:
    """The rank the wire is measured to from rank 0 (``hosts``: each rank's host identity):
    the last rank on another host, else rank 1; None for a world of one."""
    if len(hosts) < 2:
        return None
    away = [r for r, host in enumerate(hosts) if host != hosts[0]]
    return away[-1] if away else 1


def measure_wire(
    store: Any, rank: int, hosts: Sequence[str], quick: bool, timeout: timedelta
) -> dict[str, Any] | None:
    """The wire between rank 0 and ``wire_peer(hosts)`` (on every rank; the others wait on
    the store, not in a collective, so they leave the cores to the stream).  Rank 0 listens
    on its address for peers on other hosts (``transport.gloo.reachable_address``), else on
    127.0.0.1, and publishes the result through ``store``."""
    peer = wire_peer(hosts)
    if peer is None:
        return None
    reps = 3 if quick else 5
    if rank == 0:
        local = hosts[peer] == hosts[0]
        bind = "127.0.0.1" if local else gloo.reachable_address(store)
        result = _wire_rank0(store, bind, reps, timeout)
        ends = (result.pop("address"), result.pop("peer_address"))
        result["from"] = {"rank": 0, "host": hosts[0], "address": ends[0]}
        result["to"] = {"rank": peer, "host": hosts[peer], "address": ends[1]}
        result["loopback"] = local
        store.set("wire/result", json.dumps(result))
    elif rank == peer:
        _wire_peer(store, reps, timeout)
    store.wait(["wire/result"], timeout)
    found: dict[str, Any] = json.loads(store.get("wire/result").decode())
    return found


def _wire_rank0(store: Any, bind: str, reps: int, timeout: timedelta) -> dict[str, Any]:
    """Rank 0's side: listen, then per rep send the stream and time it to the peer's ack
    (simplex), then send and receive at once (duplex); the peer's duplex times come last."""
    host = bind
    with socket.create_server((bind, 0)) as server:
        server.settimeout(timeout.total_seconds())
        if bind in ("0.0.0.0", "::"):
            host = socket.gethostname()
        store.set("wire/address", f"{host} {server.getsockname()[1]}")
        sock, (peer_address, _) = server.accept()
    with sock:
        sock.settimeout(timeout.total_seconds())
        stream = _Stream(sock)
        simplex = []
        for rep in range(reps + 1):  # a warm-up first: slow start, buffer auto-tuning
            t0 = time.perf_counter()
            stream.send()
            stream.recv(1)
            if rep:
                simplex.append(time.perf_counter() - t0)
        duplex = []
        for rep in range(reps + 1):
            sock.sendall(b"g")  # the peer starts at this byte
            t = stream.both()
            if rep:
                duplex.append(t)
        theirs = struct.unpack(f"<{reps}d", stream.recv(8 * reps))
    worst = [max(a, b) for a, b in zip(duplex, theirs, strict=True)]
    return {
        "bytes": WIRE_BYTES,
        "reps": reps,
        "simplex_GBps": metrics.algbw(WIRE_BYTES, statistics.median(simplex)),
        "duplex_GBps": metrics.algbw(WIRE_BYTES, statistics.median(worst)),
        "address": host,
        "peer_address": str(peer_address),
    }


def _wire_peer(store: Any, reps: int, timeout: timedelta) -> None:
    """The peer's side of ``_wire_rank0``: receive and ack, then send and receive at once."""
    store.wait(["wire/address"], timeout)
    host, port = store.get("wire/address").decode().rsplit(" ", 1)
    with socket.create_connection((host, int(port)), timeout.total_seconds()) as sock:
        stream = _Stream(sock)
        for _ in range(reps + 1):
            stream.recv(WIRE_BYTES)
            sock.sendall(b"a")
        duplex = []
        for rep in range(reps + 1):
            stream.recv(1)
            t = stream.both()
            if rep:
                duplex.append(t)
        sock.sendall(struct.pack(f"<{reps}d", *duplex))


class _Stream:
    """One connected socket and the two ``WIRE_BYTES`` buffers the probe streams through."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.out = memoryview(bytearray(WIRE_BYTES))
        self.into = memoryview(bytearray(WIRE_BYTES))

    def send(self) -> None:
        self.sock.sendall(self.out)

    def recv(self, n: int) -> memoryview:
        """Exactly ``n`` bytes, into (and as a view of) the receive buffer."""
        got = 0
        while got < n:
            k = self.sock.recv_into(self.into[got:n], n - got)
            if k == 0:
                raise ConnectionError(f"wire probe: the peer closed after {got} of {n} bytes")
            got += k
        return self.into[:n]

    def both(self) -> float:
        """Send and receive ``WIRE_BYTES`` at once (a helper thread sends); seconds taken."""
        failed: list[BaseException] = []

        def sender() -> None:
            try:
                self.send()
            except BaseException as exc:  # re-raised on the main thread below
                failed.append(exc)

        t0 = time.perf_counter()
        thread = threading.Thread(target=sender, name="bench-wire-send", daemon=True)
        thread.start()
        self.recv(WIRE_BYTES)
        thread.join()
        elapsed = time.perf_counter() - t0
        if failed:
            raise failed[0]
        return elapsed


# -- the ceiling of a cell -------------------------------------------------------------------------
def ceiling(
    spec: OpSpec,
    nranks: int,
    in_place: bool,
    model: str,
    mem_bw: float | None,
    wire: dict[str, Any] | None,
) -> float | None:
    """The ceiling on algbw of one cell, in GB/s, under ``model`` (``wire``/``memory``);
    None where the op moves no payload or the model's figure is missing."""
    if model == "wire":
        if wire is None or not spec.sized:
            return None
        return metrics.wire_ceiling_algbw(wire[_wire_key(spec)], spec.busbw_factor(nranks))
    traffic = spec.traffic_at(nranks, in_place)
    if traffic is None or mem_bw is None:
        return None
    return metrics.ceiling_algbw(mem_bw, traffic)


def _wire_key(spec: OpSpec) -> str:
    return "duplex_GBps" if spec.exchange else "simplex_GBps"


def ceiling_text(
    spec: OpSpec,
    size: int,
    model: str,
    mem_bw: float | None,
    wire: dict[str, Any] | None,
) -> str:
    """The op header's account of its ceiling."""
    if model == "wire":
        if wire is None or not spec.sized:
            return "no payload: time only"
        how = "duplex: every rank sends and receives at once" if spec.exchange else "simplex"
        return (
            f"wire-bound ceiling busbw = the TCP stream's {wire[_wire_key(spec)]:.3f} GB/s ({how})"
        )
    if spec.traffic is None or mem_bw is None:
        return "no payload: time only"
    procs = "1 proc" if spec.time_divisor > 1 else f"{size} procs"
    models = []
    for in_place in sorted(set(spec.placements)):
        traffic = spec.traffic_at(size, in_place)
        assert traffic is not None
        models.append(
            f"B/({spec.traffic_text_at(in_place)}) = "
            f"{metrics.ceiling_algbw(mem_bw, traffic):.3f} GB/s"
        )
    if len(set(models)) > 1:  # an in-place API: out of place, the bench's copy in is timed
        text = (
            f"{models[0]} out of place (the input's copy into the output counted), "
            f"{models[1]} in place"
        )
    else:
        text = models[0]
    return (
        f"memory-bound ceiling algbw = {text}, with "
        f"B = copy bandwidth ({procs}) = {mem_bw:.2f} GB/s"
    )
