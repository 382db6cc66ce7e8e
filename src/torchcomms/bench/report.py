"""Output: the nccl-tests style table on stdout, progress lines on stderr, the JSON file.

Rows and cells are plain dicts (the JSON schema is the data model):

* document: ``env settings memory_bandwidth wire ceiling_model results wrong_total ok``
  (``wire``: the TCP stream's ``simplex_GBps duplex_GBps bytes reps from to loopback``, null
  for one rank; ``ceiling_model``: ``memory`` or ``wire``)
* row: ``op size count type redop root busbw_factor out_of_place in_place``
* cell (one placement): ``ours gloo ours_fr_off ratio mpi mpi_ratio fr_overhead_us
  ceiling_algbw_GBps pct_ceiling`` (absent parts are ``null``; ``ratio`` is gloo's p50 over
  ours, ``mpi_ratio`` MPI's)
* stats: ``p50_us mean_us p99_us min_us max_us algbw_GBps busbw_GBps wrong iters``
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any, TextIO

from torchcomms.bench.metrics import format_size

SCHEMA = "torchcomms.bench/1"
PLACEMENTS = (("out_of_place", "out-of-place"), ("in_place", "in-place"))

#: What ``%ceil`` is taken against, per ceiling model (``metrics.ceiling_model``).
_MODELS = {
    "memory": "algbw / the memory-bound ceiling of the op (shared memory: copies through "
    "memory, from the copy bandwidth)",
    "wire": "busbw / the wire's GB/s (tcp or ranks on several hosts: duplex for ops where every "
    "rank sends and receives at once, simplex for rooted ops and send/recv)",
}

_LEAD: tuple[tuple[str, str, int], ...] = (
    ("size", "(B)", 12),
    ("count", "(elements)", 11),
    ("type", "", 9),
    ("redop", "", 6),
    ("root", "", 5),
)


def _cell_columns(vs_gloo: bool, fr: bool, vs_mpi: bool = False) -> list[tuple[str, str, int]]:
    cols = [
        ("time", "(us)", 10),
        ("p99", "(us)", 10),
        ("algbw", "(GB/s)", 8),
        ("busbw", "(GB/s)", 8),
        ("%ceil", "(%)", 7),
        ("#wrong", "", 7),
    ]
    if vs_gloo:
        cols += [("gloo", "(us)", 10), ("ratio", "", 7)]
    if vs_mpi:
        cols += [("mpi", "(us)", 10), ("mpi/us", "", 7)]
    if fr:
        cols += [("fr+", "(us)", 10)]
    return cols


def _num(value: float | None, digits: int) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}"


def _cell_values(
    cell: dict[str, Any] | None, size: int, vs_gloo: bool, fr: bool, vs_mpi: bool = False
) -> list[str]:
    n = len(_cell_columns(vs_gloo, fr, vs_mpi))
    if cell is None:
        return ["-"] * n
    ours = cell["ours"]
    sized = size > 0
    values = [
        _num(ours["p50_us"], 2),
        _num(ours["p99_us"], 2),
        _num(ours["algbw_GBps"], 3) if sized else "-",
        _num(ours["busbw_GBps"], 3) if sized else "-",
        _num(cell["pct_ceiling"], 1) if sized else "-",
        str(ours["wrong"]) if ours["wrong"] is not None else "N/A",
    ]
    if vs_gloo:
        gloo = cell["gloo"]
        values += [_num(gloo["p50_us"] if gloo else None, 2), _num(cell["ratio"], 2)]
    if vs_mpi:
        mpi = cell.get("mpi")
        values += [_num(mpi["p50_us"] if mpi else None, 2), _num(cell.get("mpi_ratio"), 2)]
    if fr:
        values += [_num(cell["fr_overhead_us"], 2)]
    return values


class Printer:
    """Rank 0's writer: header, per-op table headers, one line per row, summary."""

    def __init__(self, out: TextIO, vs_gloo: bool, fr: bool, vs_mpi: bool = False) -> None:
        self.out = out
        self.vs_gloo = vs_gloo
        self.vs_mpi = vs_mpi
        self.fr = fr

    def line(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def preamble(
        self,
        settings: dict[str, Any],
        env: dict[str, Any],
        mem: dict[str, Any],
        wire: dict[str, Any] | None = None,
        model: str = "memory",
    ) -> None:
        self.line(
            f"# torchcomms.bench: backend {settings['backend']}, {env['world_size']} ranks, "
            f"dtype {settings['dtype']}, redop {settings['redop']}, iters {settings['iters']}, "
            f"warmup {settings['warmup']}, check {settings['check']}, blocks {settings['blocks']}"
            + (", vs gloo" if self.vs_gloo else "")
            + (", vs mpi" if self.vs_mpi else "")
            + (f", load {settings['load']} busy processes" if settings.get("load") else "")
            + f", threads {settings.get('threads', 1) or 'torch default'}"
        )
        self.line(
            f"# host {env['hostname']}: {env['cpu_model']}, {env['usable_cores']} usable cores "
            f"(cpu_count {env['cpu_count']}), load {env['load_average_start']}, "
            f"torch {env['torch']}, oversubscribed {env['oversubscribed']}"
        )
        self.line(
            f"# transport: ours {env['transport']}; raw gloo baseline "
            f"{env['baseline_transport'] or 'not run (add --vs gloo)'}"
            + (f"; MPI baseline {env.get('mpi_library')}" if self.vs_mpi else "")
        )
        self.line(
            f"# memory bandwidth (probe {format_size(mem['probe_bytes'])} buffers): "
            f"copy {mem['copy_1p_GBps']:.2f} GB/s (1 proc) {mem['copy_np_GBps']:.2f} GB/s "
            f"({mem['procs']} procs), add {mem['add_1p_GBps']:.2f} / {mem['add_np_GBps']:.2f} GB/s"
        )
        if env.get("simulated_hosts"):
            sim = env["simulated_hosts"]
            self.line(
                f"# simulated hosts: {sim['hosts']} network namespaces ({', '.join(sim['addresses'])}) "
                f"on one bridge, {sim['ranks_per_host']} rank(s) each; they share this machine's "
                "cores and memory"
            )
        if wire is not None:
            ends = f"rank 0 ({wire['from']['address']}) - rank {wire['to']['rank']} " + (
                "over loopback" if wire["loopback"] else f"({wire['to']['address']}) across hosts"
            )
            self.line(
                f"# wire (a TCP stream, {format_size(wire['bytes'])} x {wire['reps']}, {ends}): "
                f"simplex {wire['simplex_GBps']:.3f} GB/s, duplex {wire['duplex_GBps']:.3f} GB/s "
                "per direction"
            )
        self.line(f"# %ceil: {_MODELS[model]}")
        self.line(
            "# time = p50 of the per-iteration max over ranks; ratio = gloo p50 / ours p50"
            + ("; mpi/us = MPI p50 / ours p50" if self.vs_mpi else "")
        )

    def op_header(self, name: str, factor_text: str, ceiling_text: str) -> None:
        cells = _cell_columns(self.vs_gloo, self.fr, self.vs_mpi)
        cell_width = sum(w for _, _, w in cells)
        lead_width = sum(w for _, _, w in _LEAD)
        self.line()
        self.line(f"# {name}: busbw = algbw * {factor_text}; {ceiling_text}")
        self.line(
            "#"
            + " " * (lead_width - 1)
            + "".join(label.center(cell_width) for _, label in PLACEMENTS)
        )
        for pick in (lambda c: c[0], lambda c: c[1]):
            lead = "".join(pick(c).rjust(c[2]) for c in _LEAD)
            cell = "".join(pick(c).rjust(c[2]) for c in cells)
            self.line("#" + (lead + cell + cell)[1:])

    def row(self, row: dict[str, Any]) -> None:
        lead = [
            str(row["size"]),
            str(row["count"]),
            row["type"],
            row["redop"],
            str(row["root"]),
        ]
        text = "".join(v.rjust(w) for v, (_, _, w) in zip(lead, _LEAD, strict=True))
        widths = [w for _, _, w in _cell_columns(self.vs_gloo, self.fr, self.vs_mpi)]
        for key, _ in PLACEMENTS:
            values = _cell_values(row[key], row["size"], self.vs_gloo, self.fr, self.vs_mpi)
            text += "".join(v.rjust(w) for v, w in zip(values, widths, strict=True))
        self.line(text)

    def skipped(self, name: str, why: str) -> None:
        self.line()
        self.line(f"# {name}: skipped ({why})")

    def summary(self, wrong_total: int, rows: list[dict[str, Any]], checked: bool = True) -> None:
        self.line()
        if checked:
            status = "OK" if wrong_total == 0 else "FAILED"
            self.line(f"# Out of bounds values : {wrong_total} {status}")
        else:
            self.line("# Out of bounds values : not checked (-c 0)")
        for field, who in (("ratio", "gloo"), ("mpi_ratio", "mpi")):
            ratios = [
                cell[field]
                for row in rows
                for key, _ in PLACEMENTS
                if (cell := row[key]) is not None and cell.get(field) is not None
            ]
            if ratios:
                geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
                self.line(
                    f"# ratio {who}/ours (geometric mean over {len(ratios)} cells): {geo:.3f}"
                )


def progress(text: str) -> None:
    """One progress line on stderr."""
    print(f"# [bench] {text}", file=sys.stderr, flush=True)


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def write_json(path: str, document: dict[str, Any]) -> None:
    """Write the result document (non-finite floats become ``null``)."""
    with open(path, "w") as f:
        json.dump(_clean({"schema": SCHEMA, **document}), f, indent=1)
        f.write("\n")
