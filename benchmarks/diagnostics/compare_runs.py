"""Compare two bench JSON files (say before and after a change), op by op.

    python benchmarks/diagnostics/compare_runs.py BEFORE.json AFTER.json

For each op and size band it prints the geometric mean, over sizes and both placements
(out-of-place, in-place), of:

* ``vs gloo``: raw gloo's p50 over ours, in each run (the bench's own ``ratio``; higher is
  better), which cancels most of the machine's drift between the runs;
* ``p50 after/before``: our p50 in the second run over the first (below 1: faster).

Bands: small (up to 64 KiB), medium (64 KiB to 1 MiB), large (1 MiB and up).
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from typing import Any

_BANDS = (
    ("small", 0, 64 << 10),
    ("medium", (64 << 10) + 1, (1 << 20) - 1),
    ("large", 1 << 20, 1 << 62),
)


def _gmean(values: list[float]) -> float:
    vals = [v for v in values if v and v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else float("nan")


def _rows(path: str) -> dict[tuple[str, int], dict[str, Any]]:
    with open(path) as f:
        doc = json.load(f)
    return {(r["op"], r["size"]): r for r in doc["results"]}


def main(before_path: str, after_path: str) -> None:
    before, after = _rows(before_path), _rows(after_path)
    table: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for key, a in after.items():
        b = before.get(key)
        if b is None:
            continue
        op, size = key
        band = next(name for name, lo, hi in _BANDS if lo <= size <= hi)
        for place in ("out_of_place", "in_place"):
            pa, pb = a.get(place), b.get(place)
            if not pa or not pb:
                continue
            cell = table[(op, band)]
            cell["before"].append(pb["ratio"])
            cell["after"].append(pa["ratio"])
            cell["p50"].append(pa["ours"]["p50_us"] / pb["ours"]["p50_us"])
    print(
        f"{'op':16s} {'band':7s} {'vs gloo before':>15s} {'vs gloo after':>14s} {'p50 after/before':>17s}"
    )
    for (op, band), cell in sorted(
        table.items(), key=lambda kv: (kv[0][0], [b[0] for b in _BANDS].index(kv[0][1]))
    ):
        print(
            f"{op:16s} {band:7s} {_gmean(cell['before']):15.2f} {_gmean(cell['after']):14.2f} "
            f"{_gmean(cell['p50']):17.2f}"
        )
    every = [v for cell in table.values() for v in cell["p50"]]
    print(f"all cells: p50 after/before geometric mean {_gmean(every):.3f} over {len(every)} cells")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
