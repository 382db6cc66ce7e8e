"""``python -m torchcomms.tools.fr DIR [--trace out.json]``: read a job's flight-recorder dumps.

``DIR`` holds one dump per rank (the pickles ``dump_file``/auto-dumps write, or JSON from
``dump_json``).  For every communicator the report shows, per rank, the last collective it
entered and the last it finished, then a verdict::

    rank 3 never entered all_reduce #42 (op_id 97); ranks 0-2 waiting since 12.3 s

plus failed ops (with their error) and size/dtype/op mismatches between ranks at the same
sequence number.  ``--trace out.json`` writes a Chrome/Perfetto trace (one track per rank,
one row per communicator; open it at https://ui.perfetto.dev or chrome://tracing).

Only files in the recorder's own format are read (``comm_lib_version`` ``"torchcomms"``, a
known ``version``); pickles are read with an unpickler that refuses any class or function, so
a planted file cannot run code.  Every other file is refused with an error naming it.

Exit status: 0 when nothing is wrong, 1 when a hang, failure or mismatch was found or a file
was refused, 2 when the directory holds no readable dump.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import re
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torchcomms import optable

# Ops whose sizes legitimately differ between ranks (per-rank splits, root-only buffers):
# the op table's, plus the records that are not ops of the table.
_RANK_DEPENDENT_SIZES = {
    *(e.method for e in optable.OPS if e.rank_dependent_sizes),
    "split",
    "coalesced",
}


@dataclass
class Dump:
    rank: int
    path: str
    data: dict[str, Any]

    @property
    def dump_time_ns(self) -> int | None:
        meta = self.data.get("torchcomms") or {}
        return meta.get("dump_time_ns")


@dataclass
class CommView:
    """One communicator as seen across the dumps: entries per rank, collectives only."""

    name: str
    ranks: list[int]
    entries: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    p2p: dict[int, list[dict[str, Any]]] = field(default_factory=dict)


class DumpFormatError(ValueError):
    """A file that is not a torchcomms flight-recorder dump; the message names the file."""


# What a dump is (``torchcomms.hooks._fr_dump``: ``FORMAT_MARK``, ``FR_VERSION``); kept here
# so that this tool imports neither torch nor torchcomms.
_FORMAT_MARK = "torchcomms"
_SUPPORTED_VERSIONS = frozenset({"2.10"})
#: Globals a dump's pickle may name: none, since a dump holds only dicts, lists, str, int,
#: float, bool and None, which pickle writes without naming any class or function.
_PICKLE_GLOBALS: frozenset[tuple[str, str]] = frozenset()


class _DumpUnpickler(pickle.Unpickler):
    """Unpickles plain data only: a pickle naming any class or function is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _PICKLE_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which no dump contains")


def load_dir(directory: str) -> list[Dump]:
    """Every dump under ``directory`` (pickle or JSON), sorted by rank; other files are skipped."""
    return scan_dir(directory)[0]


def scan_dir(directory: str) -> tuple[list[Dump], list[DumpFormatError]]:
    """The dumps under ``directory`` (pickle or JSON), sorted by rank, and the files refused."""
    dumps: list[Dump] = []
    refused: list[DumpFormatError] = []
    for root, _, files in os.walk(directory):
        for fname in sorted(files):
            path = os.path.join(root, fname)
            try:
                data = load_dump(path)
            except DumpFormatError as exc:
                refused.append(exc)
                continue
            rank = (data.get("torchcomms") or {}).get("rank")
            if rank is None:
                m = re.search(r"(\d+)(?:\.json)?$", fname)
                if m is None:
                    refused.append(DumpFormatError(f"{path}: no rank in the dump or its name"))
                    continue
                rank = int(m.group(1))
            dumps.append(Dump(int(rank), path, data))
    dumps.sort(key=lambda d: d.rank)
    return dumps, refused


def load_dump(path: str) -> dict[str, Any]:
    """One dump (JSON, or a pickle read without running any code); ``DumpFormatError`` if not."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise DumpFormatError(f"{path}: cannot read it ({exc.strerror or exc})") from exc
    data: Any = None
    if raw[:1] in (b"{", b"["):
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise DumpFormatError(f"{path}: not a flight-recorder dump (bad JSON: {exc})") from exc
    else:
        try:
            data = _DumpUnpickler(io.BytesIO(raw)).load()
        except Exception as exc:
            raise DumpFormatError(
                f"{path}: refused, not a torchcomms flight-recorder dump (unpickling: {exc})"
            ) from exc
    problem = _format_problem(data)
    if problem:
        raise DumpFormatError(f"{path}: refused, not a torchcomms flight-recorder dump ({problem})")
    return data


def _format_problem(data: Any) -> str:
    """Why ``data`` is not a dump in the recorder's format ("" when it is one)."""
    if not isinstance(data, dict):
        return f"top level is a {type(data).__name__}, not a dict"
    mark = data.get("comm_lib_version")
    if mark != _FORMAT_MARK:
        return f"comm_lib_version is {mark!r}, expected {_FORMAT_MARK!r}"
    version = data.get("version")
    if version not in _SUPPORTED_VERSIONS:
        return f"version {version!r} is not one of {sorted(_SUPPORTED_VERSIONS)}"
    if not isinstance(data.get("torchcomms"), dict):
        return "no torchcomms section"
    entries = data.get("entries")
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        return "entries is not a list of dicts"
    return ""


def _op(entry: dict[str, Any]) -> str:
    name = str(entry.get("profiling_name", "?:?"))
    return name.split(":", 1)[-1].split(" ", 1)[0]


def comm_views(dumps: Sequence[Dump]) -> list[CommView]:
    views: dict[tuple[str, str], CommView] = {}
    for dump in dumps:
        pg_config = dump.data.get("pg_config") or {}
        for entry in dump.data.get("entries") or []:
            name = entry["process_group"][0]
            ranks_text = str((pg_config.get(name) or {}).get("ranks", "[]"))
            key = (name, ranks_text)
            view = views.get(key)
            if view is None:
                try:
                    ranks = [int(x) for x in re.findall(r"-?\d+", ranks_text)]
                except ValueError:
                    ranks = []
                view = views[key] = CommView(name, ranks)
            side = view.p2p if entry.get("is_p2p") else view.entries
            side.setdefault(dump.rank, []).append(entry)
    for view in views.values():
        for entries in view.entries.values():
            entries.sort(key=lambda e: e.get("collective_seq_id", 0))
    return sorted(views.values(), key=lambda v: (v.name, v.ranks))


def rank_ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    rs = sorted(set(ranks))
    out: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ", ".join(out)


def _plural(ranks: Iterable[int]) -> str:
    rs = sorted(set(ranks))
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {rank_ranges(rs)}"


def _describe(entry: dict[str, Any]) -> str:
    return f"{_op(entry)} #{entry.get('collective_seq_id')} (op_id {entry.get('op_id')})"


def analyze_comm(view: CommView, dumps_by_rank: dict[int, Dump]) -> tuple[list[str], bool]:
    """Report lines for one communicator and whether something is wrong."""
    lines: list[str] = []
    problem = False
    members = view.ranks or sorted(view.entries)
    lines.append(f"communicator {view.name!r} (ranks {rank_ranges(members)})")
    last_entered: dict[int, dict[str, Any] | None] = {}
    for r in members:
        entries = view.entries.get(r, [])
        entered = entries[-1] if entries else None
        finished = next(
            (e for e in reversed(entries) if e.get("state") == "completed" and not e.get("error")),
            None,
        )
        last_entered[r] = entered
        if r not in dumps_by_rank:
            lines.append(f"  rank {r}: no dump")
            continue
        ent = _describe(entered) if entered else "-"
        fin = _describe(finished) if finished else "-"
        state = ""
        if entered is not None and entered is not finished:
            state = f" [{'failed' if entered.get('error') else entered.get('state')}]"
        lines.append(f"  rank {r}: last entered {ent}{state}; last finished {fin}")
    dumped = [r for r in members if r in dumps_by_rank]
    missing_dumps = [r for r in members if r not in dumps_by_rank]
    if missing_dumps:
        lines.append(f"  note: no dump from {_plural(missing_dumps)}")
    seqs = {r: (e.get("collective_seq_id", 0) if e else 0) for r, e in last_entered.items()}
    top = max((seqs[r] for r in dumped), default=0)
    if top == 0:
        lines.append("  verdict: no collectives recorded")
        return lines, problem
    leaders = [r for r in dumped if seqs[r] == top]
    behind = [r for r in dumped if seqs[r] < top]
    ref = last_entered[leaders[0]]
    assert ref is not None
    unfinished = [
        r
        for r in leaders
        if (e := last_entered[r]) is not None and (e.get("state") != "completed" or e.get("error"))
    ]
    parts: list[str] = []
    if behind:
        problem = True
        by_seq: dict[int, list[int]] = defaultdict(list)
        for r in behind:
            by_seq[seqs[r]].append(r)
        for seq, rs in sorted(by_seq.items()):
            # the first collective they did not enter
            nxt = _entry_at(view, leaders, seq + 1) or ref
            parts.append(f"{_plural(rs)} never entered {_describe(nxt)}")
    if unfinished:
        problem = True
        waits = []
        for r in unfinished:
            e = last_entered[r]
            assert e is not None
            now = dumps_by_rank[r].dump_time_ns
            since = e.get("time_discovered_started_ns") or e.get("time_created_ns")
            if now and since:
                waits.append((now - since) / 1e9)
        failed = [r for r in unfinished if (last_entered[r] or {}).get("error")]
        waiting = [r for r in unfinished if r not in failed]
        wait_txt = f" since {max(waits):.1f} s" if waits else ""
        if waiting:
            parts.append(f"{_plural(waiting)} waiting in {_describe(ref)}{wait_txt}")
        if failed:
            took = [float((last_entered[r] or {}).get("duration_ms") or 0) for r in failed]
            after = f" after {max(took) / 1e3:.1f} s" if max(took) > 0 else ""
            parts.append(f"{_plural(failed)} failed in {_describe(ref)}{after}")
    if not parts:
        parts.append(f"all ranks completed {_describe(ref)}; nothing pending")
    lines.append("  verdict: " + "; ".join(parts))
    for r in dumped:
        for e in view.entries.get(r, []):
            if e.get("error"):
                problem = True
                lines.append(f"  rank {r}: {_describe(e)} failed: {e['error']}")
    mismatches = find_mismatches(view)
    if mismatches:
        problem = True
        lines.extend(f"  mismatch: {m}" for m in mismatches)
    return lines, problem


def _entry_at(view: CommView, ranks: Sequence[int], seq: int) -> dict[str, Any] | None:
    for r in ranks:
        for e in view.entries.get(r, []):
            if e.get("collective_seq_id") == seq:
                return e
    return None


def _signature(entry: dict[str, Any]) -> tuple[Any, ...]:
    op = _op(entry)
    if op in _RANK_DEPENDENT_SIZES:
        return (
            op,
            tuple(entry.get("input_dtypes") or ()) or tuple(entry.get("output_dtypes") or ()),
        )
    return (
        op,
        json.dumps(entry.get("input_sizes")),
        tuple(entry.get("input_dtypes") or ()),
        json.dumps(entry.get("output_sizes")),
        tuple(entry.get("output_dtypes") or ()),
    )


def _fmt(entry: dict[str, Any]) -> str:
    return (
        f"{_op(entry)} in={entry.get('input_sizes')} {entry.get('input_dtypes')} "
        f"out={entry.get('output_sizes')} {entry.get('output_dtypes')}"
    )


def find_mismatches(view: CommView) -> list[str]:
    """Ranks whose collective at the same sequence number differs (op, sizes or dtypes)."""
    out: list[str] = []
    by_seq: dict[int, dict[int, dict[str, Any]]] = defaultdict(dict)
    for r, entries in view.entries.items():
        for e in entries:
            by_seq[int(e.get("collective_seq_id", 0))][r] = e
    for seq in sorted(by_seq):
        per_rank = by_seq[seq]
        groups: dict[tuple[Any, ...], list[int]] = defaultdict(list)
        for r, e in sorted(per_rank.items()):
            groups[_signature(e)].append(r)
        if len(groups) > 1:
            desc = " vs ".join(f"{_plural(rs)}: {_fmt(per_rank[rs[0]])}" for rs in groups.values())
            out.append(f"#{seq}: {desc}")
    return out


def chrome_trace(dumps: Sequence[Dump]) -> dict[str, Any]:
    """A Chrome/Perfetto trace: process = rank, thread = communicator, slice = op."""
    events: list[dict[str, Any]] = []
    tids: dict[str, int] = {}
    t0 = min(
        (e["time_created_ns"] for d in dumps for e in d.data.get("entries") or []),
        default=0,
    )
    for dump in dumps:
        events.append(
            {
                "ph": "M",
                "name": "process_name",
                "pid": dump.rank,
                "args": {"name": f"rank {dump.rank}"},
            }
        )
        events.append(
            {
                "ph": "M",
                "name": "process_sort_index",
                "pid": dump.rank,
                "args": {"sort_index": dump.rank},
            }
        )
        end_default = dump.dump_time_ns
        for e in dump.data.get("entries") or []:
            comm = e["process_group"][0]
            tid = tids.setdefault(comm, len(tids) + 1)
            start = e.get("time_discovered_started_ns") or e["time_created_ns"]
            end = e.get("time_discovered_completed_ns") or end_default or start
            seq = e.get("p2p_seq_id") if e.get("is_p2p") else e.get("collective_seq_id")
            name = f"{str(e.get('profiling_name', '?')).split(':', 1)[-1]} #{seq}"
            if e.get("state") != "completed":
                name += " (unfinished)"
            elif e.get("error"):
                name += " (failed)"
            events.append(
                {
                    "ph": "X",
                    "name": name,
                    "cat": comm,
                    "pid": dump.rank,
                    "tid": tid,
                    "ts": (start - t0) / 1e3,
                    "dur": max(end - start, 0) / 1e3,
                    "args": {
                        "op_id": e.get("op_id"),
                        "state": e.get("state"),
                        "queued_ms": (start - e["time_created_ns"]) / 1e6,
                        "input_sizes": e.get("input_sizes"),
                        "input_dtypes": e.get("input_dtypes"),
                        "output_sizes": e.get("output_sizes"),
                        "error": e.get("error"),
                    },
                }
            )
    for dump in dumps:
        for comm, tid in tids.items():
            events.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": dump.rank,
                    "tid": tid,
                    "args": {"name": comm},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def report(dumps: Sequence[Dump]) -> tuple[str, bool]:
    by_rank = {d.rank: d for d in dumps}
    lines = [f"{len(dumps)} dumps: {_plural(by_rank)}"]
    problem = False
    for view in comm_views(dumps):
        comm_lines, comm_problem = analyze_comm(view, by_rank)
        lines.extend(comm_lines)
        problem = problem or comm_problem
    lines.append("problems found" if problem else "no problems found")
    return "\n".join(lines), problem


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchcomms.tools.fr",
        description="Summarize torchcomms flight-recorder dumps (one file per rank).",
    )
    parser.add_argument("dir", help="directory with the per-rank dumps")
    parser.add_argument("--trace", metavar="OUT.json", help="write a Chrome/Perfetto trace")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.dir):
        print(f"error: {args.dir} is not a directory", file=sys.stderr)
        return 2
    dumps, refused = scan_dir(args.dir)
    for error in refused:
        print(f"error: {error}", file=sys.stderr)
    if not dumps:
        print(f"error: no flight-recorder dumps found in {args.dir}", file=sys.stderr)
        return 2
    text, problem = report(dumps)
    print(text)
    if args.trace:
        with open(args.trace, "w") as f:
            json.dump(chrome_trace(dumps), f)
        print(f"trace written to {args.trace} (open in https://ui.perfetto.dev)")
    return 1 if problem or refused else 0


if __name__ == "__main__":
    sys.exit(main())
