"""What every rank saw of a network fault that leaves both processes alive, and when.

    python benchmarks/diagnostics/net_fault_times.py [--faults local_drop,blackhole,...] \
        [--modes loop,idle] [--per-host 1,2] [--fault-s 6] [--json out.json]

Root only (network namespaces, ``tc``).  Each cell is one trial of
``tests/chaos/net_faults.py``: two namespaces joined by a veth pair, ``per-host`` ranks on
each (1: tcp; 2: the hierarchical path), a 16 KiB all_reduce loop (``loop``: the fault hits
an op in flight) or ops only after the heal (``idle``), the fault on host A for
``--fault-s`` seconds, with the tests' ``TORCHCOMM_TCP_USER_TIMEOUT_S=2`` and
``TORCHCOMM_TCP_KEEPALIVE_S=1`` (``--library-defaults``: the library's own, 30 s and 5 s).
Prints one row per rank: how its ops ended (``progress``
or the error's type), seconds after the fault began, the start of the message, whether every
result was right, and how long a new communicator over the same hosts took after the heal.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "src"), str(REPO)]

import torch  # noqa: E402
from tests.chaos import net_faults  # noqa: E402
from tests.harness import free_port  # noqa: E402
from tests.test_shm_hier import NETNS_ADDRS, veth_namespaces  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", default=",".join(net_faults.FAULTS))
    parser.add_argument("--modes", default="loop,idle")
    parser.add_argument("--per-host", default="1,2")
    parser.add_argument("--fault-s", type=float, default=6.0)
    parser.add_argument(
        "--library-defaults",
        action="store_true",
        help="the library's TCP user timeout and keepalive (30 s, 5 s), not the tests' 2 s, 1 s",
    )
    parser.add_argument("--json", help="write every cell's reports here")
    args = parser.parse_args()
    cells = []
    env = (
        {"TORCHCOMM_TCP_USER_TIMEOUT_S": "", "TORCHCOMM_TCP_KEEPALIVE_S": ""}
        if args.library_defaults
        else None
    )
    for fault in args.faults.split(","):
        for mode in args.modes.split(","):
            for per_host in (int(p) for p in args.per_host.split(",")):
                with tempfile.TemporaryDirectory() as tmp, veth_namespaces() as names:
                    got = net_faults.run_trial(
                        Path(tmp), names, NETNS_ADDRS, free_port(), fault, args.fault_s,
                        per_host=per_host, mode=mode,
                        transport="tcp" if per_host == 1 else "auto", rank_env=env,
                    )  # fmt: skip
                cells.append({"fault": fault, "mode": mode, "per_host": per_host, **got})
                for rank, seen in got["ranks"].items():
                    ended = seen["ended"]
                    text = (ended.get("text") or "").split(": ", 1)[-1]
                    after = seen["after"]
                    print(
                        f"{fault:15} {mode:5} {per_host}/host rank {rank}: "
                        f"{ended['type'] or 'progress':17} {ended['at'] - got['on']:6.2f} s  "
                        f"right={seen['wrong'] == 0} ops={seen['ops']} "
                        f"new comm {after.get('s', float('nan')):.2f} s  {text[:110]}",
                        flush=True,
                    )
    if args.json:
        machine = {
            "uname": " ".join(platform.uname()),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv),
            "settings": {
                "TORCHCOMM_TCP_USER_TIMEOUT_S": None if env else net_faults.USER_TIMEOUT_S,
                "TORCHCOMM_TCP_KEEPALIVE_S": None if env else net_faults.KEEPALIVE_S,
                "fault_s": args.fault_s,
            },
        }
        Path(args.json).write_text(json.dumps({"machine": machine, "cells": cells}, indent=1))


if __name__ == "__main__":
    main()
