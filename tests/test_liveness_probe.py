"""``cpu.tcp.probe``: a remote member is dead only when its listener says so.

Real listeners in real processes: a live ring member answers ``PING``; a listener whose
process is stopped (SIGSTOP) or merely busy holds the connection and counts as alive;
a killed process's port refuses, and a closed listener too.  And the ring itself: a
``Liveness`` of a two-"host" communicator answers, and ``mark_dead`` refuses to declare a
member dead while it answers (the confused-peer case of the ``closed`` chaos fault).
Then what a gloo wait raises when a lane peer's connection ends (``TcpWaiter.gone``):
"closed its connection" while the peer answers, "died" once it does not, and a peer's
``FAILED dead r`` about a rank this one sees alive blames that rank as failed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import torch.distributed as dist

from torchcomms.backends.cpu.tcp.liveness import Liveness
from torchcomms.backends.cpu.tcp.probe import probe
from torchcomms.backends.cpu.tcp.waits import TcpWaiter
from torchcomms.transport.tcp.lane import LanePeerGone

_SILENT_LISTENER = (
    "import socket, sys, time\n"
    "s = socket.create_server(('127.0.0.1', 0))\n"
    "print(s.getsockname()[1], flush=True)\n"
    "time.sleep(60)\n"
)


def _listener_process() -> tuple[subprocess.Popen[str], tuple[str, int]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _SILENT_LISTENER], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    return proc, ("127.0.0.1", port)


def test_a_silent_or_stopped_listener_is_alive_and_a_killed_one_is_gone() -> None:
    proc, address = _listener_process()
    try:
        assert probe(address) is True  # held open by the kernel, never answered: alive
        os.kill(proc.pid, signal.SIGSTOP)
        assert probe(address) is True  # stopped is alive
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        start = time.monotonic()
        assert probe(address) is False
        assert time.monotonic() - start < 0.5
    finally:
        proc.kill()
        proc.wait(10)


def test_a_closed_port_is_gone_and_an_address_it_cannot_try_is_unknown() -> None:
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    assert probe(("127.0.0.1", port)) is False
    assert probe(("no-such-host.invalid", 9)) is None  # never resolved: nothing learned


def test_a_ring_member_answers_and_is_never_marked_dead_while_it_does() -> None:
    store = dist.HashStore()
    me, other = os.getpid(), os.getpid()
    peers = [("host-a", me), ("host-b", other)]  # two "hosts": the ring is built
    made: dict[int, Liveness] = {}

    def make(rank: int) -> None:  # each waits for the other's listener: build both at once
        made[rank] = Liveness(store, rank, peers, f"probe{rank}", period_s=0.02)

    builders = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for b in builders:
        b.start()
    for b in builders:
        b.join(30)
    first, second = made[0], made[1]
    try:
        assert first.elsewhere() == [1]
        assert first.answers(1) and second.answers(0)
        waiter = TcpWaiter(0, lambda: list(first.dead), first, lambda: 1)
        gone = waiter.gone(LanePeerGone(1, None), "all_reduce")  # ended, but it answers
        assert (gone.kind, gone.ranks) == ("peer_failed", [1]), gone
        assert "closed its connection" in str(gone)
        assert first.mark_dead([1]) == []  # a claim the probe refutes
        assert first.dead == ()
        second.close()
        give_up = time.monotonic() + 5
        while first.answers(1) and time.monotonic() < give_up:
            time.sleep(0.05)  # its watcher closes the listener within a period
        assert not first.answers(1)
        assert first.mark_dead([1]) == [1]
        gone = waiter.gone(LanePeerGone(1, None), "all_reduce")
        assert (gone.kind, gone.ranks) == ("dead", [1]), gone
        assert "died (process gone)" in str(gone)
    finally:
        first.close()
        second.close()


def test_a_dead_claim_about_a_rank_seen_alive_blames_it_as_failed_not_dead() -> None:
    me = os.getpid()
    peers = [("host-a", me), ("host-a", me), ("host-a", me)]  # all local, all alive
    lv = Liveness(dist.HashStore(), 0, peers, "claims", period_s=0.02)
    try:
        waiter = TcpWaiter(0, lambda: list(lv.dead), lv, lambda: 1)
        gone = waiter.gone(LanePeerGone(2, "FAILED dead 1"), "broadcast")
        assert (gone.kind, gone.ranks) == ("peer_failed", [1]), gone
        assert "peer rank 2 reports them dead; this rank sees them alive" in str(gone)
        assert lv.dead == ()
    finally:
        lv.close()
