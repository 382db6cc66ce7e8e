"""Faults tested as faults: mismatched calls, killed and stopped peers, on shm and tcp.

Each trial asserts that the fault fired, that every survivor raised the right error type
naming exactly the right ranks within its bound, and that no op returned success with a
wrong result.  The bounds are the issue's (2 s for a dead peer; timeout + 1 s for a
silent one) plus a margin for a loaded 2-core box; they guard against hangs, they are
not measurements (``benchmarks/diagnostics/detection_times.py`` measures).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.chaos import faults
from tests.harness import RankFailure, run_ranks

TRANSPORTS = ("shm", "tcp")
DEAD_BOUND_S = 2.0 + 1.0
TIMEOUT_S = 2.0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_rank_names_a_mismatch_before_data_is_combined(transport: str) -> None:
    world = 3
    results = run_ranks(faults.mismatches, world, transport, timeout=240)
    for key, field in faults.MISMATCH_FIELDS.items():
        for rank, seen in enumerate(results):
            got = seen[key]
            assert got["type"] == "CollectiveMismatchError", (transport, key, rank, got)
            assert f"rank 1 passed {field}" in got["text"], (transport, key, rank, got)
            assert "ranks 0, 2 " in got["text"], (transport, key, rank, got)
            assert got.get("unchanged", True), (transport, key, rank, "data combined")
            assert got["s"] < 10, (transport, key, rank, got)
            poisoned = got["poisoned"]
            assert poisoned["type"] == "CollectiveMismatchError", (key, rank, poisoned)
            assert "earlier failure" in poisoned["text"], (key, rank, poisoned)


#: (transport, simulated host of each rank): one host; every rank on its own host (the
#: dead rank's non-neighbours learn through the side-connection ring); two hosts of two
#: (hierarchical: shm inside, gloo between).
PLACEMENTS = {
    "shm": ("shm", ()),
    "tcp": ("tcp", ()),
    "tcp-4hosts": ("tcp", (0, 1, 2, 3)),
    "hier-2x2": ("auto", (0, 0, 1, 1)),
}


@pytest.mark.parametrize("position", ("before", "during"))
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_every_survivor_names_exactly_the_killed_rank(
    placement: str, position: str, tmp_path: Path
) -> None:
    world = 4
    transport, hosts = PLACEMENTS[placement]
    with pytest.raises(RankFailure) as info:
        run_ranks(
            faults.killed,
            world,
            transport,
            position,
            str(tmp_path),
            hosts,
            timeout=120,
        )
    failure = info.value
    assert set(failure.died) == {1} and "SIGKILL" in failure.died[1], str(failure)
    assert not failure.timed_out and not failure.errors, str(failure)
    for rank in (0, 2, 3):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for what in ("all_reduce", "barrier"):
            got = seen[what]
            assert got["type"] == "PeerFailureError", (transport, position, rank, what, got)
            assert "peer rank 1 died" in got["text"], (rank, what, got)
            for live in (0, 2, 3):
                assert f"peer rank {live} " not in got["text"], (rank, what, got)
            assert got["s"] < DEAD_BOUND_S, (transport, position, rank, what, got)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_stopped_rank_is_named_by_the_timeout(transport: str) -> None:
    r0, r1, _ = run_ranks(faults.stopped, 3, transport, TIMEOUT_S, timeout=120)
    for rank, seen in enumerate((r0, r1)):
        got = seen["all_reduce"]
        assert got["type"] == "CommTimeoutError", (transport, rank, got)
        assert "peer rank 2" in got["text"], (transport, rank, got)
        assert "peer rank 0" not in got["text"] and "peer rank 1" not in got["text"], got
        if transport == "tcp":  # the census (cpu.tcp.census) heard nothing from it
            assert "peer rank 2 did not answer: stopped or cut off" in got["text"], got
        assert TIMEOUT_S <= got["s"] < TIMEOUT_S + 1.0 + 1.0, (transport, rank, got)


#: Where rank 1 dies inside new_comm: right after its identity is out (it counted itself
#: in, ``cpu.hier.leaders``: the others learn its pid), inside the shm set-up, inside gloo's
#: connect.
BIRTH_DEATHS = {
    "shm-after-identity": ("shm", "host/arrived"),
    "shm-mapping": ("shm", "shm/mapped/1"),
    "tcp-after-identity": ("tcp", "host/arrived"),
    "tcp-gloo-connect": ("tcp", "gloo/"),
}


@pytest.mark.parametrize("case", BIRTH_DEATHS)
def test_a_rank_killed_during_new_comm_is_named(case: str, tmp_path: Path) -> None:
    """The others raise PeerFailureError naming it within the liveness bound (they know its
    pid), never a raw store error after the full timeout, never naming a live rank."""
    transport, trigger = BIRTH_DEATHS[case]
    with pytest.raises(RankFailure) as info:
        run_ranks(
            faults.killed_in_new_comm,
            3,
            transport,
            trigger,
            str(tmp_path),
            timeout=120,
        )
    assert set(info.value.died) == {1}, str(info.value)
    for rank in (0, 2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())["new_comm"]
        assert got["type"] == "PeerFailureError", (case, rank, got)
        assert re.search(r"\bpeer rank 1 died\b", got["text"]), (case, rank, got)
        assert not re.search(r"\branks? (\d+, )*[02]\b", got["text"]), (case, rank, got)
        assert got["s"] < DEAD_BOUND_S, (case, rank, got)
