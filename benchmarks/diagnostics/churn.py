"""Communicator churn: what each process holds after 1, 10 and N life cycles (issue 41).

    python benchmarks/diagnostics/churn.py [--cycles 1000] [--reconfigures 1000] \
        [--transports shm,tcp,hier] [--world 2] [--timeout 60] [--no-gc] [--json out.json]

Per transport, ``--world`` local ranks (``hier``: one more, on two simulated hosts through
``TORCHCOMM_HOST_ID``, the first of which holds two members) each run, as fresh
interpreters:

* ``create``: ``--cycles`` times ``new_comm`` -> ``all_reduce`` (checked) -> ``finalize``,
  bootstrapping without a store (``MASTER_ADDR:MASTER_PORT``: rank 0 moves the ranks to a
  private store of its own each time), ``TORCHCOMM_TIMEOUT_SECONDS=--timeout`` (60: c10d
  looks the store's address up at every connect, and where the resolver drops a query each
  lookup stalls 5 s; two of them ended a 10 s bootstrap here);
* ``reconfigure``: one communicator made with ``enable_reconfigure=True``, reconfigured
  ``--reconfigures`` times over every member's handle (torchft's pattern), an
  ``all_reduce`` after each, then finalized.

After cycles 1, 10, 100, ... and N of each, and after the final ``finalize`` of the
reconfigured comm, each rank samples its file descriptors by kind, threads (Python's and
the kernel's count, native ones included), memory maps, RSS (as is, and after a garbage
collection and ``malloc_trim``: what is in use) and its ``/dev/shm`` segments
(``torchcomms.bench.resources``).  The garbage collector runs as it would in any program
(``--no-gc`` switches automatic collection off, to show what ``finalize`` alone releases).
The table shows every rank's counts at cycles 1, 10 and N; ``--json`` keeps every sample
and the machine.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from torchcomms.transport import listen

TRANSPORTS = ("shm", "tcp", "hier")
_CHILD = "TORCHCOMM_CHURN_CHILD"
RANK_DEADLINE_S = 3600.0


def _points(n: int) -> list[int]:
    points, p = {1, n}, 10
    while p < n:
        points.add(p)
        p *= 10
    return sorted(x for x in points if x <= n)


# -- one rank -------------------------------------------------------------------------------------
def _rank_main(args: argparse.Namespace) -> None:
    import torch

    import torchcomms
    from torchcomms import ReduceOp
    from torchcomms.bench import resources

    if args.no_gc:
        gc.disable()
    rank, size = int(os.environ["TORCHCOMM_RANK"]), int(os.environ["TORCHCOMM_SIZE"])
    cpu = torch.device("cpu")
    hint = {"transport": "tcp" if args.transport == "tcp" else "auto"}
    want = size * (size + 1) // 2
    samples: dict[str, list[dict[str, Any]]] = {"create": [], "reconfigure": []}

    def check(comm: Any) -> None:
        t = torch.full((8,), rank + 1, dtype=torch.int64)
        comm.all_reduce(t, ReduceOp.SUM, False)
        if int(t[0]) != want:
            raise AssertionError(f"rank {rank}: all_reduce gave {int(t[0])}, expected {want}")

    def keep(phase: str, cycle: int | str) -> None:
        held = resources.sample()
        gc.collect()
        resources.trim_heap()  # what is in use, without the free pages glibc keeps
        trimmed = resources.rss_kib()
        samples[phase].append(
            {"cycle": cycle, "t": time.monotonic(), **held.as_dict(), "rss_trimmed_kib": trimmed}
        )

    points = set(_points(args.cycles))
    for i in range(1, args.cycles + 1):
        comm = torchcomms.new_comm("gloo", cpu, name="churn", hints=hint)
        check(comm)
        comm.finalize()
        del comm
        if i in points:
            keep("create", i)

    if args.reconfigures:
        import torch.distributed as dist

        handles_store = dist.FileStore(os.environ["CHURN_HANDLES"], size)
        comm = torchcomms.new_comm(
            "gloo", cpu, name="churn-rc", hints=hint, enable_reconfigure=True
        )
        handles_store.set(f"handle/{rank}", comm.get_init_handle())
        handles = [handles_store.get(f"handle/{r}").decode() for r in range(size)]
        points = set(_points(args.reconfigures))
        for i in range(1, args.reconfigures + 1):
            comm.reconfigure(uuid=i, init_handles=handles)
            check(comm)
            if i in points:
                keep("reconfigure", i)
        comm.finalize()
        del comm
        keep("reconfigure", "finalized")
        handles_store.set(f"done/{rank}", "1")
        handles_store.wait([f"done/{r}" for r in range(size)])
        del handles_store
    with open(os.path.join(os.environ["CHURN_OUT"], f"rank{rank}.json"), "w") as f:
        json.dump(samples, f)


# -- the launcher ---------------------------------------------------------------------------------
def _run_transport(transport: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"churn-{transport}-") as out:
        return _run_ranks(transport, args, out)


def _run_ranks(transport: str, args: argparse.Namespace, out: str) -> dict[str, Any]:
    """The ranks of one placement as fresh interpreters, writing their samples to ``out``."""
    world = args.world + (1 if transport == "hier" else 0)
    env = {
        **os.environ,
        _CHILD: "1",
        "TORCHCOMM_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(listen.free_master_port()),
        "TORCHCOMM_TIMEOUT_SECONDS": str(args.timeout),
        "CHURN_OUT": out,
        "CHURN_HANDLES": os.path.join(out, "handles"),
    }
    argv = [
        sys.executable,
        os.path.abspath(__file__),
        "--transport",
        transport,
        "--cycles",
        str(args.cycles),
        "--reconfigures",
        str(args.reconfigures),
        *(["--no-gc"] if args.no_gc else []),
    ]
    start = time.monotonic()
    procs = []
    for rank in range(world):
        rank_env = {**env, "TORCHCOMM_RANK": str(rank)}
        if transport == "hier":  # host 0 holds ranks 0 and 1, host 1 the rest
            rank_env["TORCHCOMM_HOST_ID"] = f"churn-host-{0 if rank < 2 else 1}"
        procs.append(subprocess.Popen(argv, env=rank_env))
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, start + RANK_DEADLINE_S - time.monotonic())))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
    if any(codes):
        raise SystemExit(f"{transport}: rank exit codes {codes}")
    ranks = []
    for rank in range(world):
        with open(os.path.join(out, f"rank{rank}.json")) as f:
            ranks.append(json.load(f))
    leftover = sorted(e for e in os.listdir("/dev/shm") if e.startswith("torchcomm-"))
    pids = {str(p.pid) for p in procs}
    ours = [e for e in leftover if e.split("-")[1] in pids]
    return {
        "world": world,
        "seconds": round(time.monotonic() - start, 1),
        "dev_shm_left": ours,
        "ranks": ranks,
    }


def _row(sample: dict[str, Any]) -> str:
    fds = sample["fds"]
    ev = fds["eventfd"] + fds["eventpoll"] + fds["io_uring"]
    trimmed = sample.get("rss_trimmed_kib")  # absent from files written before it was kept
    in_use = f" ({trimmed // 1024} MiB in use)" if trimmed is not None else ""
    return (
        f"{sample['fd_total']:>4} (sock {fds['socket']:>3} pipe {fds['pipe']:>3} ev {ev:>3}) "
        f"thr {sample['py_threads']:>2}/{sample['tasks']:>3} maps {sample['maps']:>4} "
        f"rss {sample['rss_kib'] // 1024:>4} MiB{in_use} shm {sample['segments']}"
    )


def _table(results: dict[str, Any]) -> str:
    lines = []
    for transport, res in results.items():
        for phase in ("create", "reconfigure"):
            for rank, samples in enumerate(res["ranks"]):
                picked = [
                    s for s in samples[phase] if s["cycle"] in (1, 10) or s is samples[phase][-1]
                ]
                if not picked:
                    continue
                if phase == "reconfigure" and len(samples[phase]) > 1:
                    picked.insert(-1, samples[phase][-2])  # the last cycle, before finalize
                for s in picked:
                    lines.append(
                        f"{transport:<5} {phase:<11} rank {rank} cycle {s['cycle']!s:>9}: {_row(s)}"
                    )
        lines.append(
            f"{transport}: {res['seconds']} s; /dev/shm left: {res['dev_shm_left'] or 'nothing'}"
        )
    return "\n".join(lines)


def _code() -> dict[str, str]:
    """Which torchcomms the ranks import, and its tree's commit (``git``, where it is one)."""
    import torchcomms

    where = os.path.dirname(os.path.abspath(torchcomms.__file__))
    try:
        head = subprocess.run(
            ["git", "-C", where, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        head = ""
    return {"torchcomms": where, "git_head": head}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cycles", type=int, default=100)
    ap.add_argument("--reconfigures", type=int, default=100)
    ap.add_argument("--transports", default=",".join(TRANSPORTS))
    ap.add_argument("--transport", help=argparse.SUPPRESS)  # a rank's own
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=60, help="TORCHCOMM_TIMEOUT_SECONDS")
    ap.add_argument("--no-gc", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    if os.environ.get(_CHILD):
        _rank_main(args)
        return
    transports = [t for t in args.transports.split(",") if t]
    for t in transports:
        if t not in TRANSPORTS:
            ap.error(f"unknown transport {t!r} (expected {', '.join(TRANSPORTS)})")
    started = datetime.datetime.now().isoformat(timespec="seconds")
    results = {t: _run_transport(t, args) for t in transports}
    print(_table(results))
    if args.json:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _doc import write_doc

        write_doc(
            args.json,
            "python benchmarks/diagnostics/churn.py " + " ".join(sys.argv[1:]),
            results,
            started=started,
            cycles=args.cycles,
            reconfigures=args.reconfigures,
            gc="off" if args.no_gc else "on",
            code=_code(),
            env={k: v for k, v in os.environ.items() if k.startswith("TORCHCOMM_")},
        )


if __name__ == "__main__":
    main()
