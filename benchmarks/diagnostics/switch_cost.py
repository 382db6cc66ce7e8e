"""What a context switch between two torch processes on one core costs the next op.

    python benchmarks/diagnostics/switch_cost.py [--rounds 3000] [--json OUT]

Each process times the same work, two sync 8-byte all_reduces on its own 1-rank shm
communicator (what a rank of a 2-rank ping-pong runs between hand-overs), and then calls
``sched_yield``.  Three set-ups, every process pinned to CPU 0:

* ``alone``: one process; its yield returns at once, so every round starts warm;
* ``beside a tiny process``: a second process that only yields (a small working set):
  every round starts right after a switch, but little else ran;
* ``beside a torch process``: a second process that runs the same work: every round
  starts after the other process's work went through the same core's caches.

The p50 work time of each set-up tells a switch's own cost from the cost of a partner that
runs torch in between.  It answers why ranks that share a core hand over slowly (issue 15).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

WORKER_ENV = "SWITCH_COST_ROLE"


def worker(role: str, rounds: int) -> None:
    os.sched_setaffinity(0, {0})
    if role == "tiny":
        end = time.monotonic() + float(os.environ["SWITCH_COST_SECONDS"])
        while time.monotonic() < end:
            os.sched_yield()
        return
    import torch

    import torchcomms
    from torchcomms import ReduceOp

    os.environ.update(TORCHCOMM_RANK="0", TORCHCOMM_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = "0"
    torch.set_num_threads(1)
    comm = torchcomms.new_comm("gloo", torch.device("cpu"), name=f"switch{os.getpid()}")
    t = torch.ones(2)
    op = ReduceOp.SUM
    times = []
    for i in range(rounds + 200):
        t0 = time.perf_counter()
        comm.all_reduce(t, op, False)
        comm.all_reduce(t, op, False)
        if i >= 200:
            times.append(time.perf_counter() - t0)
        os.sched_yield()
    comm.finalize()
    times.sort()
    print(
        json.dumps(
            {"p50_us": times[len(times) // 2] * 1e6, "p90_us": times[len(times) * 9 // 10] * 1e6}
        )
    )


def _worker(role: str, rounds: int) -> subprocess.Popen[str]:
    env = {**os.environ, WORKER_ENV: role, "SWITCH_COST_SECONDS": "15"}
    argv = [sys.executable, __file__, "--rounds", str(rounds)]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)


def run(partner: str | None, rounds: int) -> dict[str, float]:
    """The measured process's percentiles, beside ``partner`` (None, "tiny" or "torch")."""
    measured = _worker("torch", rounds)
    other = _worker(partner, rounds) if partner is not None else None
    out: dict[str, float] = json.loads(measured.communicate()[0].strip().splitlines()[-1])
    if other is not None:
        if partner == "tiny":  # it yields until killed
            other.kill()
        other.communicate()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    role = os.environ.get(WORKER_ENV)
    if role:
        worker(role, args.rounds)
        return
    results = {}
    for label, partner in (
        ("alone", None),
        ("beside a tiny process", "tiny"),
        ("beside a torch process", "torch"),
    ):
        results[label] = run(partner, args.rounds)
        r = results[label]
        print(f"{label:26s} two all_reduces: p50 {r['p50_us']:6.1f} us, p90 {r['p90_us']:6.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "command": " ".join(["python", *sys.argv]),
                    "results": results,
                    "machine": os.uname().release,
                    "cpus": os.cpu_count(),
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
