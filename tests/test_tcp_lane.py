"""The tcp path's lane (``transport/tcp/lane.py``): real sockets between real processes.

* Bruck's all_gather at worlds 1-4 (not only powers of two) with blocks of different
  lengths, many times over the same connections, byte for byte.
* Goodbyes: a peer that says ``BYE`` or ``FAILED …`` and one that dies without a word are
  told apart by the ranks that wait on it.
* A peer that sends a block larger than a row is refused (``LaneProtocolError``), never
  written past the row.
* Connecting: a stray client on the listener is ignored; a rank that never dials in is
  named when the wait gives up.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import pytest

from tests.harness import RankContext, RankFailure, run_ranks
from torchcomms.transport.tcp import lane as tcp_lane

CAP = 64


def _connect(ctx: RankContext, timeout_s: float = 20.0) -> tcp_lane.Lane:
    """A lane over the task's store, the way ``cpu.select.connect_lane`` builds one."""
    store = ctx.store
    listener = tcp_lane.listen("127.0.0.1")
    token = f"tok{ctx.rank}"
    store.set(f"lane/{ctx.rank}", f"{token} {listener.getsockname()[1]}")

    def address_of(r: int) -> tuple[str, int, str]:
        store.wait([f"lane/{r}"])
        theirs, port = store.get(f"lane/{r}").decode().split()
        return "127.0.0.1", int(port), theirs

    end = time.monotonic() + timeout_s

    def between(missing: list[int]) -> None:
        if time.monotonic() > end:
            raise TimeoutError(f"never connected: {missing}")

    return tcp_lane.connect(listener, token, ctx.rank, ctx.world_size, address_of, end, between)


def _block(rank: int, step: int) -> bytes:
    """Rank ``rank``'s block in exchange ``step``: a length and content of its own."""
    length = (rank * 7 + step * 3) % CAP
    return bytes((rank * 31 + step + i) % 256 for i in range(length))


def _gathers(ctx: RankContext, steps: int) -> int:
    lane = _connect(ctx)
    n = ctx.world_size
    rows = memoryview(bytearray(n * CAP))
    lengths = [0] * n
    for step in range(steps):
        mine = _block(ctx.rank, step)
        rows[ctx.rank * CAP : ctx.rank * CAP + len(mine)] = mine
        lengths[ctx.rank] = len(mine)
        lane.all_gather(rows, CAP, lengths, lambda: None)
        for r in range(n):
            want = _block(r, step)
            assert lengths[r] == len(want), (step, r, lengths[r], len(want))
            assert bytes(rows[r * CAP : r * CAP + lengths[r]]) == want, (step, r)
    lane.close()
    return steps


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_bruck_all_gather_moves_every_block_exactly(world: int) -> None:
    assert tcp_lane.rounds(0, world) == [((-d) % world, d % world) for d in (1, 2, 4) if d < world]
    assert run_ranks(_gathers, world, 200, timeout=60.0) == [200] * world


def _goodbye(ctx: RankContext, how: str) -> dict[str, Any]:
    """Rank 1 leaves after one exchange (``how``); the others report what they saw."""
    lane = _connect(ctx)
    n = ctx.world_size
    rows = memoryview(bytearray(n * CAP))
    lengths = [1] * n
    lane.all_gather(rows, CAP, lengths, lambda: None)
    if ctx.rank == 1:
        if how == "failed":
            lane.goodbye("FAILED timeout 2")
        lane.close()  # says BYE unless it said something already
        return {}
    calls = 0

    def between() -> None:
        nonlocal calls
        calls += 1
        if calls > 200:  # 10 s of slices: the peer's end never showed
            raise TimeoutError("no end seen")

    try:
        lane.all_gather(rows, CAP, lengths, between)
    except tcp_lane.LanePeerGone as gone:
        return {"peer": gone.peer, "said": gone.said}
    finally:
        lane.close()
    return {"peer": None}


@pytest.mark.parametrize(("how", "said"), [("bye", "BYE"), ("failed", "FAILED timeout 2")])
def test_a_leaving_peer_is_seen_with_what_it_said(how: str, said: str) -> None:
    # World 2: rank 0 receives only from rank 1, so it must see rank 1's end.
    seen = run_ranks(_goodbye, 2, how, timeout=30.0)
    assert seen[0] == {"peer": 1, "said": said}, seen


def _exit_seen(ctx: RankContext, path: str) -> None:
    """Rank 1 exits silently; rank 0 records what the lane said."""
    lane = _connect(ctx)
    rows = memoryview(bytearray(2 * CAP))
    lengths = [1, 1]
    lane.all_gather(rows, CAP, lengths, lambda: None)
    if ctx.rank == 1:
        os._exit(0)
    try:
        lane.all_gather(rows, CAP, lengths, lambda: None)
    except tcp_lane.LanePeerGone as gone:
        with open(path, "w") as f:
            f.write(f"{gone.peer} {gone.said}")


def test_a_peer_that_dies_without_a_word_is_seen_as_gone(tmp_path: Any) -> None:
    path = str(tmp_path / "seen")
    with pytest.raises(RankFailure) as info:
        run_ranks(_exit_seen, 2, path, timeout=30.0, fresh=True)
    assert set(info.value.died) == {1}, str(info.value)
    with open(path) as f:
        assert f.read() == "1 None"


def _oversize(ctx: RankContext) -> str:
    lane = _connect(ctx)
    rows = memoryview(bytearray(2 * 4 * CAP))
    lengths = [0, 0]
    if ctx.rank == 1:  # rows four times larger than rank 0's: its block does not fit there
        lengths[1] = 3 * CAP
        lane.all_gather(rows, 4 * CAP, lengths, lambda: None)
        return "sent"
    small = memoryview(bytearray(2 * CAP))
    try:
        lane.all_gather(small, CAP, lengths, lambda: None)
    except tcp_lane.LaneProtocolError as exc:
        return str(exc)
    finally:
        lane.close()
    return "accepted"


def test_a_block_larger_than_a_row_is_refused() -> None:
    got = run_ranks(_oversize, 2, timeout=30.0)
    assert got[0] == f"rank 1 sent a block of {3 * CAP} B (at most {CAP} fit)", got


def _stray_then_connect(ctx: RankContext) -> int:
    """A stray client dials rank 0's listener before the real peer does: it is ignored."""
    if ctx.rank == 0:
        listener = tcp_lane.listen("127.0.0.1")
        port = listener.getsockname()[1]
        stray = socket.create_connection(("127.0.0.1", port))
        stray.sendall(b"HI wrong-token 1 0\n")
        ctx.store.set("lane/0", f"tok0 {port}")

        def address_of(r: int) -> tuple[str, int, str]:
            ctx.store.wait([f"lane/{r}"])
            theirs, p = ctx.store.get(f"lane/{r}").decode().split()
            return "127.0.0.1", int(p), theirs

        end = time.monotonic() + 20
        lane = tcp_lane.connect(listener, "tok0", 0, 2, address_of, end, lambda m: None)
        stray.close()
    else:
        lane = _connect(ctx)
    rows = memoryview(bytearray(2 * CAP))
    lengths = [2, 2]
    lane.all_gather(rows, CAP, lengths, lambda: None)
    lane.close()
    return lengths[1 - ctx.rank]


def test_a_stray_client_is_not_taken_for_a_peer() -> None:
    assert run_ranks(_stray_then_connect, 2, timeout=30.0) == [2, 2]


def _never_dialled(ctx: RankContext) -> str:
    """Rank 1 publishes its listener but never dials: rank 0's wait names it."""
    if ctx.rank == 1:
        listener = tcp_lane.listen("127.0.0.1")
        ctx.store.set("lane/1", f"tok1 {listener.getsockname()[1]}")
        ctx.store.wait(["done"])
        listener.close()
        return ""
    listener = tcp_lane.listen("127.0.0.1")
    ctx.store.set("lane/0", f"tok0 {listener.getsockname()[1]}")
    end = time.monotonic() + 1.0

    def address_of(r: int) -> tuple[str, int, str]:
        ctx.store.wait([f"lane/{r}"])
        theirs, p = ctx.store.get(f"lane/{r}").decode().split()
        return "127.0.0.1", int(p), theirs

    def between(missing: list[int]) -> None:
        if time.monotonic() > end:
            raise TimeoutError(f"ranks {missing} never dialled in")

    try:
        tcp_lane.connect(listener, "tok0", 0, 2, address_of, end, between)
    except TimeoutError as exc:
        return str(exc)
    finally:
        ctx.store.set("done", "1")
    return "connected"


def test_a_rank_that_never_dials_in_is_named() -> None:
    assert run_ranks(_never_dialled, 2, timeout=30.0)[0] == "ranks [1] never dialled in"
