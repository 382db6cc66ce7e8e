"""What DiLoCo's synchronisation costs per outer step: torchcomms against torchft's gloo.

    python benchmarks/diagnostics/diloco_sync.py [--rounds 4] [--steps 40] [--hidden 512] \
        [--fragments 4] [--sync-every 8] [--delays 0,1] [--transport auto] [--json out.json]

Per job: torchft's lighthouse and two replica processes (one rank each, as ``torchrun``
starts a group of one), each training the same model (``--fragments`` equal fragments,
``Linear(h, h)`` + ``Tanh`` each) with torchft's ``DiLoCo`` (``sync_every``: the fragments
are synchronised in turn, one every ``sync_every / fragments`` inner steps, each such sync
an outer step of torchft's Manager; the given ``fragment_sync_delay``, 1 is Streaming
DiLoCo) through a ``Manager`` of ``min_replica_size=2`` whose process group is either
``ProcessGroupTorchComms(new_comm("gloo", cpu, enable_reconfigure=True))`` or torchft's own
``ProcessGroupGloo``.  Jobs alternate between the two groups (ABAB, then BABA, ...), per delay,
``--rounds`` times each, in one sitting.

The synchronisation is timed where it happens, inside each replica: DiLoCo's optimizer hook
calls ``Manager.start_quorum``, the fragment's ``prepare_sync`` (pseudo-gradients, the
all_reduces issued) and ``perform_sync`` (waits for them, ``Manager.should_commit``, the
outer optimizer step and the merge); each is wrapped with a clock.  Per outer step a record
holds those parts: ``quorum``, ``issue`` (prepare_sync), ``wait`` (perform_sync up to
should_commit: the all_reduces' completion), ``commit`` (should_commit), ``outer`` (the
rest), and ``sync`` = their sum, the time the training loop stood still for the
synchronisation.  The first two outer steps (connections, the first quorum's reconfigure)
are left out.  Two more columns say whether the synchronisation slowed the rest: ``wall``
(one commit to the next) and ``compute`` (``wall`` less ``sync`` and the ``--pause`` sleeps:
forward, backward and the inner optimizer, which run beside a Streaming DiLoCo all_reduce).
Every fragment is the same size, so every outer step moves the same bytes.

Prints median and quartiles per group and part, the ratio gloo / torchcomms of the medians
(above 1: ours is faster) and, per round, the ratio of the two back-to-back jobs' medians;
the load average before each job and the transport our communicators ran on (``ShmOps``
between processes of one host unless ``--transport tcp``; torchft's gloo is TCP) go into
the JSON.  ``--profile DIR`` writes each replica's cProfile (its main thread) to DIR.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
KINDS = ("torchcomms", "gloo")
PARTS = ("sync", "quorum", "issue", "wait", "commit", "outer", "compute", "wall")
SKIP = 2  # outer steps left out at the start of each job


# -- one replica ----------------------------------------------------------------------------------
def _example() -> Any:
    """``examples/ft_diloco.py`` as a module: its replica set-up (``replica_manager``) and its
    reader of a child's output (``_Proc``), shared rather than copied."""
    spec = importlib.util.spec_from_file_location("ft_diloco", REPO / "examples" / "ft_diloco.py")
    assert spec is not None and spec.loader is not None
    module = sys.modules.get("ft_diloco") or importlib.util.module_from_spec(spec)
    if "ft_diloco" not in sys.modules:
        sys.modules["ft_diloco"] = module
        spec.loader.exec_module(module)
    return module


def _timed(fn: Callable[..., Any], part: str, acc: dict[str, float]) -> Callable[..., Any]:
    def wrapper(*a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[part] += time.perf_counter() - start

    return wrapper


def replica(args: argparse.Namespace) -> None:
    import torch
    from torch import nn
    from torchft.local_sgd import DiLoCo

    h = args.hidden
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(h, h), nn.Tanh()) for _ in range(args.fragments)]
    )
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    outer = [torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True) for f in model]
    comm, pg, manager = _example().replica_manager(args.pg, args.replica, model, inner, 20.0)
    acc = dict.fromkeys(PARTS[1:6], 0.0)
    perform_started = [0.0]
    manager.start_quorum = _timed(manager.start_quorum, "quorum", acc)
    should_commit = _timed(manager.should_commit, "commit", acc)

    def commit(*a: Any, **k: Any) -> bool:
        acc["wait"] += time.perf_counter() - perform_started[0]
        return bool(should_commit(*a, **k))

    manager.should_commit = commit
    data = torch.Generator().manual_seed(100 + args.replica)
    with DiLoCo(
        manager,
        list(model),
        inner,
        outer,
        sync_every=args.sync_every,
        backup_device=torch.device("cpu"),
        pin_memory=False,
        fragment_sync_delay=args.delay,
        fragment_update_alpha=0.5,
    ) as diloco:
        for fragment in diloco._fragments:
            fragment.prepare_sync = _timed(fragment.prepare_sync, "issue", acc)
            perform = fragment.perform_sync

            def perform_sync(perform: Callable[[], bool] = perform) -> bool:
                start = perform_started[0] = time.perf_counter()
                before = acc["wait"] + acc["commit"]
                try:
                    return perform()
                finally:
                    spent = time.perf_counter() - start
                    acc["outer"] += spent - (acc["wait"] + acc["commit"] - before)

            fragment.perform_sync = perform_sync
        profile = cProfile.Profile() if args.profile else None
        if profile is not None:
            profile.enable()
        last, paused = time.perf_counter(), 0.0
        while manager.current_step() < args.steps:
            step = manager.current_step()
            x = torch.randn(16, h, generator=data)
            loss = (model(x) - x.tanh()).pow(2).mean()
            inner.zero_grad()
            loss.backward()
            inner.step()  # DiLoCo's hook synchronises a fragment every sync_every steps
            if manager.current_step() != step:
                now = time.perf_counter()
                record = {"step": manager.current_step(), "n": manager.num_participants()}
                record.update(acc)
                record["sync"] = sum(acc.values())
                # the whole outer step, and what it spent outside the sync and the pauses
                record["wall"] = now - last
                record["compute"] = now - last - record["sync"] - paused
                print("REC " + json.dumps(record), flush=True)
                if args.pg == "torchcomms" and record["step"] == 1:
                    ops = type(comm.get_backend_impl()._ops).__name__
                    print(f"TRANSPORT {ops}", flush=True)
                acc.update(dict.fromkeys(acc, 0.0))
                last, paused = now, 0.0
            start = time.perf_counter()
            time.sleep(args.pause)
            paused += time.perf_counter() - start
        if profile is not None:
            profile.disable()
            profile.dump_stats(f"{args.profile}/{args.pg}_delay{args.delay}_r{args.replica}.prof")
    manager.shutdown(wait=False)
    pg.shutdown()


# -- one job --------------------------------------------------------------------------------------
def one_job(pg: str, delay: int, args: argparse.Namespace) -> tuple[list[dict[str, float]], str]:
    """Both replicas' records of one job (the first ``SKIP`` outer steps left out), and the
    transport our communicators ran on after the quorum's reconfigure (``-`` for gloo)."""
    binary = Path(sys.executable).with_name("torchft_lighthouse")
    if not binary.exists():
        raise SystemExit("torchft_lighthouse not found beside python: pip install torchft-nightly")
    argv = [str(binary), "--bind", "[::]:0", "--min_replicas", "2", "--join_timeout_ms", "3000"]
    proc = _example()._Proc
    lighthouse = proc("lighthouse", [*argv, "--quorum_tick_ms", "50"], dict(os.environ))
    procs = [lighthouse]
    try:
        deadline = time.monotonic() + 30
        while not any("listening on" in x for x in lighthouse.lines):
            if time.monotonic() > deadline:
                raise SystemExit("the lighthouse did not start:\n" + "\n".join(lighthouse.lines))
            time.sleep(0.05)
        found = re.search(r"listening on: (http://\S+)", "\n".join(lighthouse.lines))
        assert found is not None
        env = dict(
            os.environ, TORCHFT_LIGHTHOUSE=found.group(1), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"
        )
        env["TORCHCOMM_TRANSPORT"] = args.transport
        for i in range(2):
            child = [
                sys.executable,
                __file__,
                "--replica",
                str(i),
                "--pg",
                pg,
                "--delay",
                str(delay),
            ]
            for flag in ("steps", "hidden", "fragments", "sync_every", "pause", "profile"):
                if getattr(args, flag) is not None:
                    child += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
            procs.append(proc(f"replica {i}", child, env))
        for p in procs[1:]:
            try:
                code = p.proc.wait(240)
            except subprocess.TimeoutExpired:
                code = None
            if code != 0:
                tail = "\n".join(p.lines[-30:])
                raise SystemExit(f"{pg} job: a replica exited with {code} (None: 240 s):\n{tail}")
    finally:
        for p in procs:
            p.kill()
    records = []
    for p in procs[1:]:
        for line in p.lines:
            if line.startswith("REC "):
                r = json.loads(line[4:])
                if r["n"] != 2:
                    raise SystemExit(f"an outer step committed without both replicas: {r}")
                if r["step"] > SKIP:
                    records.append(r)
    used = {x.split()[1] for p in procs[1:] for x in p.lines if x.startswith("TRANSPORT ")}
    return records, ",".join(sorted(used)) or "-"


def _quartiles(values: list[float]) -> dict[str, float]:
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return {"p25_ms": q1 * 1e3, "p50_ms": q2 * 1e3, "p75_ms": q3 * 1e3}


def _load() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="jobs per process group and delay")
    parser.add_argument("--steps", type=int, default=40, help="outer steps per job")
    parser.add_argument("--hidden", type=int, default=512, help="width of each fragment's layer")
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument(
        "--sync-every",
        type=int,
        default=8,
        help="DiLoCo's: a fragment every SYNC_EVERY / FRAGMENTS",
    )
    parser.add_argument("--delays", default="0,1", help="fragment_sync_delay values to run")
    parser.add_argument("--pause", type=float, default=0.005, help="seconds after each inner step")
    parser.add_argument(
        "--transport",
        choices=("auto", "shm", "tcp"),
        default="auto",
        help="our communicators' TORCHCOMM_TRANSPORT (auto: shm between processes of one host)",
    )
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", default=None, help="write each replica's cProfile to DIR")
    parser.add_argument("--replica", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--pg", choices=KINDS, default="torchcomms", help=argparse.SUPPRESS)
    parser.add_argument("--delay", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replica is not None:
        replica(args)
        return

    from torchcomms.bench.env import capture

    command = " ".join(["python", *sys.argv])
    env = capture(command, 2, "ProcessGroupTorchComms", "gloo")
    delays = [int(d) for d in args.delays.split(",")]
    h, f = args.hidden, args.fragments
    print(
        f"DiLoCo sync per outer step: 2 replica processes, {f} fragments of {h * h + h} "
        f"parameters ({(h * h + h) * 4 / 2**20:.2f} MiB), sync_every={args.sync_every}, "
        f"{args.steps} outer steps per job (first {SKIP} left out), {args.rounds} jobs per group"
        f" and delay; load {_load()}"
    )
    results: dict[str, Any] = {}
    jobs = []
    for delay in delays:
        samples: dict[str, list[dict[str, float]]] = {k: [] for k in KINDS}
        paired = []  # per round: gloo's job p50 / ours (the two jobs ran back to back)
        for r in range(args.rounds):
            p50 = {}
            for pg in KINDS if r % 2 == 0 else tuple(reversed(KINDS)):
                began, load = time.monotonic(), _load()
                records, transport = one_job(pg, delay, args)
                samples[pg] += records
                p50[pg] = statistics.median(x["sync"] for x in records) * 1e3
                seconds = round(time.monotonic() - began, 1)
                jobs.append(
                    {"delay": delay, "round": r, "pg": pg, "load_before": load}
                    | {"seconds": seconds, "sync_p50_ms": p50[pg], "transport": transport}
                )
                print(
                    f"  delay {delay} round {r} {pg:10s} sync p50 {p50[pg]:6.2f} ms  "
                    f"transport {transport}  load {load}"
                )
            paired.append(p50["gloo"] / p50["torchcomms"])
        summary: dict[str, Any] = {
            pg: {part: _quartiles([x[part] for x in samples[pg]]) for part in PARTS}
            | {"n": len(samples[pg])}
            for pg in KINDS
        }
        ratios = {
            part: summary["gloo"][part]["p50_ms"] / summary["torchcomms"][part]["p50_ms"]
            for part in PARTS
        }
        results[f"delay{delay}"] = {
            "summary": summary,
            "ratio_p50": ratios,
            "ratio_per_round": paired,
            "samples_ms": {
                pg: {part: [round(x[part] * 1e3, 3) for x in samples[pg]] for part in PARTS}
                for pg in KINDS
            },
        }
        print(f"fragment_sync_delay={delay}: p50 ms (p25-p75), n={summary['gloo']['n']} per group")
        print(f"  {'part':7s} {'torchcomms':>22s} {'gloo':>22s}  gloo/torchcomms")
        for part in PARTS:
            cells = [
                f"{s['p50_ms']:7.2f} ({s['p25_ms']:6.2f}-{s['p75_ms']:6.2f})"
                for s in (summary["torchcomms"][part], summary["gloo"][part])
            ]
            print(f"  {part:7s} {cells[0]:>22s} {cells[1]:>22s}  {ratios[part]:6.2f}")
        print(
            f"  sync, gloo/torchcomms per round: {' '.join(f'{x:.2f}' for x in paired)} "
            f"(median {statistics.median(paired):.2f})"
        )
    print(f"load at the end {_load()}")
    if args.json:
        doc = {"env": env, "args": vars(args), "load_average_end": _load(), "jobs": jobs}
        Path(args.json).write_text(json.dumps(doc | {"results": results}, indent=1))


if __name__ == "__main__":
    main()
