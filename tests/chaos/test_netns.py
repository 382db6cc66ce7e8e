"""Multi-host faults across real network stacks: two namespaces joined by a veth pair.

Four ranks, two per namespace (a UTS-free variant: the host identity comes from
``TORCHCOMM_HOST_ID``, the address gloo uses from ``TORCHCOMM_GLOO_HOSTNAME``).  Faults:
a rank on the second host SIGKILLed (the survivors then ``shrink`` and go on), and the
link cut (``ip link set … down``).  Skips
cleanly without root or iproute2.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.chaos.net_faults import logs as _logs
from tests.harness import free_port, timeout_scale
from tests.test_shm_hier import (
    NETNS_ADDRS,
    _ip,
    check_netns_hier_results,
    netns_rank_cmd,
    veth_namespaces,
)

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 3.0
DEAD_BOUND_S = 3.0


def _run_trial(
    tmp: Path, transport: str, fault: str, hier_checks: bool = False
) -> dict[int, dict[str, object]]:
    scale = timeout_scale()
    port = free_port()
    with veth_namespaces() as names:
        procs: list[subprocess.Popen[str]] = []
        try:
            for rank in range(4):
                code = "from tests.chaos.faults import netns_rank_main; netns_rank_main()"
                cmd, env = netns_rank_cmd(
                    names,
                    rank,
                    "chaos-ns",
                    code,
                    TORCHCOMM_ABORT_ON_ERROR="0",
                    CHAOS_STORE_ADDR=NETNS_ADDRS[0],
                    CHAOS_STORE_PORT=str(port),
                    CHAOS_TIMEOUT_S=str(TIMEOUT_S * scale),
                    CHAOS_TRANSPORT=transport,
                    CHAOS_OUT=str(tmp),
                    CHAOS_SHRINK="1" if fault == "kill" else "0",
                    CHAOS_HIER_CHECKS="1" if hier_checks else "0",
                )
                procs.append(
                    subprocess.Popen(
                        cmd,
                        cwd=REPO,
                        env=env,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        text=True,
                    )
                )
            give_up = time.monotonic() + 90 * scale
            while not all((tmp / f"ready{r}").exists() for r in range(4)):
                dead = [p for p in procs if p.poll() is not None]
                assert not dead and time.monotonic() < give_up, _logs(procs)
                time.sleep(0.05)
            if fault == "kill":
                os.kill(int((tmp / "ready3").read_text()), signal.SIGKILL)
            else:
                res = _ip("-n", names[1], "link", "set", "dev", _veth(names[1]), "down")
                assert res.returncode == 0, res.stderr
            (tmp / "go").write_text("1")
            survivors = [0, 1, 2] if fault == "kill" else [0, 1, 2, 3]
            give_up = time.monotonic() + 30 * scale
            while not all((tmp / f"rank{r}.json").exists() for r in survivors):
                assert time.monotonic() < give_up, _logs(procs)
                time.sleep(0.05)
            (tmp / "done").write_text("1")
            return {r: json.loads((tmp / f"rank{r}.json").read_text()) for r in survivors}
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait(10)


def _veth(ns: str) -> str:
    out = _ip("-n", ns, "-o", "link", "show", "type", "veth").stdout
    return out.split(":")[1].strip().split("@")[0]


@pytest.mark.netns
@pytest.mark.parametrize(
    "transport",
    # tcp across hosts is also killed in tests/chaos/test_faults.py (simulated hosts); here
    # with -m slow.
    ("auto", pytest.param("tcp", marks=pytest.mark.slow)),
)
def test_a_rank_killed_on_another_host_is_named_by_every_survivor(
    transport: str, tmp_path: Path
) -> None:
    # The hierarchical trial first runs the healthy multi-host checks (tests/test_shm_hier.py)
    # in the same processes: one set of namespace processes, not two.
    seen = _run_trial(tmp_path, transport, "kill", hier_checks=transport == "auto")
    if transport == "auto":
        check_netns_hier_results(
            {r: json.loads((tmp_path / f"hier{r}.json").read_text()) for r in range(4)}
        )
    expected = "hierarchical" if transport == "auto" else "tcp"
    for rank, got in seen.items():
        assert str(got["transport"]["text"]).startswith(expected), got  # type: ignore[index]
        o = got["all_reduce"]
        assert o["type"] == "PeerFailureError", (rank, o)  # type: ignore[index]
        assert "peer rank 3 died" in o["text"], (rank, o)  # type: ignore[index]
        for live in (0, 1, 2):
            assert f"peer rank {live} " not in o["text"], (rank, o)  # type: ignore[index]
        assert o["s"] < DEAD_BOUND_S, (rank, o)  # type: ignore[index]
        # Then the survivors shrink and go on: ranks 0, 1, 2 keep their numbers.
        small = got["shrink"]
        assert small["rank_size"] == [rank, 3] and small["sum"] == 3, (rank, small)  # type: ignore[index]
        assert str(small["transport"]).startswith(expected), (rank, small)  # type: ignore[index]


@pytest.mark.netns
def test_a_cut_link_times_out_naming_the_other_host(tmp_path: Path) -> None:
    seen = _run_trial(tmp_path, "tcp", "link")
    for rank, got in seen.items():
        o = got["all_reduce"]
        far = (2, 3) if rank < 2 else (0, 1)
        assert o["type"] == "CommTimeoutError", (rank, o)  # type: ignore[index]
        assert f"peer ranks {far[0]}, {far[1]}" in o["text"], (rank, o)  # type: ignore[index]
        assert TIMEOUT_S <= o["s"] < TIMEOUT_S + 1.0 + 1.0, (rank, o)  # type: ignore[index]
