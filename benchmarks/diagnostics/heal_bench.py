"""Heal a replica through each checkpoint transport, same run; raw one-sided bandwidth.

    python benchmarks/diagnostics/heal_bench.py [--sizes 64M,1G] [--repeats 3]
        [--two-hosts] [--out benchmarks/results/issue39/heal_same_host.json]

Two processes: a healthy replica (rank 0) that holds a model-like state dict (``_model``:
per layer four d x d and two d x 4d float32 matrices and four d vectors, d = 1024, as many
layers as the size needs, plus a non-tensor leaf) and a recovering one (rank 1).  Per trial, both
leave a barrier; rank 0 calls ``send_checkpoint`` and rank 1 ``recv_checkpoint``; the time is
rank 1's, from the barrier to the state dict in hand (so it includes the sender's preparation).
Every received state dict is checked bit for bit. One untimed warm-up trial of each transport
precedes the timed ones (it is kept in the JSON as ``warmup_trials``).  Transports, alternating trial by trial:

* ``rdma``: ``torchcomms.ft.RdmaCheckpointTransport`` (cross-memory attach on one host, TCP
  between hosts; ``rdma_tcp`` forces TCP on one host);
* ``http``: torchft's ``HTTPTransport`` (``num_chunks=0``, the Manager's default);
* ``pg``: torchft's ``PGTransport`` over a ``ProcessGroupGloo`` of the two;
* ``*_inplace`` (``rdma``, ``pg``): given ``state_dict=``, the transport fills the recovering
  replica's own tensors (memory it already has) instead of fresh ones; HTTP cannot.

A fresh destination costs what the kernel charges to hand out new pages (on the machine of the
committed results, a 1 GiB ``copy_`` into new memory takes 0.24 s, into touched memory 0.09 s):
every transport but the in-place ones pays it.

Then the raw bandwidth: ``RdmaTransport.read`` / ``write`` of 256 MiB between the two
(registered, warm destination), beside ``dst.copy_(src)`` of the same size in one process
(torch's default threads, and one thread): the ceiling a same-host copy can reach.

``--two-hosts``: the two processes run in two network namespaces joined by a veth pair
(root; ``TORCHCOMM_HOST_ID`` differs), so ``rdma`` goes over TCP; ``http`` is left out (its
URL names the machine's hostname, which does not resolve inside the namespaces).
GB = 1e9 bytes.  The machine is recorded in the JSON (``_doc.write_doc``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch

RAW_BYTES = 256 << 20
D = 1024
ADDRS = ("198.18.39.1", "198.18.39.2")


def _parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def _model(nbytes: int) -> dict[str, Any]:
    """A state dict of about ``nbytes`` shaped like a model's (module docstring)."""
    shapes = [(D, D)] * 4 + [(D, 4 * D)] * 2 + [(D,)] * 4
    layers: dict[str, Any] = {}
    total, i = 0, 0
    gen = torch.Generator().manual_seed(0)
    while total < nbytes:
        for j, shape in enumerate(shapes):
            if total >= nbytes:
                break
            t = torch.randn(shape, generator=gen)
            layers[f"layer{i}.p{j}"] = t
            total += t.nbytes
        i += 1
    return {"model": layers, "optim": {"step": 1000, "lr": 0.1}}


def _equal(a: Any, b: Any) -> bool:
    ta, tb = a["model"], b["model"]
    return (
        a["optim"] == b["optim"]
        and ta.keys() == tb.keys()
        and all(torch.equal(ta[k].view(torch.uint8), tb[k].view(torch.uint8)) for k in ta)
    )


def _transport(kind: str, pg: Any, target: Any) -> Any:
    """``*_inplace``: the transport fills ``target`` (the recovering replica's own tensors)."""
    timeout = timedelta(seconds=600)
    into = (lambda: target) if kind.endswith("_inplace") else None
    if kind.startswith("rdma"):
        from torchcomms.ft import RdmaCheckpointTransport

        return RdmaCheckpointTransport(timeout, state_dict=into)
    if kind == "http":
        from torchft.checkpointing.http_transport import HTTPTransport

        return HTTPTransport(timeout, num_chunks=0)
    from torchft.checkpointing.pg_transport import PGTransport

    return PGTransport(pg, timeout, torch.device("cpu"), state_dict=into)


def child(rank: int, store_path: str, cfg: dict[str, Any]) -> None:
    from torch.distributed import FileStore, ProcessGroupGloo

    from torchcomms._transport import RdmaMemory, RdmaTransport

    torch.set_num_threads(os.cpu_count() or 1)
    store = FileStore(store_path, 2)
    opts = ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=600)
    host = ADDRS[rank] if cfg["two_hosts"] else "127.0.0.1"
    opts._devices = [ProcessGroupGloo.create_device(hostname=host)]
    pg = ProcessGroupGloo(store, rank, 2, opts)
    step = 0
    rows: list[dict[str, Any]] = []
    warmups: list[dict[str, Any]] = []

    def barrier(tag: str) -> None:
        store.add(tag, 1)
        while int(store.add(tag, 0)) < 2:
            time.sleep(0.0005)

    for size in cfg["sizes"]:
        sd = _model(size)  # rank 1: what it must receive
        target = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}, "optim": {}}
        nbytes = sum(t.nbytes for t in sd["model"].values())
        transports = {k: _transport(k, pg, target) for k in cfg["kinds"]}
        if rank == 0:
            store.set(f"meta/{size}", json.dumps({k: t.metadata() for k, t in transports.items()}))
            store.set(f"nbytes/{size}", str(nbytes))
        else:
            for t in target["model"].values():
                t.fill_(0)  # touched: in place means memory the replica already has
        meta = json.loads(store.get(f"meta/{size}"))
        # Trial -1 of each transport is a warm-up, not reported: the first 1 GiB heal of a
        # run also pays for the kernel reclaiming memory, whichever transport goes first.
        for rep in range(-1, cfg["repeats"]):
            for kind, tr in transports.items():
                step += 1
                os.environ["TORCHCOMM_RDMA_PATH"] = "tcp" if kind == "rdma_tcp" else "auto"
                barrier(f"b{step}")
                start = time.perf_counter()
                if rank == 0:
                    tr.send_checkpoint([1], step, sd, timedelta(seconds=600))
                    store.wait([f"done{step}"])
                    tr.disallow_checkpoint()
                else:
                    got = tr.recv_checkpoint(0, meta[kind], step, timedelta(seconds=600))
                    seconds = time.perf_counter() - start
                    ok = _equal(got, sd)
                    if kind.endswith("_inplace"):
                        ok = ok and _equal({**target, "optim": sd["optim"]}, sd)
                        for t in target["model"].values():
                            t.zero_()  # the next trial must fill it again
                    del got
                    row = {"size": size, "kind": kind, "rep": rep, "s": seconds, "bit_exact": ok}
                    if rep >= 0:
                        rows.append(row)
                    else:
                        warmups.append(row)
                    store.set(f"done{step}", "1")
        for tr in transports.values():
            tr.shutdown(wait=True)
        del sd

    # Raw one-sided bandwidth, and the copy ceiling.
    raw: dict[str, Any] = {}
    t = RdmaTransport("cpu")
    store.set(f"url{rank}", t.bind())
    t.connect(store.get(f"url{1 - rank}"))
    buf = torch.randn(RAW_BYTES // 4)
    mem = RdmaMemory(buf)
    store.set(f"rb{rank}", json.dumps(list(mem.to_remote_buffer().__getstate__())))
    from torchcomms._transport import RdmaRemoteBuffer

    peer = RdmaRemoteBuffer(*json.loads(store.get(f"rb{1 - rank}")))
    barrier("raw")
    if rank == 1:
        for op in ("read", "write"):
            times = []
            for _ in range(cfg["raw_repeats"]):
                t0 = time.perf_counter()
                if op == "read":
                    t.read(mem.to_mutable_view(), peer)
                else:
                    t.write(mem.to_view(), peer)
                times.append(time.perf_counter() - t0)
            raw[f"{op}_GBps"] = RAW_BYTES / statistics.median(times) / 1e9
            raw[f"{op}_best_GBps"] = RAW_BYTES / min(times) / 1e9
        raw["path"] = t.path
        src = torch.randn(RAW_BYTES // 4)
        dst = torch.empty_like(src)
        for threads in (torch.get_num_threads(), 1):
            torch.set_num_threads(threads)
            dst.copy_(src)
            times = []
            for _ in range(cfg["raw_repeats"]):
                t0 = time.perf_counter()
                dst.copy_(src)
                times.append(time.perf_counter() - t0)
            raw[f"copy_{threads}t_GBps"] = RAW_BYTES / statistics.median(times) / 1e9
    barrier("raw_done")
    t.close()
    if rank == 1:
        with open(cfg["report"], "w") as f:
            json.dump({"heal": rows, "warmups": warmups, "raw": raw}, f)


def _netns(names: tuple[str, str]) -> list[list[str]]:
    veth = ("hbv39a", "hbv39b")
    steps = [["netns", "add", n] for n in names]
    steps.append(["link", "add", veth[0], "type", "veth", "peer", "name", veth[1]])
    for v, n, a in zip(veth, names, ADDRS, strict=True):
        steps += [
            ["link", "set", v, "netns", n],
            ["-n", n, "addr", "add", f"{a}/24", "dev", v],
            ["-n", n, "link", "set", v, "up"],
            ["-n", n, "link", "set", "lo", "up"],
        ]
    return steps


def parent() -> None:
    args = sys.argv[1:]

    def opt(name: str, default: str) -> str:
        return args[args.index(name) + 1] if name in args else default

    two_hosts = "--two-hosts" in args
    default_out = (
        f"benchmarks/results/issue39/heal_{'two_hosts' if two_hosts else 'same_host'}.json"
    )
    out = opt("--out", default_out)
    cfg = {
        "sizes": [_parse_size(s) for s in opt("--sizes", "64M,1G").split(",")],
        "repeats": int(opt("--repeats", "3")),
        "raw_repeats": 7,
        "two_hosts": two_hosts,
        "kinds": (
            ["rdma", "rdma_inplace", "pg", "pg_inplace"]
            if two_hosts
            else ["rdma", "rdma_inplace", "rdma_tcp", "http", "pg", "pg_inplace"]
        ),
        "report": os.path.join(tempfile.mkdtemp(), "report.json"),
    }
    store = os.path.join(tempfile.mkdtemp(), "store")
    names = (f"hb39a{os.getpid()}", f"hb39b{os.getpid()}")
    if two_hosts:
        for step in _netns(names):
            subprocess.run(["ip", *step], check=True)
    try:
        procs = []
        for rank in range(2):
            env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count() or 1)}
            prefix: list[str] = []
            if two_hosts:
                env.update(TORCHCOMM_HOST_ID=f"heal{rank}", TORCHCOMM_GLOO_HOSTNAME=ADDRS[rank])
                prefix = ["ip", "netns", "exec", names[rank]]
            procs.append(
                subprocess.Popen(
                    [
                        *prefix,
                        sys.executable,
                        __file__,
                        "--child",
                        str(rank),
                        store,
                        json.dumps(cfg),
                    ],
                    env=env,
                )
            )
        if any(p.wait() != 0 for p in procs):
            raise SystemExit("a child failed")
    finally:
        if two_hosts:
            for n in names:
                subprocess.run(["ip", "netns", "del", n], check=False)
    with open(cfg["report"]) as f:
        report = json.load(f)
    summary: dict[str, Any] = {}
    for size in cfg["sizes"]:
        per = {}
        for kind in cfg["kinds"]:
            times = [r["s"] for r in report["heal"] if r["size"] == size and r["kind"] == kind]
            exact = all(
                r["bit_exact"] for r in report["heal"] if r["size"] == size and r["kind"] == kind
            )
            per[kind] = {
                "median_s": statistics.median(times),
                "min_s": min(times),
                "bit_exact": exact,
            }
        for mine in ("rdma", "rdma_inplace"):
            for kind in cfg["kinds"]:
                if not kind.startswith("rdma"):
                    speedup = per[kind]["median_s"] / per[mine]["median_s"]
                    per[f"{mine}_speedup_vs_{kind}"] = speedup
        summary[f"{size >> 20}MiB"] = per
    raw = report["raw"]
    raw["read_vs_copy"] = raw["read_GBps"] / raw[f"copy_{_max_threads(raw)}t_GBps"]
    summary["raw_256MiB"] = raw
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _doc import write_doc

    os.makedirs(os.path.dirname(out), exist_ok=True)
    write_doc(
        out,
        "python " + " ".join(["benchmarks/diagnostics/heal_bench.py", *args]),
        summary,
        trials=report["heal"],
        warmup_trials=report["warmups"],
    )
    print(json.dumps(summary, indent=1))


def _max_threads(raw: dict[str, Any]) -> int:
    return max(int(k[5:-6]) for k in raw if k.startswith("copy_") and k.endswith("t_GBps"))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]))
    else:
        parent()
