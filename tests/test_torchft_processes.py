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

Streaming DiLoCo's upscale and commit failure (torchft's ``test_streaming_diloco_upscale`` /
``_commit_failure``, its model, optimizers, ``sync_every=4`` and four of its (fragments, sync
delay, alpha) configurations) with replicas as processes (``tests/torchft_streaming_replica.py``,
lighthouse and Managers at ``min_replicas=2``): for upscale r1 and r2 commit steps 0 and 1,
pause at step 2 until r0 (started then) begins, and r0 heals and commits with three; for
commit failure both replicas' all_reduce at step 1 fails (the injected error reaches the
Manager through the op's ``wait``), the step does not commit on either and is retried.  As
in torchft, the replicas' global state (every fragment's global weights and outer momentum)
is equal at every step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
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


# -- Streaming DiLoCo: upscale and commit failure, replicas as processes ---------------------------
#: torchft's CONFIG for these scenarios is fragments 1-2 x sync delay 0-1 x alpha 0 / 0.5 / 1;
#: these four take every value of each (the threads' version, test_torchft_modes, runs all 12).
STREAMING = [(1, 0, 0.0), (1, 1, 0.5), (2, 0, 1.0), (2, 1, 0.5)]


def _tagged(proc: Proc, tag: str) -> list[dict[str, Any]]:
    """The ``TAG {json}`` lines the process printed so far."""
    n = len(tag) + 1
    return [json.loads(line[n:]) for line in list(proc.lines) if line.startswith(tag + " ")]


def _good(proc: Proc, n: int) -> list[dict[str, Any]]:
    return [c for c in _tagged(proc, "COMMIT") if c["commit"] and c["n"] == n]


def _assert_equal_global_state(a: Proc, b: Proc, steps: set[int] | None = None) -> int:
    """torchft's ``assert_equal_global_state``: at every step of ``a`` (or ``steps``), ``b``
    holds the same global weights and outer momentum in every fragment; returns the count."""
    by_a = {r["step"]: r["state"] for r in _tagged(a, "STATE")}
    by_b = {r["step"]: r["state"] for r in _tagged(b, "STATE")}
    compared = 0
    for step in sorted(by_a if steps is None else steps):
        assert step in by_b, (a.name, b.name, step, sorted(by_b))
        for frag, state in by_a[step].items():
            other = by_b[step][frag]
            for name, value in state["params"].items():
                torch.testing.assert_close(
                    torch.tensor(other["params"][name]),
                    torch.tensor(value),
                    rtol=1e-6,
                    atol=1e-7,
                    msg=lambda m, s=step, f=frag, k=name: f"{a.name}/{b.name} {s=} {f=} {k}: {m}",
                )
            assert [m is None for m in state["momentum"]] == [
                m is None for m in other["momentum"]
            ], (step, frag)
            for mine, theirs in zip(state["momentum"], other["momentum"], strict=True):
                if mine is not None:
                    torch.testing.assert_close(
                        torch.tensor(theirs), torch.tensor(mine), rtol=1e-6, atol=1e-7
                    )
        compared += 1
    return compared


def _streaming_job(
    scenario: str, config: tuple[int, int, float]
) -> tuple[TCPStore, list[Proc], Any]:
    ctrl = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    lighthouse, address = start_lighthouse(min_replicas=2, join_timeout_ms=1000)
    env = dict(os.environ)
    env.update(
        TORCHFT_LIGHTHOUSE=address,
        TORCHCOMM_ABORT_ON_ERROR="0",
        PYTHONPATH=str(REPO),
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
    )
    procs = [lighthouse]

    def start(rid: str) -> Proc:
        fragments, delay, alpha = config
        argv = [sys.executable, "-m", "tests.torchft_streaming_replica", scenario, rid]
        argv += [str(fragments), str(delay), str(alpha), str(ctrl.port)]
        proc = Proc(rid, argv, env)
        procs.append(proc)
        return proc

    return ctrl, procs, start


def _stop_all(ctrl: TCPStore, replicas: list[Proc], procs: list[Proc]) -> None:
    """Stop every replica at one step past the furthest and check they exit 0."""
    last = max(c["after"] for p in replicas for c in _tagged(p, "COMMIT"))
    ctrl.set("stop", str(last + 1))
    for p in replicas:
        try:
            p.proc.wait(40)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{p.name} did not stop: " + "\n".join(p.lines[-30:])) from None
        assert p.proc.returncode == 0, (p.name, p.lines[-30:])


@pytest.mark.parametrize("config", STREAMING, ids=[f"f{f}_d{d}_a{a}" for f, d, a in STREAMING])
def test_streaming_diloco_upscale(config: tuple[int, int, float]) -> None:
    """torchft's upscale: r1 and r2 train, r0 joins after their step 2 and heals."""
    ctrl, procs, start = _streaming_job("upscale", config)
    try:
        r1, r2 = start("r1"), start("r2")
        until(
            "r1 and r2 at step 2",
            lambda: all(any(x.startswith("PAUSE") for x in p.lines) for p in (r1, r2)),
            60,
            procs,
        )
        early = {p.name: _tagged(p, "COMMIT") for p in (r1, r2)}
        r0 = start("r0")
        until(
            "r0 healed and 2 commits of 3",
            lambda: all(len(_good(p, 3)) >= 2 for p in (r0, r1, r2)),
            60,
            procs,
        )
        _stop_all(ctrl, [r0, r1, r2], procs)
    finally:
        for p in procs:
            p.kill()
    # Before r0 came, r1 and r2 committed steps 0 and 1 as a quorum of two, then paused once.
    for name, done in early.items():
        assert [(c["step"], c["commit"], c["n"]) for c in done] == [(0, True, 2), (1, True, 2)], (
            name,
            done,
        )
    for p in (r1, r2):
        assert sum(x.startswith("PAUSE") for x in p.lines) == 1, p.lines[-20:]
    # r0 started at step 0, healed from them (state and step), then committed with three.
    assert any("healing required" in x for x in r0.lines), r0.lines[-40:]
    assert any("Loaded state dict" in x for x in r0.lines), r0.lines[-40:]
    first = _good(r0, 3)[0]
    assert first["step"] >= 2, first
    assert all(c["n"] == 3 for c in _tagged(r0, "COMMIT") if c["commit"]), _tagged(r0, "COMMIT")
    # torchft's check: r0's global state equals r1's and r2's at every step r0 saw; r1's r2's.
    assert _assert_equal_global_state(r0, r1) >= 3
    assert _assert_equal_global_state(r0, r2) >= 3
    assert _assert_equal_global_state(r1, r2) >= 5
    states = {r["step"]: r["state"] for r in _tagged(r0, "STATE")}
    assert states[max(states)] != states[0], "training did not move the global weights"


@pytest.mark.parametrize("config", STREAMING, ids=[f"f{f}_d{d}_a{a}" for f, d, a in STREAMING])
def test_streaming_diloco_commit_failure(config: tuple[int, int, float]) -> None:
    """torchft's commit failure: both replicas' all_reduce fails at step 1; they retry it."""
    ctrl, procs, start = _streaming_job("commit_failure", config)
    try:
        r0, r1 = start("r0"), start("r1")
        until(
            "3 commits of 2 after the failed one",
            lambda: all(len([c for c in _good(p, 2) if c["step"] >= 1]) >= 3 for p in (r0, r1)),
            60,
            procs,
        )
        _stop_all(ctrl, [r0, r1], procs)
    finally:
        for p in procs:
            p.kill()
    for p in (r0, r1):
        assert sum(x.startswith("INJECTED") for x in p.lines) == 1, p.lines[-20:]
        verdicts = [(c["step"], c["commit"]) for c in _tagged(p, "COMMIT")]
        # step 0 commits, step 1 fails (the injected all_reduce error), is retried and commits
        assert verdicts[:3] == [(0, True), (1, False), (1, True)], (p.name, verdicts)
        assert all(ok for _, ok in verdicts[3:]), (p.name, verdicts)
        # the Manager saw the op's error, with its cause
        assert any("injected allreduce error" in x for x in p.lines), p.lines[-40:]
    assert _assert_equal_global_state(r0, r1) >= 4
