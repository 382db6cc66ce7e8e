"""torchft's training modes with replicas as separate processes: one is killed and heals.

Per mode (``ddp``: torchft's ``DistributedDataParallel`` + ``OptimizerWrapper``;
``localsgd``: ``LocalSGD``, sync every 2 steps; ``diloco``: ``DiLoCo`` with one fragment,
sync every 2 steps, ``fragment_sync_delay=0``, ``fragment_update_alpha=0``), torchft's
lighthouse and two replica processes (``tests/torchft_mode_replica.py``), each a torchft
``Manager`` over ``ProcessGroupTorchComms(new_comm("gloo", ..., enable_reconfigure=True))``.
Once both committed steps together, r1 is SIGKILLed.  The lighthouse and the Managers run
with ``min_replicas=1``: the survivor's failed step does not commit, and after the
lighthouse's join timeout it goes on committing alone (a quorum of one), which shows the
kill really shrank the job; with 2 it would only wait.  r1 is restarted: it joins at step 0,
heals from r0 (weights, optimizer state and, for DiLoCo, the global weights and outer
optimizer) and commits with 2 participants at a step past the one it was killed at.  Both
are stopped at the same step through the control store and must exit 0.

What torchft guarantees, and what is asserted: a step that committed with both replicas
applied the same average (of the gradients for ddp, of the weights for localsgd, of the
pseudo-gradients through the outer optimizer for diloco, whose merge with alpha 0 leaves the
model at the global weights) to the same state, so at every step both replicas committed
with 2 participants (the healed r1's included) their parameter digests are equal.  For
localsgd / diloco a STEP line is printed only at a synchronisation (the Manager's step
counts synchronisations), so those are exactly the steps right after a sync; between
syncs the replicas train apart by design.  The weights change between committed steps,
so equal digests are not equal by accident.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
from torch.distributed import TCPStore

from tests.torchft_jobs import REPO, Proc, commits, start_lighthouse, until

pytestmark = pytest.mark.slow

pytest.importorskip(
    "torchft.torchcomms",
    reason="torchft is not installed (pip install --no-deps torchft-nightly, see the README)",
)


@pytest.mark.parametrize("mode", ["ddp", "localsgd", "diloco"])
def test_mode_replica_killed_and_healed(mode: str) -> None:
    began = time.monotonic()
    ctrl = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    lighthouse, address = start_lighthouse(min_replicas=1, join_timeout_ms=1000)
    procs = [lighthouse]
    try:
        env = dict(os.environ)
        env.update(
            TORCHFT_LIGHTHOUSE=address,
            TORCHCOMM_ABORT_ON_ERROR="0",
            PYTHONPATH=str(REPO),
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS="1",
        )

        def start(rid: str) -> Proc:
            argv = [sys.executable, "-m", "tests.torchft_mode_replica", mode, rid]
            return Proc(rid, [*argv, str(ctrl.port)], env)

        r0, r1 = start("r0"), start("r1")
        procs += [r0, r1]
        until(
            "3 commits of 2 replicas",
            lambda: all(len(commits(p, 2)) >= 3 for p in (r0, r1)),
            60,
            procs,
        )

        r1.kill()
        killed_at = max(s["step"] for s in r1.steps())
        until("r0 committing alone", lambda: len(commits(r0, 1, killed_at)) >= 2, 40, procs)

        r1b = start("r1")
        procs.append(r1b)
        until(
            "the restarted r1 healed and 3 commits of 2",
            lambda: len(commits(r1b, 2)) >= 3 and len(commits(r0, 2, killed_at)) >= 3,
            60,
            procs,
        )
        ctrl.set("stop", str(max(s["step"] for s in r0.steps()) + 2))
        for p in (r0, r1b):
            p.proc.wait(30)
            assert p.proc.returncode == 0, (p.name, p.lines[-30:])
    finally:
        for p in procs:
            p.kill()
    elapsed = time.monotonic() - began

    # The kill: r0's step at the kill did not commit with 2, then it committed alone.
    alone = commits(r0, 1, killed_at)
    assert alone, r0.steps()[-10:]
    # The restart healed: its first line already carries a step past the kill.
    first = r1b.steps()[0]
    healed = commits(r1b, 2)[0]
    assert first["step"] > killed_at and healed["step"] > killed_at, (first, healed, killed_at)
    assert healed["step"] > alone[-1]["step"], (healed, alone[-1])
    assert any("healing required" in line for line in r1b.lines), r1b.lines[-40:]
    assert any("Loaded state dict" in line for line in r1b.lines), r1b.lines[-40:]

    # At every step both committed with 2 participants, the same parameters.
    by_r0 = {s["step"]: s["digest"] for s in commits(r0, 2)}
    both = 0
    for life in (r1, r1b):
        for s in commits(life, 2):
            assert s["step"] in by_r0, (life.name, s, sorted(by_r0))
            assert s["digest"] == by_r0[s["step"]], (mode, life.name, s, by_r0[s["step"]])
            both += 1
    after_heal = commits(r1b, 2)
    assert len(after_heal) >= 3 and both >= 6, (both, after_heal)
    # r0's committed steps of 2 after the heal are all r1b's too (none committed alone).
    r1b_steps = {s["step"] for s in after_heal}
    assert {s for s in by_r0 if s >= healed["step"]} <= r1b_steps, (sorted(by_r0), r1b_steps)
    # Training moves the weights: consecutive committed steps differ.
    digests = [s["digest"] for s in after_heal]
    assert len(set(digests)) == len(digests), digests
    print(
        f"{mode}: killed r1 at step {killed_at}; r0 committed {len(alone)} steps alone; r1 "
        f"healed to step {healed['step']}; {both} steps compared; {elapsed:.1f} s"
    )
