"""The kill loop: from 4 ranks down to 1, one SIGKILL per round, shrink and go on.

Runs ``benchmarks/diagnostics/recovery_times.py`` (real forked ranks, a store in its own
process) and asserts what it counted: no hang, no wrong result, every survivor of every
round reported a recovery, and every survivor's failed op raised ``PeerFailureError``.
The times it measures are the diagnostic's business, not the test's.  One trial per
placement by default; ``-m chaos`` runs 10 per placement.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import timeout_scale

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "diagnostics" / "recovery_times.py"


def _kill_loop(tmp_path: Path, trials: int, placements: str) -> dict[str, dict[str, object]]:
    out = tmp_path / "recovery.json"
    cmd = [sys.executable, str(SCRIPT), "--trials", str(trials), "--placements", placements]
    cmd += ["--json", str(out)]
    proc = subprocess.run(
        cmd,
        cwd=SCRIPT.parent,
        capture_output=True,
        text=True,
        timeout=(60 + 60 * trials * len(placements.split(","))) * timeout_scale(),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows: dict[str, dict[str, object]] = json.loads(out.read_text())["results"]
    for placement, row in rows.items():
        assert row["hangs"] == 0 and row["wrong"] == 0, (placement, row)
        assert row["missing_reports"] == 0, (placement, row, proc.stderr[-3000:])
        assert row["errors_seen"] == {"PeerFailureError": 6 * trials}, (placement, row)
    return rows


def test_kill_loop_once(tmp_path: Path) -> None:
    _kill_loop(tmp_path, 1, "shm,tcp")


@pytest.mark.chaos
def test_kill_loop_every_placement(tmp_path: Path) -> None:
    _kill_loop(tmp_path, 10, "shm,tcp,tcp-hosts,hier")
