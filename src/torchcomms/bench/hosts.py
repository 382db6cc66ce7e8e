"""``--hosts H``: the spawned ranks on H simulated hosts, so the bench measures the network path.

A simulated host is a network namespace with its own hostname (a UTS namespace per rank:
the host identity the CPU backend decides locality by, since ``/dev/shm`` is shared by all
namespaces on the machine).  Each namespace has ``lo`` and one veth into a bridge in the root
namespace (a bridge for any H, 2 included: one topology to get right); addresses come from
198.18.0.0/15 only (RFC 2544's benchmarking range), so nothing ever targets a real network.
Names carry the launcher's pid, so concurrent runs never collide.

Everything here runs on the launcher's main thread: ``SimulatedHosts`` builds on entry and
always deletes on exit (also after a failing rank, Ctrl-C, or SIGTERM/SIGHUP, which it turns
into ``KeyboardInterrupt`` while it holds the hosts).  The hosts share this machine's cores
and memory: only the network path is simulated.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

#: What the launcher tells each rank about the layout (JSON of ``Layout.describe``).
HOSTS_ENV = "TORCHCOMM_BENCH_HOSTS"
#: The /24 the hosts' addresses come from (host k: ``.k+1``); inside 198.18.0.0/15.
SUBNET = "198.18.0"
MAX_HOSTS = 254
NEEDS = "--hosts needs root and ip netns (simulated hosts are network namespaces)"
#: Variables a rank must not inherit: they would name one identity or interface for every host.
_HOST_VARS = ("TORCHCOMM_HOST_ID", "TORCHCOMM_GLOO_INTERFACE")
#: ``sh -c`` body: set this UTS namespace's hostname, then become the rank (no shell quoting).
_AS_HOST = 'hostname "$1" && shift && exec "$@"'


def unavailable() -> str | None:
    """Why simulated hosts cannot be built here (not root, no ``ip``/``unshare``), or None."""
    if os.geteuid() != 0:
        return f"{NEEDS}: this process is not root (run it as root, e.g. with sudo)"
    for tool in ("ip", "unshare", "hostname"):
        if shutil.which(tool) is None:
            return f"{NEEDS}: the {tool} command is not installed"
    try:
        res = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{NEEDS}: ip netns list failed ({exc})"
    if res.returncode != 0:
        return f"{NEEDS}: ip netns list failed ({res.stderr.strip()})"
    return None


@dataclass(frozen=True)
class Layout:
    """Where each rank runs: host ``rank // per_host``, in namespace ``netns[h]`` at
    ``addresses[h]``, with hostname ``host{h}``."""

    nproc: int
    hosts: int
    tag: str  # unique per run: the launcher's pid

    @property
    def per_host(self) -> int:
        return self.nproc // self.hosts

    @property
    def netns(self) -> list[str]:
        return [f"tcbench{self.tag}h{h}" for h in range(self.hosts)]

    @property
    def addresses(self) -> list[str]:
        return [f"{SUBNET}.{h + 1}" for h in range(self.hosts)]

    @property
    def hostnames(self) -> list[str]:
        return [f"host{h}" for h in range(self.hosts)]

    @property
    def bridge(self) -> str:
        return f"tcb{self.tag}br"  # link names: at most 15 characters

    def veth(self, h: int) -> tuple[str, str]:
        """The root-namespace end (a bridge port) and the host's end of host ``h``'s veth."""
        return f"tcb{self.tag}v{h}", f"tcb{self.tag}p{h}"

    def host_of(self, rank: int) -> int:
        return rank // self.per_host

    def command(self, rank: int, argv: list[str]) -> list[str]:
        """Rank ``rank``'s command line: in its host's namespace, under its hostname."""
        h = self.host_of(rank)
        return [
            *("ip", "netns", "exec", self.netns[h], "unshare", "--uts"),
            *("sh", "-c", _AS_HOST, "sh", self.hostnames[h]),
            *(sys.executable, "-m", "torchcomms.bench", "--_worker", *argv),
        ]

    def environment(self, rank: int, base: dict[str, str]) -> dict[str, str]:
        """Rank ``rank``'s environment: ``base`` with the store on host 0 and gloo (and our
        listeners) on the rank's own host address."""
        env = {k: v for k, v in base.items() if k not in _HOST_VARS}
        env.update(
            MASTER_ADDR=self.addresses[0],
            TORCHCOMM_GLOO_HOSTNAME=self.addresses[self.host_of(rank)],
            **{HOSTS_ENV: json.dumps(self.describe())},
        )
        return env

    def describe(self) -> dict[str, Any]:
        """What the JSON records (``env.simulated_hosts``)."""
        return {
            "hosts": self.hosts,
            "ranks_per_host": self.per_host,
            "hostnames": self.hostnames,
            "addresses": self.addresses,
            "netns": self.netns,
            "bridge": self.bridge,
        }


def layout_from_env() -> dict[str, Any] | None:
    """In a rank: the launcher's ``Layout.describe()``, or None when not on simulated hosts."""
    text = os.environ.get(HOSTS_ENV)
    return json.loads(text) if text else None


class SetupError(RuntimeError):
    """An ``ip`` step of building the hosts failed (what was already built is deleted)."""


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


class SimulatedHosts:
    """The namespaces, veths and bridge of one run (a context manager yielding its
    ``Layout``).  Built and deleted on the launcher's main thread."""

    def __init__(self, nproc: int, hosts: int) -> None:
        self.layout = Layout(nproc, hosts, str(os.getpid()))
        self._saved: dict[int, Any] = {}

    def __enter__(self) -> Layout:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):
                self._saved[sig] = signal.signal(sig, _interrupt)
        try:
            self._build()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self.layout

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.delete()
        finally:
            for sig, handler in self._saved.items():
                signal.signal(sig, handler)
            self._saved.clear()

    def _build(self) -> None:
        lay = self.layout
        steps: list[tuple[str, ...]] = [
            ("link", "add", lay.bridge, "type", "bridge"),
            ("link", "set", lay.bridge, "up"),
        ]
        for h, (ns, addr) in enumerate(zip(lay.netns, lay.addresses, strict=True)):
            port, inside = lay.veth(h)
            steps += [
                ("netns", "add", ns),
                ("link", "add", port, "type", "veth", "peer", "name", inside),
                ("link", "set", inside, "netns", ns),
                ("link", "set", port, "master", lay.bridge),
                ("link", "set", port, "up"),
                ("-n", ns, "addr", "add", f"{addr}/24", "dev", inside),
                ("-n", ns, "link", "set", inside, "up"),
                ("-n", ns, "link", "set", "lo", "up"),
            ]
        for step in steps:
            res = _ip(*step)
            if res.returncode != 0:
                raise SetupError(
                    f"--hosts {lay.hosts}: 'ip {' '.join(step)}' failed: {res.stderr.strip()}"
                )

    def delete(self) -> list[str]:
        """Delete whatever of this run's links and namespaces exists; returns what failed.
        The links go first: deleting a veth's root end deletes its end inside the namespace
        at once (a namespace's own teardown is asynchronous)."""
        lay = self.layout
        failed = []
        for link in [*(lay.veth(h)[0] for h in range(lay.hosts)), lay.bridge]:
            if _ip("link", "show", link).returncode == 0 and _ip("link", "del", link).returncode:
                failed.append(link)
        present = set(_ip("netns", "list").stdout.split())
        for ns in lay.netns:
            if ns in present and _ip("netns", "del", ns).returncode != 0:
                failed.append(ns)
        if failed:
            print(
                f"torchcomms.bench: could not delete {', '.join(failed)} (ip link del / "
                "ip netns del them by hand)",
                file=sys.stderr,
            )
        return failed
