"""What DiLoCo's synchronisation costs per outer step: torchcomms against torchft's gloo.

    python benchmarks/diagnostics/diloco_sync.py [--rounds 3] [--steps 16] [--hidden 1024] \
        [--fragments 4] [--sync-every 8] [--json out.json]

Runs ``examples/ft_diloco.py`` without a kill (two replica processes and torchft's
lighthouse; Streaming DiLoCo, ``fragment_sync_delay=1``, ``alpha=0.5``), alternating the
replicas' process group between ``ProcessGroupTorchComms(new_comm("gloo", ...))`` and
torchft's own ``ProcessGroupGloo``, ``--rounds`` times each, in one sitting.  Per outer step
each replica records what the synchronisation added to that outer step's optimizer steps
(their total minus as many times the fastest one: the quorum, the all_reduce of a
fragment's pseudo-gradients, the commit and the outer optimizer step); the first outer step
(connection set-up) is left out.  Prints the median and quartiles per process group and the
ratio gloo / torchcomms of the medians (above 1: ours is faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from torchcomms.bench.env import capture

REPO = Path(__file__).resolve().parents[2]
KINDS = ("torchcomms", "gloo")


def one_job(pg: str, args: argparse.Namespace) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "records.json")
        cmd = [
            sys.executable,
            str(REPO / "examples" / "ft_diloco.py"),
            "--kill-step",
            "0",
            "--pause",
            "0",
            "--pg",
            pg,
            "--json",
            str(out),
            "--steps",
            str(args.steps),
            "--hidden",
            str(args.hidden),
            "--fragments",
            str(args.fragments),
            "--sync-every",
            str(args.sync_every),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"{pg} job failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        records = json.loads(out.read_text())["records"]
    return [r["sync_s"] for life in records.values() for r in life if r["step"] > 1]


def quartiles(values: list[float]) -> dict[str, float]:
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return {"p25_ms": q1 * 1e3, "p50_ms": q2 * 1e3, "p75_ms": q3 * 1e3, "n": len(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--sync-every", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    env = capture(" ".join(["python", *sys.argv]), 2, "ProcessGroupTorchComms", "gloo")
    samples: dict[str, list[float]] = {k: [] for k in KINDS}
    for r in range(args.rounds):
        for pg in KINDS if r % 2 == 0 else reversed(KINDS):
            samples[pg] += one_job(pg, args)
    h = args.hidden
    params = 9 * h + (args.fragments - 2) * (h * h + h) + h + 1  # the example's model
    summary: dict[str, Any] = {k: quartiles(v) for k, v in samples.items()}
    ratio = summary["gloo"]["p50_ms"] / summary["torchcomms"]["p50_ms"]
    print(
        f"DiLoCo sync per outer step, {params} parameters in {args.fragments} fragments, "
        f"{args.rounds} rounds per process group"
    )
    for k in KINDS:
        s = summary[k]
        print(
            f"  {k:10s} p50 {s['p50_ms']:7.2f} ms  (p25 {s['p25_ms']:.2f}, p75 {s['p75_ms']:.2f},"
            f" n={s['n']})"
        )
    print(f"  ratio gloo / torchcomms (p50): {ratio:.2f}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "env": env,
                    "args": vars(args),
                    "summary": summary,
                    "ratio_p50": ratio,
                    "samples_s": samples,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
