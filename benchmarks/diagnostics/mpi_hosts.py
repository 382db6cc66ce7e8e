"""The bench under ``mpirun`` with its ranks on simulated hosts, so ``--vs mpi`` times Open MPI's
TCP path between hosts beside ours and gloo's (root, ``ip netns``).

    python benchmarks/diagnostics/mpi_hosts.py [--hosts 2] [--per-host 1] -- BENCH_ARGS...

e.g. ``... -- --vs gloo,mpi -b 16 -e 64M -f 4 -n 20 --json out.json``.

``python -m torchcomms.bench --hosts`` spawns its ranks itself, so it refuses to run under a
launcher.  Here the same simulated hosts (``torchcomms.bench.hosts``: a network namespace and
a hostname per host, veths into a bridge) are built, the bridge gets ``198.18.0.254`` so the
hosts reach ``mpirun`` in the root namespace, and ``mpirun`` starts its daemon on each
"host" through an agent script (in place of ssh) that enters the host's namespace, sets
its hostname and the rank's gloo address, then runs the daemon.  Open MPI is held to TCP
between processes (``--mca btl tcp,self``) on the hosts' subnet, as ours is, and binds no
rank to a core (each host's daemon would put its first rank on core 0: the hosts share
this machine's cores).  The hosts are deleted when the run ends.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

from torchcomms.bench.hosts import SUBNET, SimulatedHosts, unavailable

#: The bridge's own address: how a host's daemon reaches ``mpirun`` in the root namespace.
BRIDGE_ADDRESS = f"{SUBNET}.254"

_AGENT = """#!/bin/sh
# mpirun's launch agent (in place of ssh): $1 is the host's address, the rest the command.
host="$1"; shift
case "$host" in
{cases}
  *) echo "mpi_hosts agent: unknown host $host" >&2; exit 1 ;;
esac
exec ip netns exec "$ns" unshare --uts sh -c \
  "hostname $name && export TORCHCOMM_GLOO_HOSTNAME=$host && $*"
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--per-host", type=int, default=1)
    ap.add_argument("bench_args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]
    why = unavailable()
    mpirun = shutil.which("mpirun")
    if why or mpirun is None:
        print(f"mpi_hosts: {why or 'mpirun is not installed (pip install -e .[mpi])'}")
        return 2
    nproc = args.hosts * args.per_host
    with SimulatedHosts(nproc, args.hosts) as layout, tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            ["ip", "addr", "add", f"{BRIDGE_ADDRESS}/24", "dev", layout.bridge], check=True
        )
        cases = "\n".join(
            f"  {addr}) ns={ns}; name={name} ;;"
            for addr, ns, name in zip(layout.addresses, layout.netns, layout.hostnames, strict=True)
        )
        agent = os.path.join(tmp, "agent.sh")
        with open(agent, "w") as f:
            f.write(_AGENT.format(cases=cases))
        os.chmod(agent, 0o755)
        subnet = f"{SUBNET}.0/24"
        os.environ.setdefault("PYTHONPATH", "")  # ``-x PYTHONPATH`` needs it set
        command = [
            mpirun,
            "--allow-run-as-root",
            *("-n", str(nproc)),
            *("--host", ",".join(f"{a}:{args.per_host}" for a in layout.addresses)),
            *("--prtemca", "plm_ssh_agent", agent),
            # Each host's daemon would bind its first rank to core 0: the hosts share cores.
            *("--bind-to", "none"),
            *("--prtemca", "oob_tcp_if_include", subnet),
            *("--mca", "btl", "tcp,self"),
            *("--mca", "btl_tcp_if_include", subnet),
            *("--mca", "oob_tcp_if_include", subnet),
            *("-x", f"MASTER_ADDR={layout.addresses[0]}"),
            *("-x", "PATH"),
            *("-x", "PYTHONPATH"),
            *(["-x", "TORCHCOMM_TRANSPORT"] if "TORCHCOMM_TRANSPORT" in os.environ else []),
            *(sys.executable, "-m", "torchcomms.bench", *bench_args),
        ]
        return subprocess.run(command).returncode


if __name__ == "__main__":
    sys.exit(main())
