"""HSDP on torchcomms with torchft: 2 replica groups x 2 ranks, one rank SIGKILLed mid-run.

Each group shards the model with FSDP2 over a store-less communicator of its own; the
gradient shards are averaged across the groups by torchft's ``Manager`` over
``ProcessGroupTorchComms`` (``tests/torchft_hsdp_rank.py``).  Group 1's rank 1 is SIGKILLed
and the test, as torchrun's agent would, stops the rest of that group; group 0 goes on
committing alone (a quorum of one), then group 1 is restarted, rejoins (two participants
again) and heals: from then on each rank holds the same parameter shard as the same rank of
group 0 at every step.  Behind ``-m slow`` (about 30 s: six processes start FSDP on two
cores).
"""

from __future__ import annotations

import os
import socket
import sys

import pytest
from torch.distributed import TCPStore

from tests.torchft_jobs import REPO, Proc, commits, start_lighthouse, until

pytest.importorskip("torchft.torchcomms", reason="torchft is not installed (see the README)")

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_hsdp_group_rank_killed_rejoins_and_heals() -> None:
    ctrl = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    lighthouse, address = start_lighthouse(min_replicas=1, join_timeout_ms=2000)
    procs = [lighthouse]
    try:
        env = dict(
            os.environ,
            TORCHFT_LIGHTHOUSE=address,
            PYTHONPATH=str(REPO),
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS="1",
        )

        def start_group(group: int) -> list[Proc]:
            port = _free_port()
            return [
                Proc(
                    f"g{group}r{r}",
                    [
                        sys.executable,
                        "-m",
                        "tests.torchft_hsdp_rank",
                        str(group),
                        str(r),
                        str(port),
                        str(ctrl.port),
                    ],
                    env,
                )
                for r in (0, 1)
            ]

        g0, g1 = start_group(0), start_group(1)
        procs += g0 + g1
        until(
            "3 commits of both groups on every rank",
            lambda: all(len(commits(p, 2)) >= 3 for p in g0 + g1),
            120,
            procs,
        )
        killed_at = max(s["step"] for p in g0 + g1 for s in p.steps())
        g1[1].kill()
        # As torchrun's agent does when one of its workers dies: the group's other rank goes too
        # (torchft counts a replica group alive while its rank 0, which serves its manager,
        # heartbeats).
        g1[0].kill()
        until(
            "3 commits of group 0 alone",
            lambda: all(len(commits(p, 1, killed_at)) >= 3 for p in g0),
            60,
            procs,
        )
        back = max(s["step"] for p in g0 for s in p.steps())
        g1b = start_group(1)
        procs += g1b
        until(
            "group 1 rejoined: 3 commits of both groups",
            lambda: all(len(commits(p, 2, back)) >= 3 for p in g0 + g1b),
            120,
            procs,
        )
        ctrl.set("stop", str(max(s["step"] for p in g0 + g1b for s in p.steps()) + 2))
        for p in g0 + g1b:
            p.proc.wait(60)
            assert p.proc.returncode == 0, (p.name, p.lines[-30:])
    finally:
        for p in procs:
            p.kill()
    # After the rejoin, rank r of group 1 holds rank r of group 0's shard at every step.
    for r in (0, 1):
        ours = {s["step"]: s["shard"] for s in g0[r].steps() if s["commit"] and s["n"] == 2}
        theirs = {s["step"]: s["shard"] for s in g1b[r].steps() if s["commit"]}
        shared = sorted(set(ours) & set(theirs))
        assert len(shared) >= 3, (r, ours, theirs)
        assert all(ours[k] == theirs[k] for k in shared), (r, ours, theirs)
        first = min(theirs)
        assert first > back - 1, (r, first, back)  # healed to the survivors' step
