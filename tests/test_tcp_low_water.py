"""A ring step that only streams into a tensor wakes once the rest of its block is in, not
per segment (``transport/tcp/sockets.py``, ``LowWater``; used by ``transport/tcp/ring.py``).

Real sockets, real processes:

* On a loopback TCP connection, with the mark raised, ``poll`` does not report fewer bytes
  than the mark, and does once they are all there; cleared, it reports the first byte.
  Blocks below ``LOW_WATER_FROM`` keep the default mark, and the mark never exceeds
  ``LOW_WATER_BYTES``.
* The mark never stalls a wait on a peer that stops short: a peer that closes, or a
  process killed with ``SIGKILL`` after sending part of a block, still wakes the reader.
* Two ranks over ``TORCHCOMM_TRANSPORT=tcp``, the sending rank stopped (``SIGSTOP``) for
  0.3 s once its first bytes are in: an 8 MiB broadcast raises the receiving rank's mark
  (to the rest of the block, at most ``LOW_WATER_BYTES``; counted, the transport
  untouched) while a reduce's root, which combines what arrives, keeps the default, from
  both roots; the values are right, and the lane's sockets are back at the default mark,
  so the small ops, send/recv and large all_reduce that follow run as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import socket
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from functools import partial
from typing import Any

import torch

from tests.harness import RankContext, run_ranks
from torchcomms import ReduceOp, new_comm
from torchcomms.transport.tcp.sockets import LOW_WATER_BYTES, LOW_WATER_FROM, LowWater

TCP = {"TORCHCOMM_TRANSPORT": "tcp"}


@contextlib.contextmanager
def _connection() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected loopback TCP pair: (sending end, receiving end)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        out = socket.create_connection(server.getsockname())
        inp, _ = server.accept()
    with out, inp:
        yield out, inp


def _readable(sock: socket.socket, timeout_ms: int = 0) -> bool:
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(timeout_ms))


def _mark(sock: socket.socket) -> int:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)


def test_poll_waits_for_the_mark_and_a_cleared_mark_for_one_byte() -> None:
    with _connection() as (out, inp):
        water = LowWater(inp)
        water.wait_for(1 << 20)
        assert water.mark == _mark(inp) == 1 << 20
        out.sendall(b"x" * (300 << 10))
        time.sleep(0.05)
        assert not _readable(inp), "woken below the mark"
        out.sendall(b"y" * ((1 << 20) - (300 << 10)))
        assert _readable(inp, 2000), "not woken at the mark"
        view = memoryview(bytearray(1 << 20))
        got = 0
        while got < len(view):
            got += inp.recv_into(view[got:])
        water.clear()
        assert water.mark == _mark(inp) == 1
        out.sendall(b"z")
        assert _readable(inp, 2000), "a cleared mark did not wake at the first byte"


def test_small_blocks_keep_the_default_and_large_ones_are_capped() -> None:
    with _connection() as (_, inp):
        water = LowWater(inp)
        water.wait_for(LOW_WATER_FROM - 1)
        assert water.mark == _mark(inp) == 1
        water.wait_for(64 << 20)
        assert water.mark == LOW_WATER_BYTES
        assert 1 < _mark(inp) <= LOW_WATER_BYTES  # the kernel may cap it lower still


def test_a_peer_that_closes_short_of_the_mark_still_wakes_the_reader() -> None:
    with _connection() as (out, inp):
        water = LowWater(inp)
        water.wait_for(4 << 20)
        out.sendall(b"x" * (64 << 10))
        out.close()
        assert _readable(inp, 2000), "the end of the connection did not wake the reader"
        got = 0
        while n := len(inp.recv(1 << 20)):
            got += n
        assert got == 64 << 10


_PARTIAL_SENDER = """
import os, socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.sendall(b"x" * (128 << 10))
print("sent", flush=True)
sys.stdin.read()
"""


def test_a_peer_killed_mid_block_still_wakes_the_reader() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        sender = subprocess.Popen(
            [sys.executable, "-c", _PARTIAL_SENDER, str(port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        try:
            inp, _ = server.accept()
            with inp:
                LowWater(inp).wait_for(4 << 20)
                assert sender.stdout is not None and sender.stdout.readline() == b"sent\n"
                time.sleep(0.05)
                assert not _readable(inp), "woken below the mark"
                os.kill(sender.pid, signal.SIGKILL)
                start = time.monotonic()
                assert _readable(inp, 5000), "a killed peer left the reader asleep"
                assert time.monotonic() - start < 2.0
        finally:
            sender.kill()
            sender.wait()


def _stop_sender_midway(inbox: socket.socket, sender: int) -> threading.Thread:
    """Stop ``sender`` (``SIGSTOP``) for 0.3 s once its first bytes are queued on
    ``inbox``: the receiver then reads what came and waits for the rest, in the op."""

    def run() -> None:
        give_up = time.monotonic() + 20
        while time.monotonic() < give_up:
            queued = fcntl.ioctl(inbox.fileno(), termios.FIONREAD, b"\0\0\0\0")
            if int.from_bytes(queued, sys.byteorder):
                os.kill(sender, signal.SIGSTOP)
                time.sleep(0.3)
                os.kill(sender, signal.SIGCONT)
                return
            time.sleep(0.0002)

    stopper = threading.Thread(target=run, daemon=True)
    stopper.start()
    return stopper


def _large_ops(ctx: RankContext) -> dict[str, Any]:
    raised: list[int] = []
    wait_for = LowWater.wait_for

    def counted(self: LowWater, left: int) -> None:
        wait_for(self, left)
        raised.append(self.mark)

    LowWater.wait_for = counted  # type: ignore[method-assign]  # counts; still sets the mark
    comm = new_comm(
        "gloo", torch.device("cpu"), name="low_water", store=ctx.store,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    assert comm.get_backend_impl().transport.startswith("tcp")
    me, peer = comm.get_rank(), 1 - comm.get_rank()
    ctx.store.set(f"pid/{me}", str(os.getpid()))
    peer_pid = int(ctx.store.get(f"pid/{peer}").decode())
    lane = comm.get_backend_impl()._ops.lane  # type: ignore[attr-defined]
    inbox = lane.ring_round().inbox
    # A small receive window: the sender, once stopped, is far from done.
    inbox.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 128 << 10)
    count = (8 << 20) // 4 + 3

    def received(op: Callable[[], object], receiving: bool) -> int:
        """The highest mark this rank asked for in ``op``, its peer stopped midway."""
        comm.barrier(False)  # nothing left queued from before
        raised.clear()
        stopper = _stop_sender_midway(inbox.sock, peer_pid) if receiving else None
        op()
        if stopper is not None:
            stopper.join()
        return max(raised, default=1)

    marks: dict[str, int] = {}
    for root in (0, 1):
        t = torch.full((count,), float(10 * root + me))
        t[-1] = -1.0
        got = received(partial(comm.broadcast, t, root, False), receiving=me != root)
        want = torch.full((count,), float(11 * root))
        want[-1] = -1.0
        assert torch.equal(t, want), root
        if me != root:
            marks["broadcast"] = got
    # a reduce's root combines what arrives: it keeps the default mark
    for root in (0, 1):
        t = torch.full((count,), float(me + 1))
        got = received(partial(comm.reduce, t, root, ReduceOp.SUM, False), me == root)
        assert torch.equal(t, torch.full((count,), 3.0 if me == root else float(me + 1)))
        if me == root:
            marks["reduce"] = got
    # what follows reads the same sockets at the default mark
    marks["after"] = [inbox.low_water.mark, _mark(inbox.sock)]
    small = torch.full((3,), float(me + 1))
    comm.all_reduce(small, ReduceOp.SUM, False)
    assert torch.equal(small, torch.full((3,), 3.0))
    got = torch.zeros(5)
    if me == 0:
        comm.send(torch.arange(5.0), peer, False)
        comm.recv(got, peer, False)
    else:
        comm.recv(got, peer, False)
        comm.send(got, peer, False)
    assert torch.equal(got, torch.arange(5.0))
    big = torch.full((1 << 20,), float(me + 1))
    comm.all_reduce(big, ReduceOp.SUM, False)
    assert torch.equal(big, torch.full((1 << 20,), 3.0))
    comm.finalize()
    return marks


def test_a_broadcasts_receiver_raises_the_mark_a_reduces_root_does_not_and_it_is_cleared() -> None:
    results = run_ranks(_large_ops, 2, timeout=120, env=TCP)
    for rank, got in enumerate(results):
        # each rank received one broadcast and was the root of one reduce
        assert LOW_WATER_FROM <= got["broadcast"] <= LOW_WATER_BYTES, (rank, got)
        assert got["reduce"] == 1, (rank, got)
        assert got["after"] == [1, 1], (rank, got)
