"""Command line of ``python -m torchcomms.bench``: flags (nccl-tests' where they exist) and dispatch.

Without a launcher (no ``TORCHCOMM_RANK``/``RANK`` in the environment) or with ``--nproc N``
the command spawns N local ranks (``launch``); under ``torchrun`` (or as a spawned worker)
it runs as one rank (``runner``).  Bad arguments exit with argparse's status 2 before any
rank starts.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from torchcomms.bench import cases as ops
from torchcomms.bench import hosts as hostsmod
from torchcomms.bench import launch, metrics, runner
from torchcomms.bench import mpi as mpib

DEFAULTS = {"min_bytes": "8", "max_bytes": "16M", "factor": 8, "iters": 20, "warmup": 5}
QUICK = {"min_bytes": "8", "max_bytes": "1M", "factor": 32, "iters": 5, "warmup": 2}
DEFAULT_NPROC = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchcomms.bench",
        description="nccl-tests style benchmark of torchcomms collectives, "
        "optionally side by side with raw ProcessGroupGloo (--vs gloo).",
    )
    p.add_argument(
        "-b", "--minbytes", dest="min_bytes", help="smallest size (8, 1K, 64M; default 8)"
    )
    p.add_argument("-e", "--maxbytes", dest="max_bytes", help="largest size (default 16M)")
    p.add_argument(
        "-f", "--stepfactor", dest="factor", type=int, help="size multiplier (default 8)"
    )
    p.add_argument("-n", "--iters", dest="iters", type=int, help="timed iterations (default 20)")
    p.add_argument(
        "-w", "--warmup_iters", dest="warmup", type=int, help="warm-up iterations (default 5)"
    )
    p.add_argument(
        "-c",
        "--check",
        dest="check",
        type=int,
        default=1,
        choices=(0, 1),
        help="bit-exact check before and after timing (default 1)",
    )
    p.add_argument("--dtype", default="float32", choices=sorted(ops.DTYPES), help="default float32")
    p.add_argument("--redop", default="sum", choices=sorted(ops.REDOPS), help="default sum")
    p.add_argument("--root", type=int, default=0, help="root rank of reduce/broadcast (default 0)")
    p.add_argument("--backend", default="gloo", help="torchcomms backend (default gloo)")
    p.add_argument(
        "--nproc",
        type=int,
        help=f"spawn N local ranks (default {DEFAULT_NPROC} unless run under a launcher)",
    )
    p.add_argument(
        "--hosts",
        type=int,
        default=1,
        metavar="H",
        help="place the --nproc ranks on H simulated hosts (network namespaces joined by a "
        "bridge, ranks in blocks; needs root and ip netns; default 1: this host)",
    )
    p.add_argument(
        "--op",
        default=",".join(ops.OPS),
        help=f"comma-separated ops (default all: {','.join(ops.OPS)}; "
        "the window ops put,get run only when named)",
    )
    p.add_argument(
        "--vs",
        help="also time baselines, alternating blocks: gloo (raw ProcessGroupGloo), mpi "
        "(MPI's own ops through mpi4py; run under mpirun), or gloo,mpi",
    )
    p.add_argument("--json", dest="json_path", metavar="PATH", help="write the results as JSON")
    p.add_argument(
        "--plot", dest="plot_path", metavar="PATH", help="write a PNG plot (needs matplotlib)"
    )
    p.add_argument(
        "--quick", action="store_true", help="few sizes and iterations (< 1 min on 2 cores)"
    )
    p.add_argument(
        "--blocks",
        type=int,
        default=4,
        help="alternating blocks the timed iterations are split into (default 4)",
    )
    p.add_argument(
        "--fr-overhead",
        action="store_true",
        help="also time a comm created with TORCHCOMM_FR_BUFFER_SIZE=0; report recorder on - off",
    )
    p.add_argument(
        "--timeout", type=float, default=300.0, help="seconds any one wait may take (default 300)"
    )
    p.add_argument(
        "--affinity",
        choices=("off", "spread"),
        default=None,
        help="pin local rank i to core i mod cores (TORCHCOMM_CPU_AFFINITY=spread); default: "
        "the environment's setting, else off",
    )
    p.add_argument(
        "--load",
        type=int,
        default=0,
        metavar="N",
        help="N processes that keep a core busy each beside the ranks, as in training "
        "(default 0: quiet cores)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        metavar="N",
        help="torch intra-op threads in each rank (torch.set_num_threads), for ours and the "
        "baselines alike (default 1, as torchrun sets; 0: torch's own default, one per core, "
        "as a script started otherwise gets)",
    )
    p.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    return p


#: The ``runner.Settings`` fields that are the option of the same name, as parsed.
_AS_GIVEN = (
    "iters",
    "warmup",
    "check",
    "dtype",
    "redop",
    "root",
    "backend",
    "fr_overhead",
    "blocks",
    "quick",
    "json_path",
    "plot_path",
    "load",
    "threads",
)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, runner.Settings]:
    """Parse and validate; errors exit with status 2 (argparse's convention)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    mode = QUICK if args.quick else DEFAULTS
    for key, value in mode.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        min_bytes = metrics.parse_size(str(args.min_bytes))
        max_bytes = metrics.parse_size(str(args.max_bytes))
        sizes = metrics.size_sweep(min_bytes, max_bytes, args.factor)
        specs = ops.resolve([name for name in args.op.split(",") if name.strip()])
    except ValueError as exc:
        parser.error(str(exc))
    if not specs:
        parser.error("--op names no op")
    if args.threads < 0:
        parser.error(f"--threads takes a number of threads >= 0 (got {args.threads})")
    if args.load < 0:
        parser.error(f"--load takes a number of processes >= 0 (got {args.load})")
    if args.iters < 1:
        parser.error(f"-n must be >= 1 (got {args.iters})")
    if args.warmup < 0:
        parser.error(f"-w must be >= 0 (got {args.warmup})")
    if args.blocks < 1:
        parser.error(f"--blocks must be >= 1 (got {args.blocks})")
    if args.nproc is not None and args.nproc < 1:
        parser.error(f"--nproc must be >= 1 (got {args.nproc})")
    if args.hosts != 1:
        _check_hosts(parser, args)
    if args.root < 0 or (args.nproc is not None and args.root >= args.nproc):
        parser.error(f"--root {args.root} is out of range for {args.nproc} ranks")
    if args.timeout <= 0:
        parser.error(f"--timeout must be positive (got {args.timeout})")
    if args.plot_path and importlib.util.find_spec("matplotlib") is None:
        parser.error(
            "--plot needs matplotlib, which is not installed: "
            "pip install matplotlib (or pip install 'torchcomms-py[plot]')"
        )
    baselines = {b.strip() for b in (args.vs or "").split(",") if b.strip()}
    if baselines - {"gloo", "mpi"}:
        parser.error(f"--vs takes gloo, mpi or gloo,mpi (got {args.vs!r})")
    if "mpi" in baselines:
        if args.nproc is not None:
            parser.error("--vs mpi runs under mpirun, which starts the ranks: drop --nproc")
        why = mpib.missing()
        if why is not None:  # asked for and impossible: say so before anything starts
            parser.error(f"--vs mpi: {why}")
        if not mpib.launched():
            parser.error(f"--vs mpi: {mpib.LAUNCH_HINT}")
    settings = runner.Settings(
        ops=specs,
        sizes=sizes,
        vs_gloo="gloo" in baselines,
        vs_mpi="mpi" in baselines,
        timeout_s=args.timeout,
        **{name: getattr(args, name) for name in _AS_GIVEN},
    )
    return args, settings


def _check_hosts(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--hosts``: only the spawning launcher places ranks, in equal blocks, as root."""
    nproc = args.nproc or DEFAULT_NPROC
    if args.hosts < 1 or args.hosts > hostsmod.MAX_HOSTS:
        parser.error(f"--hosts takes 1 to {hostsmod.MAX_HOSTS} hosts (got {args.hosts})")
    if args._worker:  # the launcher checked the rest before it built the hosts
        return
    if (args.vs and "mpi" in args.vs) or (args.nproc is None and under_launcher()):
        parser.error(
            "--hosts places the ranks the bench spawns itself (--nproc N), so it cannot run "
            "under mpirun or torchrun, which started the ranks already"
        )
    if nproc % args.hosts:
        parser.error(
            f"--nproc {nproc} is not a multiple of --hosts {args.hosts} (every simulated host "
            "gets the same number of ranks)"
        )
    why = hostsmod.unavailable()
    if why is not None:
        parser.error(why)


def under_launcher() -> bool:
    """True when a launcher (torchrun, mpirun, ...) already made this process a rank."""
    return any(
        os.environ.get(v) for v in ("TORCHCOMM_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, settings = parse_args(argv)
    if args.affinity is not None:  # the ranks (spawned here or under a launcher) read it
        os.environ["TORCHCOMM_CPU_AFFINITY"] = args.affinity
    if args._worker or (args.nproc is None and under_launcher()):
        return runner.run_rank(settings)
    return launch.spawn(argv, args.nproc or DEFAULT_NPROC, args.hosts)
