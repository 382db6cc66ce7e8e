"""The harness every op runs through, on each rank: check, warm up, time, gather, report.

Per (op, size, placement): a bit-exact check of every implementation (``-c``), ``-w``
warm-up iterations each, then ``--blocks`` alternating blocks (ours, [ours with the flight
recorder off], [raw gloo], then the same in reverse order, ...) that together give each
implementation ``-n`` timed iterations, then the check again.  An iteration is timed with
``perf_counter_ns`` around the blocking call on every rank; after timing, one
all_reduce(MAX) over our communicator turns the per-rank arrays into per-iteration maxima,
and one all_reduce(SUM) totals ``#wrong``.
Before the sweep, the ceilings are measured (``ceilings``: memory bandwidth, and the TCP
wire between rank 0 and the furthest rank); ``%ceil`` uses the wire when the transport is tcp
or the ranks span hosts, memory otherwise.
Rank 0 computes the statistics and prints; every rank knows the totals, so all agree on
the exit status.  Everything runs on the main thread (but the wire probe's sending half,
``ceilings``); every wait is bounded by ``--timeout``.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torchcomms import ReduceOp, TorchComm, config, new_comm
from torchcomms.backends.cpu import bootstrap
from torchcomms.bench import ceilings, metrics, report
from torchcomms.bench import env as envmod
from torchcomms.bench import hosts as hostsmod
from torchcomms.bench import mpi as mpib
from torchcomms.bench.cases import DTYPES, CaseParams, OpSpec
from torchcomms.transport import listen
from torchcomms.transport.gloo import process_group as gloo

CORRUPT_ENV = "TORCHCOMM_BENCH_CORRUPT"  # test-only: damage one rank's checked output
COMMAND_ENV = "TORCHCOMM_BENCH_COMMAND"  # the user's command line, passed on by the launcher
FR_ENV = "TORCHCOMM_FR_BUFFER_SIZE"
PROGRESS_AFTER_S = 3.0


@dataclass
class Settings:
    """What to run, resolved from the command line."""

    ops: list[OpSpec]
    sizes: list[int]
    iters: int
    warmup: int
    check: int
    dtype: str
    redop: str
    root: int
    backend: str
    vs_gloo: bool
    fr_overhead: bool
    blocks: int
    timeout_s: float
    quick: bool
    json_path: str | None
    plot_path: str | None
    vs_mpi: bool = False
    #: ``--load N``: busy processes beside the ranks (``env.Load``).
    load: int = 0
    #: ``--threads N``: torch's intra-op threads per rank (0: torch's default).
    threads: int = 1

    def describe(self) -> dict[str, Any]:
        return {
            "ops": [op.name for op in self.ops],
            "sizes": self.sizes,
            "iters": self.iters,
            "warmup": self.warmup,
            "check": self.check,
            "dtype": self.dtype,
            "redop": self.redop,
            "root": self.root,
            "backend": self.backend,
            "vs": ",".join(n for n, on in (("gloo", self.vs_gloo), ("mpi", self.vs_mpi)) if on)
            or None,
            "fr_overhead": self.fr_overhead,
            "blocks": self.blocks,
            "timeout_s": self.timeout_s,
            "quick": self.quick,
            "load": self.load,
            "threads": self.threads,
        }


@dataclass
class _Impl:
    """One implementation under test: ``ours``/``ours_fr_off`` (a TorchComm), ``gloo`` (a raw
    PG) or ``mpi`` (mpi4py's ``COMM_WORLD``)."""

    name: str
    target: Any


# -- set-up ----------------------------------------------------------------------------------------
def _job_store(rank: int, size: int, timeout: timedelta, over_mpi: bool) -> Any:
    """The store all ranks share: torchrun's agent store, or one rank 0 serves on MASTER_PORT
    (under mpirun without MASTER_PORT: on a port rank 0 picks and sends by MPI_Bcast)."""
    addr, port = config.master_addr_port()
    if (not addr or port is None) and over_mpi:
        addr = addr or "127.0.0.1"
        port = mpib.share_port(listen.free_master_port(addr) if rank == 0 else None)
    if not addr or port is None:
        raise RuntimeError("MASTER_ADDR and MASTER_PORT must be set (or run with --nproc N)")
    if config.torchelastic_agent_store() or rank != 0:
        store = dist.TCPStore(addr, port, None, False, timeout)
    else:
        store = dist.TCPStore(addr, port, size, True, timeout, wait_for_workers=False)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"torchcomms.bench/{restart}", store)


def _host_identities(store: Any, rank: int, size: int, timeout: timedelta) -> list[str]:
    """Every rank's host identity (``bootstrap.host_identity``: what ours decides locality
    by), in rank order."""
    store.set(f"host/{rank}", bootstrap.host_identity())
    keys = [f"host/{r}" for r in range(size)]
    store.wait(keys, timeout)
    return [store.get(k).decode() for k in keys]


def _gloo_baseline(
    store: Any, rank: int, size: int, timeout: timedelta, hosts: list[str]
) -> tuple[Any, str]:
    """A raw ProcessGroupGloo on the device ours would pick (``transport.gloo``, as ours does)."""
    desc, device = gloo.choose_device({}, hosts, hosts[rank])
    pg = gloo.new_process_group(dist.PrefixStore("pg", store), rank, size, timeout, device)
    return pg, f"tcp ({desc})"


def _comm_without_recorder(backend: str, store: Any, timeout: timedelta) -> TorchComm:
    """A second communicator created while the flight recorder is disabled by env."""
    previous = os.environ.get(FR_ENV)
    os.environ[FR_ENV] = "0"
    try:
        return new_comm(
            backend, torch.device("cpu"), name="bench_fr_off", store=store, timeout=timeout
        )
    finally:
        if previous is None:
            del os.environ[FR_ENV]
        else:
            os.environ[FR_ENV] = previous


# -- one row ---------------------------------------------------------------------------------------
def _split(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


@dataclass
class _Bound:
    name: str
    call: Callable[[Any], None]
    target: Any


def _no_mpi(world: Any) -> None:
    """MPI has no such operation for this case (its cell says ``-``): nothing is timed."""


def _checked_run(case: Any, impl: _Bound, corrupt: bool) -> int:
    case.reset()
    impl.call(impl.target)
    if corrupt:
        case.corrupt()
    return int(case.wrong())


def _measure(
    spec: OpSpec,
    params: CaseParams,
    impls: list[_Impl],
    settings: Settings,
    comm: TorchComm,
) -> tuple[list[list[float]], list[int], list[float], bool]:
    """Per-iteration max-over-ranks times (s) per impl, #wrong per impl summed over ranks, and
    per impl the CPU time all ranks spent (every thread) divided by the wall time of the timed
    loops: how many cores the op kept busy while it ran (waiting included); and whether MPI
    has this case (the same on every rank: it depends on the op, dtype and placement)."""
    case = spec.build(params)
    calls = {"gloo": case.gloo, "mpi": case.mpi or _no_mpi}
    bound = [_Bound(i.name, calls.get(i.name, case.ours), i.target) for i in impls]
    corrupt_rank = spec.checked_rank(params.nranks, params.root)
    corrupt = os.environ.get(CORRUPT_ENV, "") not in ("", "0") and corrupt_rank == params.rank
    wrong = [0] * len(bound)
    if settings.check:
        for k, impl in enumerate(bound):
            if impl.call is not _no_mpi:
                wrong[k] += _checked_run(case, impl, corrupt and impl.name == "ours")
    for impl in bound:
        for _ in range(settings.warmup):
            impl.call(impl.target)
    times: list[list[float]] = [[] for _ in bound]
    cpu_ns = [0] * len(bound)
    wall_ns = [0] * len(bound)
    order = list(range(len(bound)))
    for chunk in _split(settings.iters, min(settings.blocks, settings.iters)):
        for k in order:
            call, target, sink = bound[k].call, bound[k].target, times[k]
            c0, w0 = time.process_time_ns(), time.perf_counter_ns()
            for _ in range(chunk):
                t0 = time.perf_counter_ns()
                call(target)
                sink.append((time.perf_counter_ns() - t0) * 1e-9)
            cpu_ns[k] += time.process_time_ns() - c0
            wall_ns[k] += time.perf_counter_ns() - w0
        order.reverse()  # ABBA: neither implementation always runs first after a switch
    if settings.check:
        for k, impl in enumerate(bound):
            if impl.call is not _no_mpi:
                wrong[k] += _checked_run(case, impl, corrupt and impl.name == "ours")
    flat = torch.tensor([t for ts in times for t in ts], dtype=torch.float64)
    comm.all_reduce(flat, ReduceOp.MAX, False)
    wrong_t = torch.tensor(wrong, dtype=torch.int64)
    comm.all_reduce(wrong_t, ReduceOp.SUM, False)
    cpu_t = torch.tensor(cpu_ns, dtype=torch.float64)
    comm.all_reduce(cpu_t, ReduceOp.SUM, False)
    wall_t = torch.tensor(wall_ns, dtype=torch.float64)
    comm.all_reduce(wall_t, ReduceOp.MAX, False)
    busy = [float(c) / max(float(w), 1.0) for c, w in zip(cpu_t, wall_t, strict=True)]
    n = settings.iters
    maxed = flat.tolist()
    per_impl = [maxed[k * n : (k + 1) * n] for k in range(len(bound))]
    return per_impl, [int(w) for w in wrong_t], busy, case.mpi is not None


def _stats(
    times_s: list[float], divisor: int, nbytes: int, factor: float, wrong: int | None
) -> dict[str, Any]:
    stats: dict[str, Any] = metrics.summarize([t / divisor for t in times_s])
    alg = metrics.algbw(nbytes, stats["p50_us"] * 1e-6)
    stats["algbw_GBps"] = alg
    stats["busbw_GBps"] = metrics.busbw(alg, factor)
    stats["wrong"] = wrong
    stats["iters"] = len(times_s)
    return stats


def _cell(
    spec: OpSpec,
    nbytes: int,
    nranks: int,
    impls: list[_Impl],
    times: list[list[float]],
    wrong: list[int],
    ceiling: float | None,
    checked: bool,
    has_mpi: bool = True,
) -> dict[str, Any]:
    factor = spec.busbw_factor(nranks)
    by_name = {
        impl.name: _stats(
            times[k], spec.time_divisor, nbytes, factor, wrong[k] if checked else None
        )
        for k, impl in enumerate(impls)
    }
    ours = by_name["ours"]
    gloo = by_name.get("gloo")
    mpi = by_name.get("mpi") if has_mpi else None
    fr_off = by_name.get("ours_fr_off")
    pct = None
    if ceiling is not None and nbytes > 0:
        pct = 100.0 * ours["algbw_GBps"] / ceiling
    return {
        "ours": ours,
        "gloo": gloo,
        "ours_fr_off": fr_off,
        "ratio": metrics.ratio(gloo["p50_us"], ours["p50_us"]) if gloo else None,
        "mpi": mpi,
        "mpi_ratio": metrics.ratio(mpi["p50_us"], ours["p50_us"]) if mpi else None,
        "fr_overhead_us": ours["p50_us"] - fr_off["p50_us"] if fr_off else None,
        "ceiling_algbw_GBps": ceiling,
        "pct_ceiling": pct,
    }


# -- the rank's main -------------------------------------------------------------------------------
def run_rank(settings: Settings) -> int:
    """Run the benchmark as one rank; returns the process exit code."""
    try:
        return _run_rank(settings)
    except Exception:
        who = os.environ.get("TORCHCOMM_RANK") or os.environ.get("RANK") or "?"
        print(f"torchcomms.bench: rank {who} failed:", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        return 1


@dataclass
class _Session:
    """One rank's communicators and the implementations timed on them."""

    rank: int
    size: int
    comm: TorchComm  # ours; also carries the bench's own gathers
    impls: list[_Impl]
    environment: dict[str, Any]
    store: Any  # the job's store
    hosts: list[str]  # each rank's host identity

    def close(self) -> None:
        # Rank 0 serves the job store: nobody may leave while another rank still needs it.
        self.comm.barrier(False)
        for impl in self.impls:
            if isinstance(impl.target, TorchComm):
                impl.target.finalize()


def _open_session(settings: Settings) -> _Session:
    rank, size = bootstrap.query_ranksize()
    if settings.root >= size:
        raise ValueError(f"--root {settings.root} is out of range for {size} ranks")
    timeout = timedelta(seconds=settings.timeout_s)
    store = _job_store(rank, size, timeout, settings.vs_mpi)
    comm = new_comm(
        settings.backend,
        torch.device("cpu"),
        name="bench",
        store=dist.PrefixStore("ours", store),
        timeout=timeout,
    )
    impls = [_Impl("ours", comm)]
    if settings.fr_overhead:
        fr_store = dist.PrefixStore("ours_fr_off", store)
        impls.append(
            _Impl("ours_fr_off", _comm_without_recorder(settings.backend, fr_store, timeout))
        )
    hosts = _host_identities(store, rank, size, timeout)
    baseline_desc = None
    if settings.vs_gloo:
        pg, baseline_desc = _gloo_baseline(
            dist.PrefixStore("gloo", store), rank, size, timeout, hosts
        )
        impls.append(_Impl("gloo", pg))
    if settings.vs_mpi:
        impls.append(_Impl("mpi", mpib.world()))
    transport = str(getattr(comm.get_backend_impl(), "transport", "") or settings.backend)
    command = os.environ.get(COMMAND_ENV) or " ".join(["python -m torchcomms.bench", *sys.argv[1:]])
    simulated = hostsmod.layout_from_env()
    environment = envmod.capture(
        command,
        size,
        transport,
        baseline_desc,
        _local_pids(store, rank, size, same_machine=simulated is not None),
    )
    environment["mpi_library"] = mpib.library() if settings.vs_mpi else None
    _describe_hosts(environment, hosts, simulated)
    return _Session(rank, size, comm, impls, environment, store, hosts)


def _describe_hosts(
    environment: dict[str, Any], hosts: list[str], simulated: dict[str, Any] | None
) -> None:
    """The env's ``hosts``, ``ranks_per_host`` (a number when even, else a list in order of
    first rank) and ``simulated_hosts`` (``--hosts``); spanning hosts, the transports say so."""
    counts = Counter(hosts)
    per_host = [counts[h] for h in dict.fromkeys(hosts)]
    even = len(set(per_host)) == 1
    environment["hosts"] = len(counts)
    environment["ranks_per_host"] = per_host[0] if even else per_host
    environment["simulated_hosts"] = simulated
    if len(counts) > 1:
        spread = f"{per_host[0]} per host" if even else f"{'+'.join(map(str, per_host))} ranks"
        where = f" [ranks on {len(counts)} {'simulated ' if simulated else ''}hosts, {spread}]"
        for key in ("transport", "baseline_transport"):
            if environment.get(key):
                environment[key] += where


def _local_pids(store: Any, rank: int, size: int, same_machine: bool = False) -> list[int]:
    """The pids of the ranks on this host (``same_machine``: every rank's, as simulated hosts
    share one machine's cores): the cores they may use together are what the header reports
    (a launcher may pin each to a core of its own)."""
    host = socket.gethostname()
    store.set(f"pid/{rank}", f"{host} {os.getpid()}")
    keys = [f"pid/{r}" for r in range(size)]
    store.wait(keys)
    entries = [store.get(k).decode().rsplit(" ", 1) for k in keys]
    return [int(pid) for peer_host, pid in entries if same_machine or peer_host == host]


def _run_rank(settings: Settings) -> int:
    if settings.threads:  # the same for ours, the baselines and the probe
        torch.set_num_threads(settings.threads)
    session = _open_session(settings)
    rank = session.rank
    load = envmod.Load(settings.load) if rank == 0 and settings.load else None
    try:
        return _measure_and_report(settings, session, load)
    finally:
        if load is not None:
            load.stop()


def _measure_and_report(settings: Settings, session: _Session, load: envmod.Load | None) -> int:
    rank = session.rank
    if load is not None:
        session.environment["load_pids"] = load.pids()
    mem = ceilings.measure_memory(session.comm, rank, session.size, settings.quick)
    timeout = timedelta(seconds=settings.timeout_s)
    wire = ceilings.measure_wire(session.store, rank, session.hosts, settings.quick, timeout)
    env = session.environment
    model = metrics.ceiling_model(env["transport"], env["hosts"]) if wire else "memory"
    printer = None
    if rank == 0:
        printer = report.Printer(
            sys.stdout, settings.vs_gloo, settings.fr_overhead, vs_mpi=settings.vs_mpi
        )
        printer.preamble(settings.describe(), env, mem, wire, model)
    start = time.monotonic()
    rows, wrong_total = _sweep(settings, session, mem, wire, model, printer)
    ok = wrong_total == 0
    if printer is not None:
        printer.summary(wrong_total, rows, checked=bool(settings.check))
        environment = session.environment
        environment["load_average_end"] = envmod.load_average()
        environment["elapsed_s"] = round(time.monotonic() - start, 2)
        document = {
            "env": environment,
            "settings": settings.describe(),
            "memory_bandwidth": mem,
            "wire": wire,
            "ceiling_model": model,
            "results": rows,
            "wrong_total": wrong_total,
            "ok": ok,
        }
        if settings.json_path:
            report.write_json(settings.json_path, document)
            report.progress(f"wrote {settings.json_path}")
        if settings.plot_path:
            from torchcomms.bench import plot

            plot.plot(document, settings.plot_path)
            report.progress(f"wrote {settings.plot_path}")
    session.close()
    # Only rank 0 reports a failed check, so a launcher never kills it before it has written.
    return 0 if ok or rank != 0 else 1


def _sweep(
    settings: Settings,
    session: _Session,
    mem: dict[str, Any],
    wire: dict[str, Any] | None,
    model: str,
    printer: report.Printer | None,
) -> tuple[list[dict[str, Any]], int]:
    """Every (op, size, placement): measure; rank 0 builds and prints the rows, ``%ceil``
    against the ``model`` ceiling (``ceilings``)."""
    rank, size = session.rank, session.size
    dtype = DTYPES[settings.dtype]
    esize = torch.empty((), dtype=dtype).element_size()
    rows: list[dict[str, Any]] = []
    wrong_total = 0
    start = time.monotonic()
    planned = _planned_rows(settings, size, esize)
    done = 0
    for spec in settings.ops:
        if size < spec.min_ranks:
            if printer is not None:
                printer.skipped(spec.name, f"needs at least {spec.min_ranks} ranks")
            continue
        # send/recv copies happen one after the other: the 1-process bandwidth bounds them.
        probe_key = "copy_1p_GBps" if spec.time_divisor > 1 else "copy_np_GBps"
        mem_bw: float | None = mem.get(probe_key)  # rank 0 only has the 1-process figure
        if printer is not None:
            printer.op_header(
                spec.name,
                spec.factor_text,
                ceilings.ceiling_text(spec, size, model, mem_bw, wire),
            )
        for count in _counts(spec, settings.sizes, size, esize):
            nbytes = count * esize
            t_row = time.monotonic()
            row: dict[str, Any] = {
                "op": spec.name,
                "size": nbytes,
                "count": count,
                "type": settings.dtype if spec.sized else "-",
                "redop": settings.redop if spec.reduces else "none",
                "root": settings.root if spec.rooted else -1,
                "busbw_factor": spec.busbw_factor(size),
                "out_of_place": None,
                "in_place": None,
            }
            checked = bool(settings.check) and spec.sized
            for in_place in spec.placements:
                params = CaseParams(
                    rank,
                    size,
                    count,
                    dtype,
                    settings.redop,
                    settings.root,
                    in_place,
                    vs_mpi=settings.vs_mpi,
                )
                times, wrong, busy, has_mpi = _measure(
                    spec, params, session.impls, settings, session.comm
                )
                wrong_total += sum(wrong) if checked else 0
                cell = _cell(
                    spec,
                    nbytes,
                    size,
                    session.impls,
                    times,
                    wrong,
                    ceilings.ceiling(spec, size, in_place, model, mem_bw, wire),
                    checked,
                    has_mpi,
                )
                for impl, cores in zip(session.impls, busy, strict=True):
                    if cell.get(impl.name) is not None:
                        cell[impl.name]["cpu_cores_busy"] = cores
                row["in_place" if in_place else "out_of_place"] = cell
            done += 1
            if printer is not None:
                rows.append(row)
                printer.row(row)
                if time.monotonic() - start > PROGRESS_AFTER_S:
                    report.progress(
                        f"{spec.name} {metrics.format_size(nbytes)}: "
                        f"{time.monotonic() - t_row:.1f} s ({done}/{planned} rows, "
                        f"{time.monotonic() - start:.0f} s elapsed)"
                    )
    return rows, wrong_total


def _counts(spec: OpSpec, sizes: list[int], nranks: int, esize: int) -> list[int]:
    """Distinct non-empty element counts for the sweep (one empty row for barrier)."""
    if not spec.sized:
        return [0]
    counts: list[int] = []
    for nbytes in sizes:
        count = spec.count_for(nbytes, nranks, esize)
        if count > 0 and count not in counts:
            counts.append(count)
    return counts


def _planned_rows(settings: Settings, nranks: int, esize: int) -> int:
    return sum(
        len(_counts(spec, settings.sizes, nranks, esize))
        for spec in settings.ops
        if nranks >= spec.min_ranks
    )
