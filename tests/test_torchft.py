"""A real torchft job on our gloo backend: a replica is killed, the others go on, it rejoins.

Three replicas (``tests/torchft_replica.py``), each a torchft ``Manager`` over
``ProcessGroupTorchComms`` wrapping a reconfigurable ``new_comm("gloo", ...)`` of its own,
and torchft's own lighthouse (``torchft_lighthouse``).  The replicas average a gradient every
step.  r2 is SIGKILLed mid-run: r0 and r1 must go on committing with a quorum of two;
r2 is then restarted: it must rejoin (the quorum grows back to three) and heal (take the
survivors' step and weights).  Every committed step's average is checked against the
participants' values, and the weights of every step against the other replicas'.

Two placements: ``processes`` (one process per replica, as a user runs them; the restarted
replica heals through ``torchcomms.ft.RdmaCheckpointTransport``) and, with ``-m slow``, ``mixed``
(r0 and r1 as threads of one process, torchft's test pattern, and r2 a process of its own):
there the two communicators in one process reconfigure into one group with each other and
with the one in the other process, and after r2's kill into a group of the two threads
(healing through torchft's default HTTP transport).

Needs torchft (``pip install --no-deps torchft-nightly`` and opentelemetry; see the
README); skipped where it cannot be imported.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pytest
from torch.distributed import TCPStore

from tests.torchft_jobs import REPO, Proc, commits, start_lighthouse, until

pytest.importorskip(
    "torchft.torchcomms",
    reason="torchft is not installed (pip install --no-deps torchft-nightly, see the README)",
)

#: The value each replica contributes (its number + 1), beside a one-hot of who it is.
VALUE = {"r0": 1.0, "r1": 2.0, "r2": 3.0}


class _Replica:
    """One replica's view of the process it runs in (several may share one)."""

    def __init__(self, rid: str, proc: Proc) -> None:
        self.name, self.proc = rid, proc

    @property
    def lines(self) -> list[str]:
        return self.proc.lines

    def steps(self) -> list[dict[str, Any]]:
        return [s for s in self.proc.steps() if s["rid"] == self.name]


@pytest.mark.parametrize(
    ("placement", "checkpoint"),
    # mixed with -m slow: replicas as threads of one process reconfiguring into one group and
    # healing over HTTP are torchft's own scenarios in tests/test_torchft_modes.py, a replica
    # process killed and rejoined is the processes cell.
    [("processes", "rdma"), pytest.param("mixed", "http", marks=pytest.mark.slow)],
    ids=["processes-rdma", "mixed-http"],
)
def test_torchft_replica_killed_and_rejoined(placement: str, checkpoint: str) -> None:
    ctrl = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    lighthouse, address = start_lighthouse(min_replicas=2, join_timeout_ms=1000)
    procs = [lighthouse]
    try:
        env = dict(os.environ)
        env.update(
            TORCHFT_LIGHTHOUSE=address,
            TORCHFT_TEST_CHECKPOINT=checkpoint,
            TORCHCOMM_ABORT_ON_ERROR="0",
            PYTHONPATH=str(REPO),
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS="1",
        )

        def start(*rids: str) -> list[_Replica]:
            ids = ",".join(rids)
            argv = [sys.executable, "-m", "tests.torchft_replica", ids, str(ctrl.port)]
            proc = Proc(ids, argv, env)
            procs.append(proc)
            return [_Replica(rid, proc) for rid in rids]

        if placement == "processes":
            (r0,), (r1,) = start("r0"), start("r1")
        else:
            r0, r1 = start("r0", "r1")
        (r2,) = start("r2")
        three = [r0, r1, r2]
        until(
            "3 commits of 3 replicas",
            lambda: all(len(commits(p, 3)) >= 3 for p in three),
            90,
            procs,
        )
        if placement == "mixed":  # r0 and r1 really share a process, r2 is another one
            assert r0.proc is r1.proc and r2.proc is not r0.proc
            assert r0.proc.proc.pid != r2.proc.proc.pid

        # Kill r2: r0 and r1 go on with a quorum of two.
        quorum_before = max(s["quorum"] for s in r0.steps())
        r2.proc.kill()
        killed_at = max(s["step"] for p in (r0, r1) for s in p.steps())
        survivors = [r0, r1]
        until(
            "3 commits of the 2 survivors",
            lambda: all(len(commits(p, 2, killed_at)) >= 3 for p in survivors),
            60,
            procs,
        )

        # Restart r2: it rejoins (a quorum of three again) and heals to the survivors' step.
        back = max(s["step"] for p in survivors for s in p.steps())
        (r2b,) = start("r2")
        until(
            "r2 rejoined and 2 commits of 3",
            lambda: all(len(commits(p, 3, back)) >= 2 for p in (r0, r1, r2b)),
            90,
            procs,
        )
        ctrl.set("stop", str(max(s["step"] for s in r0.steps()) + 2))
        for p in {r.proc for r in (r0, r1, r2b)}:
            p.proc.wait(30)
            assert p.proc.returncode == 0, (p.name, p.lines[-30:])
    finally:
        for p in procs:
            p.kill()

    # Every committed step averaged exactly the participants' values, itself among them.
    by_step: dict[int, set[str]] = {}
    for p in (r0, r1, r2, r2b):
        for s in p.steps():
            if s["commit"]:
                members = s["members"]
                assert len(members) == s["n"] and int(p.name[1]) in members, (p.name, s)
                want = sum(VALUE[f"r{i}"] for i in members) / len(members)
                assert abs(s["avg"] - want) < 1e-6, (p.name, s, want)
                by_step.setdefault(s["step"], set()).add(json.dumps(s["w"]))
    # Replicas agree on the weights at every step (the healed r2 included).
    assert all(len(ws) == 1 for ws in by_step.values()), by_step
    # The quorum shrank after the kill: a later quorum id, two participants, comm size 2.
    after = commits(r0, 2, killed_at)
    assert after and after[0]["quorum"] > quorum_before and after[0]["comm"][1] == 2, after[:2]
    assert all(s["members"] == [0, 1] for s in after), after
    # r2's second life started at step 0 and healed to the survivors' step before committing.
    first = commits(r2b, 3)[0]
    assert first["start_step"] > back - 1 and first["step"] > back, (first, back)
    assert any("healing required" in line for line in r2b.lines), r2b.lines[-40:]
    assert any("Loaded state dict" in line for line in r2b.lines), r2b.lines[-40:]
    if checkpoint == "rdma":
        # It healed through torchcomms.ft.RdmaCheckpointTransport, by cross-memory attach
        # (the replicas share this host), and every leaf arrived bit for bit.
        assert any("through cma" in line for line in r2b.lines), r2b.lines[-40:]
        assert first["healed_extra_ok"] is True, first
    # What happened, for the record (``pytest -s``): the lighthouse's quorum changes and the
    # steps around the kill and the rejoin.
    for line in lighthouse.lines:
        if "quorum_id" in line and "bumping" in line:
            print("lighthouse:", line[-110:])
    before = [s for s in commits(r0, 3) if s["step"] <= killed_at]
    for s in [*before[-1:], *after[:2], *commits(r0, 3, back)[:1], first]:
        print("step:", json.dumps(s))
    heal = [line for line in r2b.lines if "healing required" in line or "Loaded state" in line]
    print("r2 restarted:", *[line[:160] for line in heal[:2]], sep="\n  ")
    print(
        "torchft: killed r2 at step",
        killed_at,
        "; survivors committed",
        len(commits(r0, 2)),
        "steps of 2; r2 healed at step",
        first["start_step"],
    )
