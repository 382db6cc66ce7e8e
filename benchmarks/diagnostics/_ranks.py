"""Run a diagnostics script as a few ranks that bootstrap through a FileStore: on this
host, or on simulated hosts (network namespaces, as ``bench --hosts``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def run_local_ranks(script: str, child_flag: str, size: int = 2, hosts: int = 1) -> int:
    """Start ``size`` copies of ``script`` (same arguments) as ranks of one comm, with
    ``child_flag`` set in their environment; the worst exit status.  ``hosts`` > 1: the
    ranks on that many simulated hosts (``torchcomms.bench.hosts``: a network namespace,
    address and host identity each; root only), in order, ``size / hosts`` per host."""
    store = os.path.join(tempfile.mkdtemp(), "store")
    base = {
        **os.environ,
        child_flag: "1",
        "TORCHCOMM_SIZE": str(size),
        "TORCHCOMM_STORE_PATH": store,
    }
    argv = [sys.executable, script, *sys.argv[1:]]
    if hosts <= 1:
        procs = [
            subprocess.Popen(argv, env={**base, "TORCHCOMM_RANK": str(rank)})
            for rank in range(size)
        ]
        return max(p.wait() for p in procs)
    from torchcomms.bench.hosts import SimulatedHosts, unavailable

    why = unavailable()
    if why is not None:
        sys.exit(f"--hosts {hosts}: {why}")
    with SimulatedHosts(size, hosts) as layout:
        procs = []
        for rank in range(size):
            h = layout.host_of(rank)
            env = layout.environment(rank, {**base, "TORCHCOMM_RANK": str(rank)})
            env["TORCHCOMM_HOST_ID"] = layout.hostnames[h]
            procs.append(subprocess.Popen(["ip", "netns", "exec", layout.netns[h], *argv], env=env))
        return max(p.wait() for p in procs)


def gather_local_ranks(
    script: str, child_flag: str, out_env: str, size: int = 2, hosts: int = 1
) -> list[Any]:
    """``run_local_ranks``, each rank writing its results as JSON to ``$out_env.<rank>`` (a
    fresh temporary path): those results by rank; exits if a rank failed."""
    out = os.path.join(tempfile.mkdtemp(), "ranks.json")
    os.environ[out_env] = out
    if run_local_ranks(script, child_flag, size, hosts) != 0:
        sys.exit("a rank failed")
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(size)]


def round_trip(comm: Any, rank: int, mine: Any, got: Any) -> None:
    """One sync ping-pong between ranks 0 and 1 of ``comm`` (what the bench's sendrecv times):
    rank 0 sends ``mine`` and receives into ``got``, rank 1 receives and then sends."""
    if rank == 0:
        comm.send(mine, 1, False)
        comm.recv(got, 1, False)
    else:
        comm.recv(got, 0, False)
        comm.send(mine, 0, False)
