"""Network faults that leave every process alive, across two network namespaces (issue 54).

``run_trial`` places ``per_host`` ranks on each of two "hosts" (namespaces joined by a veth
pair), lets them run, applies a fault with ``tc``/``ip`` from the root namespace, heals it, and
collects what every rank saw.  The faults (``FAULTS``):

* ``local_drop``: a zero-length queue on host A's egress (``pfifo limit 0``): A's kernel sees
  its own packets dropped and, past the user timeout, gives its connections up, while B's
  ends stay open;
* ``blackhole``: A's egress silently redirected into a dummy interface (a clsact qdisc and a
  ``mirred`` filter): A believes its packets left; ``blackhole_both`` does it on both hosts;
* ``link_down``: A's end of the veth set down.

Each rank (``rank_main``, run as ``ip netns exec NS python -c ...``) runs all_reduces of
known values, in a loop (``mode="loop"``: the fault hits an op in flight) or only after the
heal (``mode="idle"``: the fault hits between ops), and records how it ended: ``stopped``
after the parent's stop with every result right, or the error's type, text and time
(``time.monotonic``, one clock for every namespace).  Then every rank makes a new
communicator over the same hosts and checks an all_reduce: what a user does after a typed
error.  Needs root and iproute2 (``tc``); the caller skips otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from tests.chaos.faults import env_store
from torchcomms import ReduceOp, new_comm

FAULTS = ("local_drop", "blackhole", "blackhole_both", "link_down")
#: The test's transport settings: short enough that a fault is named within seconds.
USER_TIMEOUT_S = 2.0
KEEPALIVE_S = 1.0
OP_TIMEOUT_S = 60.0
_ELEMS = 4096  # 16 KiB of float32: the size


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _tc(*args: str) -> None:
    res = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, f"tc {' '.join(args)}: {res.stderr}"


def veth_of(ns: str) -> str:
    out = _ip("-n", ns, "-o", "link", "show", "type", "veth").stdout
    return out.split(":")[1].strip().split("@")[0]


class Fault:
    """One fault on the namespaces ``names`` (A = ``names[0]``): ``on()``, then ``off()``."""

    def __init__(self, kind: str, names: tuple[str, str]) -> None:
        assert kind in FAULTS, kind
        self.kind = kind
        self.names = names
        self._sinks: list[str] = []
        #: Each host's end of the pair, looked up before a black hole adds its own veth.
        self._devs = {ns: veth_of(ns) for ns in names}

    def _hosts(self) -> tuple[str, ...]:
        return self.names if self.kind == "blackhole_both" else self.names[:1]

    def on(self) -> None:
        for i, ns in enumerate(self._hosts()):
            dev = self._devs[ns]
            if self.kind == "local_drop":
                _tc("-n", ns, "qdisc", "add", "dev", dev, "root", "pfifo", "limit", "0")
            elif self.kind == "link_down":
                assert _ip("-n", ns, "link", "set", "dev", dev, "down").returncode == 0
            else:  # a black hole: into a dummy veth pair that leads nowhere
                sink = f"nfk{os.getpid() % 10000}{i}"
                assert _ip("-n", ns, "link", "add", sink, "type", "veth", "peer", "name",
                           sink + "p").returncode == 0  # fmt: skip
                _ip("-n", ns, "link", "set", sink, "up")
                self._sinks.append(sink)
                _tc("-n", ns, "qdisc", "add", "dev", dev, "clsact")
                _tc("-n", ns, "filter", "add", "dev", dev, "egress", "protocol", "all", "prio",
                    "1", "u32", "match", "u32", "0", "0", "action", "mirred", "egress",
                    "redirect", "dev", sink)  # fmt: skip

    def off(self) -> None:
        for ns in self._hosts():
            dev = self._devs[ns]
            if self.kind == "local_drop":
                _tc("-n", ns, "qdisc", "del", "dev", dev, "root")
            elif self.kind == "link_down":
                assert _ip("-n", ns, "link", "set", "dev", dev, "up").returncode == 0
            else:
                _tc("-n", ns, "qdisc", "del", "dev", dev, "clsact")
        for ns, sink in zip(self._hosts(), self._sinks, strict=False):
            _ip("-n", ns, "link", "del", sink)


def rank_cmd(
    names: tuple[str, str], addrs: tuple[str, str], rank: int, per_host: int, **extra: str
) -> tuple[list[str], dict[str, str]]:
    """Rank ``rank`` of ``2 * per_host``, on host ``rank // per_host``."""
    repo = Path(__file__).resolve().parents[2]
    h = rank // per_host
    env = dict(os.environ)
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(var, None)
    env.update(
        TORCHCOMM_RANK=str(rank),
        TORCHCOMM_SIZE=str(2 * per_host),
        TORCHCOMM_HOST_ID=f"nethost{h}",
        TORCHCOMM_GLOO_HOSTNAME=addrs[h],
        TORCHCOMM_ABORT_ON_ERROR="0",
        TORCHCOMM_TCP_USER_TIMEOUT_S=str(USER_TIMEOUT_S),
        TORCHCOMM_TCP_KEEPALIVE_S=str(KEEPALIVE_S),
        PYTHONPATH=os.pathsep.join([str(repo / "src"), str(repo)]),
    )
    env.update(extra)  # last: a caller may override the settings above
    code = "from tests.chaos.net_faults import rank_main; rank_main()"
    return ["ip", "netns", "exec", names[h], sys.executable, "-c", code], env


def _outcome(call: Any, expect: float) -> dict[str, Any]:
    try:
        got = call()
    except Exception as exc:
        return {"type": type(exc).__name__, "text": str(exc), "at": time.monotonic()}
    return {"type": None, "right": got == expect, "at": time.monotonic()}


def rank_main() -> None:
    rank = int(os.environ["TORCHCOMM_RANK"])
    size = int(os.environ["TORCHCOMM_SIZE"])
    out = Path(os.environ["NF_OUT"])
    mode = os.environ["NF_MODE"]
    store = env_store(rank, size, "NF")
    want = float(size * (size + 1) // 2)

    def make(name: str) -> Any:
        return new_comm("gloo", torch.device("cpu"), name=name, store=store,
                        timeout=timedelta(seconds=OP_TIMEOUT_S),
                        hints={"transport": os.environ["NF_TRANSPORT"]})  # fmt: skip

    stopping = [False]

    def one(comm: Any) -> float:
        """One all_reduce: the value every element got (nan if they differ).  Its last
        element carries whether any rank saw ``stop``, so all stop after the same op."""
        t = torch.full((_ELEMS + 1,), float(rank + 1))
        t[-1] = float((out / "stop").exists())
        comm.all_reduce(t, ReduceOp.SUM, False)
        stopping[0] = bool(t[-1] > 0)
        data = t[:-1]
        return float(data[0]) if bool((data == data[0]).all()) else float("nan")

    comm = make("nf")
    assert one(comm) == want
    seen: dict[str, Any] = {"transport": str(comm.get_backend_impl().transport)}
    (out / f"ready{rank}").write_text(str(os.getpid()))
    _wait_for(out / "go")
    if mode == "idle":
        _wait_for(out / "healed")
    ops, wrong, ended = 0, 0, None
    # loop: until every rank saw ``stop`` (the fault hits an op in flight); idle: 20 ops
    while not stopping[0] if mode == "loop" else ops < 20:
        o = _outcome(lambda: one(comm), want)
        if o["type"] is not None:
            ended = o
            break
        ops += 1
        wrong += 0 if o["right"] else 1
    seen.update(ops=ops, wrong=wrong, ended=ended or {"type": None, "at": time.monotonic()})
    # What a user does next: a new communicator over the same hosts (after the heal).
    _wait_for(out / "healed")
    start = time.monotonic()
    try:
        fresh = make("nf_after")
        seen["after"] = {"sum": one(fresh), "s": time.monotonic() - start}
        fresh.finalize()
    except Exception as exc:
        seen["after"] = {"type": type(exc).__name__, "text": str(exc)}
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    _wait_for(out / "done")  # alive until every rank reported: an exited rank is a dead one
    os._exit(0)


def _wait_for(path: Path, seconds: float = 120.0) -> None:
    give_up = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > give_up:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


def run_trial(
    tmp: Path,
    names: tuple[str, str],
    addrs: tuple[str, str],
    port: int,
    fault: str,
    fault_s: float,
    per_host: int = 1,
    mode: str = "loop",
    transport: str = "tcp",
    rank_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Start the ranks, fault for ``fault_s``, heal; return every rank's report and the fault's
    times (``on``, ``off``: ``time.monotonic``).  ``rank_env`` overrides the ranks' variables (an
    empty ``TORCHCOMM_TCP_*`` value: the library's default instead of the tests' short one)."""
    size = 2 * per_host
    procs: list[subprocess.Popen[str]] = []
    trip = Fault(fault, names)
    times: dict[str, float] = {}
    try:
        for rank in range(size):
            cmd, env = rank_cmd(names, addrs, rank, per_host, NF_OUT=str(tmp), NF_MODE=mode,
                                NF_STORE_ADDR=addrs[0], NF_STORE_PORT=str(port),
                                NF_TRANSPORT=transport, **(rank_env or {}))  # fmt: skip
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))  # fmt: skip
        _await_ranks(procs, [tmp / f"ready{r}" for r in range(size)])
        (tmp / "go").write_text("1")
        time.sleep(0.5)  # ops running
        times["on"] = time.monotonic()
        trip.on()
        try:
            time.sleep(fault_s)
        finally:
            trip.off()
            times["off"] = time.monotonic()
        (tmp / "healed").write_text("1")
        if mode == "loop":
            time.sleep(2.0)  # progress after the heal, where the comm survived
            (tmp / "stop").write_text("1")
        # bounded: a rank that never ends its ops (a silent wait) fails the trial here
        _await_ranks(procs, [tmp / f"rank{r}.json" for r in range(size)])
        (tmp / "done").write_text("1")
        ranks = {r: json.loads((tmp / f"rank{r}.json").read_text()) for r in range(size)}
        return {"ranks": ranks, **times}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)


def _await_ranks(procs: list[subprocess.Popen[str]], paths: list[Path]) -> None:
    """Until every rank wrote its file; fails if one exits first or after 90 s."""
    give_up = time.monotonic() + 90
    while not all(p.exists() for p in paths):
        exited = [p for p in procs if p.poll() is not None]
        assert not exited and time.monotonic() < give_up, logs(procs)
        time.sleep(0.05)


def logs(procs: list[subprocess.Popen[str]]) -> str:
    texts = []
    for i, p in enumerate(procs):
        if p.poll() is not None and p.stdout is not None:
            texts.append(f"--- rank {i} (exit {p.returncode}):\n{p.stdout.read()[-3000:]}")
    return "\n".join(texts) or "no rank has exited"
