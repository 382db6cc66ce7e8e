"""Streaming DiLoCo on CPU with torchft over torchcomms: a replica is killed and comes back.

    python examples/ft_diloco.py [--steps 12] [--kill-step 4] [--fragments 2] [--pg torchcomms]
                                 [--hidden 16] [--json FILE]

The script is the launcher: it starts torchft's lighthouse and two replica groups (one
process each, as ``torchrun`` would start a group of one), each training the same small
model on its own data with torchft's ``DiLoCo`` (``--fragments`` fragments, synchronised in
turn every ``--sync-every`` inner steps, ``fragment_sync_delay=1``, ``alpha=0.5``: Streaming
DiLoCo) through a ``torchft.Manager`` whose process group is
``ProcessGroupTorchComms(new_comm("gloo", cpu, enable_reconfigure=True))`` (``--pg gloo``:
torchft's own ``ProcessGroupGloo``, for comparison).  When replica 1's outer step reaches
``--kill-step`` the launcher SIGKILLs it; replica 0's next synchronisation waits for a
quorum of two (``min_replicas=2``) while the launcher restarts replica 1, which rejoins at
step 0, heals from replica 0 (its weights, optimizer state and step) and trains on.  At the end
it prints the loss per outer step per replica (``-`` where the replica was not running)
and checks that both replicas finished, that replica 1 healed, and that after the last
outer step both hold the same global weights.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

INNER_LR = 3e-3


class _Proc:
    """A child process whose output lines a reader thread collects."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def records(self) -> list[dict[str, Any]]:
        return [json.loads(x[4:]) for x in list(self.lines) if x.startswith("REC ")]

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


# -- one replica ----------------------------------------------------------------------------------
def _model(fragments: int, hidden: int) -> nn.Sequential:
    torch.manual_seed(0)  # every replica starts from the same weights
    layers: list[nn.Module] = [nn.Linear(8, hidden)]
    layers += [nn.Sequential(nn.Tanh(), nn.Linear(hidden, hidden)) for _ in range(fragments - 2)]
    layers += [nn.Sequential(nn.Tanh(), nn.Linear(hidden, 1))]
    return nn.Sequential(*layers)


def _global_digest(diloco: Any) -> str:
    """A digest of the global weights (what the outer steps agreed on) of every fragment.

    torchft keeps them per fragment (``original_parameters``); the local weights differ
    between replicas by design (``alpha`` mixes local and global).
    """
    h = hashlib.sha1()
    for fragment in diloco._fragments:
        for name in sorted(fragment.original_parameters):
            h.update(fragment.original_parameters[name].numpy().tobytes())
    return h.hexdigest()[:12]


def replica_manager(
    pg_kind: str, replica: int, model: nn.Module, inner: torch.optim.Optimizer, timeout_s: float
) -> tuple[Any, Any, Any]:
    """One replica group of one process: its process group (``torchcomms``:
    ``ProcessGroupTorchComms`` over a reconfigurable ``new_comm("gloo", ...)``; ``gloo``:
    torchft's ``ProcessGroupGloo``) and its torchft ``Manager``, which heals ``model`` and
    ``inner`` (the inner optimizer) from a peer.  Returns (comm or None, pg, manager).
    ``benchmarks/diagnostics/diloco_sync.py`` builds its replicas with it too."""
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    import torchcomms

    torch.set_num_threads(1)
    os.environ.update(TORCHCOMM_RANK="0", TORCHCOMM_SIZE="1", TORCHCOMM_ABORT_ON_ERROR="0")
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=timeout_s)
    comm = None
    if pg_kind == "torchcomms":
        from torchft.torchcomms import ProcessGroupTorchComms

        comm = torchcomms.new_comm(
            "gloo",
            torch.device("cpu"),
            name=f"diloco_{replica}",
            store=store,
            enable_reconfigure=True,
            abort_process_on_timeout_or_error=False,
            timeout=timeout,
        )
        pg: Any = ProcessGroupTorchComms(comm, timeout=timeout)
    else:
        pg = ProcessGroupGloo(timeout=timeout)
    manager = Manager(
        pg=pg,
        min_replica_size=2,
        use_async_quorum=False,
        load_state_dict=lambda sd: (
            model.load_state_dict(sd["model"]),
            inner.load_state_dict(sd["inner"]),
        ),
        state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
        replica_id=f"replica_{replica}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=30),
        connect_timeout=timeout,
    )
    return comm, pg, manager


def replica(args: argparse.Namespace) -> None:
    from torchft.local_sgd import DiLoCo

    model = _model(args.fragments, args.hidden)
    inner = torch.optim.AdamW(model.parameters(), lr=INNER_LR)
    outer = [torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True) for f in model]
    _, pg, manager = replica_manager(args.pg, args.replica, model, inner, 10.0)
    data = torch.Generator().manual_seed(100 + args.replica)  # each replica its own data
    target = torch.linspace(-1, 1, 8)
    losses: list[float] = []
    steps_s: list[float] = []  # every optimizer step of this outer step
    with DiLoCo(
        manager,
        list(model),
        inner,
        outer,
        sync_every=args.sync_every,
        backup_device=torch.device("cpu"),
        fragment_sync_delay=1,
        fragment_update_alpha=0.5,
    ) as diloco:
        while manager.current_step() < args.steps:
            step = manager.current_step()
            x = torch.randn(32, 8, generator=data)
            y = (x * target).sum(dim=1, keepdim=True).tanh()
            loss = nn.functional.mse_loss(model(x), y)
            inner.zero_grad()
            loss.backward()
            start = time.perf_counter()
            inner.step()  # DiLoCo's hook synchronises a fragment every sync_every steps
            steps_s.append(time.perf_counter() - start)
            losses.append(loss.item())
            if manager.current_step() != step:  # an outer step committed
                record = {
                    "replica": args.replica,
                    "step": manager.current_step(),
                    "loss": sum(losses) / len(losses),
                    "participants": manager.num_participants(),
                    "healed": step == 0 and manager.current_step() > 1,
                    "global": _global_digest(diloco),
                    # what the synchronisation added to this outer step's optimizer steps
                    # (quorum, all_reduce of the pseudo-gradients, commit, outer step)
                    "sync_s": sum(steps_s) - len(steps_s) * min(steps_s),
                }
                print("REC " + json.dumps(record), flush=True)
                losses, steps_s = [], []
            time.sleep(args.pause)
    manager.shutdown(wait=False)
    pg.shutdown()


# -- the launcher ---------------------------------------------------------------------------------
def _until(what: str, cond: Any, timeout_s: float, procs: list[_Proc]) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name}:\n" + "\n".join(p.lines[-20:]) for p in procs)
            raise SystemExit(f"timed out after {timeout_s} s waiting for {what}\n{tails}")
        time.sleep(0.05)


def launch(args: argparse.Namespace) -> int:
    binary = Path(sys.executable).with_name("torchft_lighthouse")
    if not binary.exists():
        raise SystemExit("torchft_lighthouse not found beside python: pip install torchft-nightly")
    lighthouse = _Proc(
        "lighthouse",
        [
            str(binary),
            "--bind",
            "[::]:0",
            "--min_replicas",
            "2",
            "--join_timeout_ms",
            "3000",
            "--quorum_tick_ms",
            "50",
            "--heartbeat_timeout_ms",
            "1500",
        ],
        dict(os.environ),
    )
    procs = [lighthouse]
    try:
        _until(
            "the lighthouse", lambda: any("listening on" in x for x in lighthouse.lines), 30, procs
        )
        address = re.search(r"listening on: (http://\S+)", "\n".join(lighthouse.lines))
        assert address is not None
        env = dict(
            os.environ,
            TORCHFT_LIGHTHOUSE=address.group(1),
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS="1",
        )

        def start(i: int) -> _Proc:
            argv = [sys.executable, __file__, "--replica", str(i)]
            for flag in ("steps", "fragments", "sync_every", "pg", "pause", "hidden"):
                argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
            return _Proc(f"replica {i}", argv, env)

        r0, r1 = start(0), start(1)
        procs += [r0, r1]
        lives = [r1]
        killed_at = None
        if args.kill_step > 0:
            _until(
                f"replica 1 at step {args.kill_step}",
                lambda: any(r["step"] >= args.kill_step for r in r1.records()),
                120,
                procs,
            )
            r1.kill()
            killed_at = max(r["step"] for r in r1.records())
            time.sleep(1.0)  # replica 0 waits for a quorum of two again, in its next sync
            lives.append(start(1))
            procs.append(lives[-1])
        for p in (r0, lives[-1]):
            p.proc.wait(180)
            if p.proc.returncode != 0:
                raise SystemExit(
                    f"{p.name} exited with {p.proc.returncode}:\n" + "\n".join(p.lines[-30:])
                )
    finally:
        for p in procs:
            p.kill()
    records = {"r0": r0.records(), "r1": [r for life in lives for r in life.records()]}
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "records": records}))
    return _report(args, records["r0"], records["r1"], killed_at, lives[-1].records())


def _report(
    args: argparse.Namespace,
    r0: list[dict[str, Any]],
    r1: list[dict[str, Any]],
    killed_at: int | None,
    last_life: list[dict[str, Any]],
) -> int:
    by0 = {r["step"]: r for r in r0}
    by1 = {r["step"]: r for r in r1}
    print(f"Streaming DiLoCo over {args.pg}: loss per outer step (mean of its inner steps)")
    print("step  replica 0  replica 1  participants")
    for step in range(1, args.steps + 1):
        cells = [f"{by[step]['loss']:9.5f}" if step in by else "        -" for by in (by0, by1)]
        n = max((by[step]["participants"] for by in (by0, by1) if step in by), default=0)
        print(f"{step:4d}  {cells[0]}  {cells[1]}  {n:12d}")
    joined = last_life[0]["step"] if last_life else None
    problems = [
        f"replica {i} stopped at step {max(by, default=0)}"
        for i, by in enumerate((by0, by1))
        if max(by, default=0) < args.steps
    ]
    if killed_at is not None and not (last_life and last_life[0]["healed"]):
        problems.append(
            f"replica 1 did not heal after the kill at step {killed_at}: {last_life[:1]}"
        )
    if not problems and by0[args.steps]["global"] != by1[args.steps]["global"]:
        problems.append("the replicas' global weights differ at the last step")
    if any(r["participants"] != 2 for r in r0 + r1):
        problems.append("an outer step committed with fewer than 2 participants")
    if problems:
        print("FAILED: " + "; ".join(problems), file=sys.stderr)
        return 1
    story = (
        "no replica was killed"
        if killed_at is None
        else f"replica 1 was killed at step {killed_at}, rejoined at step {joined} (healed from "
        "replica 0)"
    )
    print(f"ok: {story}, both finished {args.steps} steps with the same global weights")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="outer steps to train")
    parser.add_argument("--kill-step", type=int, default=4, help="0: no kill")
    parser.add_argument("--fragments", type=int, default=2)
    parser.add_argument("--sync-every", type=int, default=4)
    parser.add_argument("--pg", choices=("torchcomms", "gloo"), default="torchcomms")
    parser.add_argument("--pause", type=float, default=0.01, help="seconds per inner step")
    parser.add_argument("--hidden", type=int, default=16, help="width of the hidden layers")
    parser.add_argument("--json", default=None, help="also write every record to this file")
    parser.add_argument("--replica", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fragments < 2:
        parser.error("--fragments must be >= 2 (Streaming DiLoCo synchronises them in turn)")
    if args.replica is not None:
        replica(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
