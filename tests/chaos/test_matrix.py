"""The long fault matrix (``-m chaos``): faults x ops x placements x worlds x positions.

Faults: SIGKILL and SIGSTOP of the last rank, its TCP connections shut down while it
lives (tcp and hierarchical), a slow last rank (late by half the timeout: must succeed),
a mismatched size, a skipped op.  Ops:
all_reduce, broadcast, all_gather, reduce_scatter, all_to_all, send/recv (a ring) and
barrier.  Placements: one host over shm, one host over tcp, two ranks per simulated
host (hierarchical).  Worlds 2-4.  Positions: the fault before the op or while the
others wait in it.  Every trial asserts the error type and the exact ranks named, the
bound, and that nothing returned success with a wrong result.  The default run has a
subset (``test_faults.py``); this takes about half an hour on 2 cores.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.chaos import matrix
from tests.harness import RankFailure, run_ranks

OPS = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "send_recv",
    "barrier",
)
DEAD_BOUND_S = 3.0


#: Ops that run on the tcp path's ring past the inline limit (``cpu.tcp.ring_ops``).
RING_OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter")


def _cases() -> list[tuple[str, str, str, int, str, int]]:
    cases = []
    for fault in ("kill", "stop", "closed", "slow", "mismatch", "skipped"):
        for op in OPS:
            if fault == "closed" and op == "barrier":
                continue  # the same exchange as a small all_reduce
            if fault == "mismatch" and op in ("send_recv", "barrier"):
                continue  # p2p sizes are not fingerprinted; a barrier has no size
            if fault == "skipped" and op == "send_recv":
                continue  # a skipped point-to-point op is a timeout, covered by "stop"
            for placement in matrix.PLACEMENTS:
                if fault == "closed" and placement == "shm":
                    continue  # shm moves no byte through a socket
                for world in (2, 3, 4):
                    if placement == "hier" and world == 2:
                        continue  # two ranks on one simulated host: that is shm
                    timed = fault in ("kill", "stop", "closed")
                    positions = ("before", "during") if timed else ("before",)
                    for position in positions:
                        cases.append((fault, op, placement, world, position, matrix.N))
    # The same faults inside the ring ops (256 KiB per rank), where the ring runs.
    for fault in ("kill", "stop", "closed", "mismatch"):
        for op in RING_OPS:
            for placement in ("tcp", "hier"):
                for world in (3, 4):
                    position = "before" if fault == "mismatch" else "during"
                    cases.append((fault, op, placement, world, position, matrix.LARGE))
        # two ranks' large all_to_all: one exchange on the lane (``RingOps.all_to_all_pair``);
        # two ranks' large broadcast: the receiver's close goes out before the data arrives
        position = "before" if fault == "mismatch" else "during"
        cases.append((fault, "all_to_all", "tcp", 2, position, matrix.LARGE))
        cases.append((fault, "broadcast", "tcp", 2, position, matrix.LARGE))
    return cases


def _names_only(text: str, victim: int, world: int) -> bool:
    others = [r for r in range(world) if r != victim]
    return bool(re.search(rf"\brank {victim}\b", text)) and not any(
        re.search(rf"\branks? (\d+, )*{r}\b", text) for r in others
    )


@pytest.mark.chaos
@pytest.mark.parametrize(("fault", "op", "placement", "world", "position", "n"), _cases())
def test_matrix(
    fault: str, op: str, placement: str, world: int, position: str, n: int, tmp_path: Path
) -> None:
    victim = world - 1
    args = (fault, op, placement, position, str(tmp_path), n)
    if fault == "kill":
        with pytest.raises(RankFailure) as info:
            run_ranks(matrix.trial, world, *args, timeout=120, fresh=True)
        assert set(info.value.died) == {victim}, str(info.value)
        assert not info.value.timed_out, str(info.value)
    else:
        # Stopped or cut-off victims leave their worker unusable: fresh processes.
        run_ranks(matrix.trial, world, *args, timeout=120, fresh=fault in ("stop", "closed"))
    survivors_only = fault in ("kill", "stop", "closed")
    ranks = [r for r in range(world) if r != victim] if survivors_only else range(world)
    if fault == "closed":
        # The victim may even finish (its peers' bytes had arrived): never with wrong data.
        mine = json.loads((tmp_path / f"rank{victim}.json").read_text())["op"]
        assert not mine.get("wrong"), (op, placement, mine)
    for rank in ranks:
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        got = seen["op"]
        if got["type"] is None and fault != "slow" and matrix.posts(op, placement, world, rank):
            got = seen["next"]  # it learns at its next op, which must fail as this one would
        where = (fault, op, placement, world, position, rank, got)
        assert not got.get("wrong"), where  # never success with wrong data
        if op == "send_recv" and got["type"] is None and rank != 0:
            continue  # ring p2p not involving the victim's send may finish, correctly
        if fault == "kill":
            assert got["type"] == "PeerFailureError", where
            assert f"peer rank {victim} died" in got["text"], where
            assert _names_only(got["text"], victim, world), where
            assert got["s"] < DEAD_BOUND_S, where
        elif fault == "slow":
            assert got["type"] is None, where  # late is not failed
        elif fault == "closed":
            assert got["type"] in ("PeerFailureError", "CommTimeoutError"), where
            assert _names_only(got["text"], victim, world), where
            assert got["s"] < matrix.OP_TIMEOUT_S + 2.0, where
        elif fault == "stop":
            assert got["type"] == "CommTimeoutError", where
            assert _names_only(got["text"], victim, world), where
            assert got["s"] < matrix.OP_TIMEOUT_S + 2.0, where
        else:
            assert got["type"] == "CollectiveMismatchError", where
            assert f"rank {victim} passed" in got["text"], where
