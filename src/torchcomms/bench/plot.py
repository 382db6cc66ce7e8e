"""PNG of a result document: per op, busbw and latency (p50) vs size, ours vs gloo and MPI.

matplotlib is an optional extra (``pip install 'torchcomms-py[plot]'``); without it the
functions raise ``RuntimeError`` with that instruction.  Also usable on a saved JSON:
``python -m torchcomms.bench.plot results.json out.png``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

MISSING = (
    "plotting needs matplotlib, which is not installed: "
    "pip install matplotlib (or pip install 'torchcomms-py[plot]')"
)

_SERIES = (
    ("out_of_place", "ours", "ours", "-", "o"),
    ("out_of_place", "gloo", "gloo", "--", "s"),
    ("in_place", "ours", "ours in-place", ":", "^"),
    ("in_place", "gloo", "gloo in-place", "-.", "v"),
    ("out_of_place", "mpi", "MPI", "--", "D"),
    ("in_place", "mpi", "MPI in-place", "-.", "d"),
)


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError(MISSING) from None
    return plt


def _latency_bars(ax_off: Any, ax: Any, name: str, row: dict[str, Any]) -> None:
    """An op without payload (barrier): p50 and p99 bars, ours vs gloo and MPI."""
    ax_off.axis("off")
    cell = row.get("out_of_place") or {}
    labels, p50, p99 = [], [], []
    for impl in ("ours", "gloo", "mpi"):
        if cell.get(impl):
            labels.append(impl)
            p50.append(cell[impl]["p50_us"])
            p99.append(cell[impl]["p99_us"])
    xs = list(range(len(labels)))
    ax.bar([x - 0.2 for x in xs], p50, width=0.4, label="p50")
    ax.bar([x + 0.2 for x in xs], p99, width=0.4, label="p99")
    ax.set_xticks(xs, labels)
    ax.set_title(f"{name}: time")
    ax.set_ylabel("time (us)")
    ax.legend(fontsize=7)


def plot(document: dict[str, Any], path: str) -> None:
    """Write the PNG for ``document`` (the JSON written by ``--json``) to ``path``."""
    plt = _pyplot()
    rows = document["results"]
    names = list(dict.fromkeys(row["op"] for row in rows))
    env = document.get("env", {})
    fig, axes = plt.subplots(len(names), 2, figsize=(12, 3.0 * max(len(names), 1)), squeeze=False)
    for i, name in enumerate(names):
        op_rows = [row for row in rows if row["op"] == name]
        ax_bw, ax_lat = axes[i][0], axes[i][1]
        if all(row["size"] == 0 for row in op_rows):
            _latency_bars(ax_bw, ax_lat, name, op_rows[0])
            continue
        for placement, impl, label, style, marker in _SERIES:
            xs, bws, lats = [], [], []
            for row in op_rows:
                cell = row.get(placement)
                if not cell or not cell.get(impl):
                    continue
                xs.append(row["size"])
                bws.append(cell[impl]["busbw_GBps"])
                lats.append(cell[impl]["p50_us"])
            if xs:
                ax_bw.plot(xs, bws, linestyle=style, marker=marker, label=label)
                ax_lat.plot(xs, lats, linestyle=style, marker=marker, label=label)
        for ax, ylabel in ((ax_bw, "busbw (GB/s)"), (ax_lat, "p50 time (us)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{name}: {ylabel.split(' (')[0]}")
            ax.set_xlabel("size (bytes)")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7)
    fig.suptitle(
        f"torchcomms.bench: {env.get('world_size', '?')} ranks, {env.get('cpu_model', '')}, "
        f"{env.get('usable_cores', '?')} cores, torch {env.get('torch', '')}",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m torchcomms.bench.plot RESULTS.json OUT.png", file=sys.stderr)
        return 2
    with open(args[0]) as f:
        document = json.load(f)
    try:
        plot(document, args[1])
    except RuntimeError as exc:
        print(f"torchcomms.bench.plot: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
