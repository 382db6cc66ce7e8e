"""The tcp path's lane (``transport/tcp/lane.py``): real sockets between real processes.

* Bruck's all_gather at worlds 1-4 (not only powers of two) with blocks of different
  lengths, many times over the same connections, byte for byte.
* Goodbyes: a peer that says ``BYE`` or ``FAILED …`` and one that dies without a word are
  told apart by the ranks that wait on it.
* A peer that sends a block larger than a row is refused (``LaneProtocolError``), never
  written past the row.
* Connecting: a stray client on the listener is ignored; a rank that never dials in is
  named when the wait gives up.
* A wait spins only briefly while every core is taken (``transport.contention``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from tests.harness import RankContext, RankFailure, run_ranks
from torchcomms.transport.tcp import lane as tcp_lane
from torchcomms.transport.tcp import meet as tcp_meet

CAP = 64


def _card(token: str, listener: socket.socket) -> str:
    return f"{token} {listener.getsockname()[1]}"


def _address(card: str) -> tuple[str, int, str]:
    token, port = card.split()
    return "127.0.0.1", int(port), token


def _connect(ctx: RankContext, timeout_s: float = 20.0) -> tcp_lane.Lane:
    """A lane over the task's store, the way ``cpu.select.connect_lane`` builds one: each
    rank reads only its successor's card from the store."""
    store = ctx.store
    listener = tcp_lane.listen("127.0.0.1")
    token = f"tok{ctx.rank}"
    card = _card(token, listener)
    store.set(f"lane/{ctx.rank}", card)
    successor = f"lane/{(ctx.rank + 1) % ctx.world_size}"
    store.wait([successor])
    end = time.monotonic() + timeout_s

    def between(missing: list[int]) -> None:
        if time.monotonic() > end:
            raise TimeoutError(f"never connected: {missing}")

    return tcp_meet.connect(
        listener,
        token,
        ctx.rank,
        ctx.world_size,
        card,
        store.get(successor).decode(),
        _address,
        end,
        between,
    )


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


def _reset_while_receiving(ctx: RankContext) -> dict[str, Any]:
    """Rank 1 resets (RST) the connection rank 0 sends on, while rank 0 waits to receive on
    the other one: rank 0 must see it at once, with the cause, not at its deadline."""
    lane = _connect(ctx)
    rows = memoryview(bytearray(2 * CAP))
    lengths = [1, 1]
    lane.all_gather(rows, CAP, lengths, lambda: None)
    ctx.store.set(f"synced{ctx.rank}", "1")
    ctx.store.wait(["synced0", "synced1"])
    if ctx.rank == 1:
        time.sleep(0.3)  # rank 0 is in its wait by now
        inbox = lane.ring_round().inbox.sock  # rank 0's out, seen from here
        inbox.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        inbox.close()
        ctx.store.wait(["seen0"])  # alive until rank 0 reported: a reset, not a death
        return {}
    start = time.monotonic()
    slices = 0

    def between() -> None:
        nonlocal slices
        slices += 1
        if slices > 200:  # 10 s: the reset was never seen
            raise TimeoutError("the reset was not seen")

    try:
        lane.all_gather(rows, CAP, lengths, between)
    except tcp_lane.LanePeerGone as gone:
        return {"peer": gone.peer, "said": gone.said, "cause": gone.cause,
                "s": time.monotonic() - start}  # fmt: skip
    finally:
        ctx.store.set("seen0", "1")
    return {"peer": None}


def test_a_reset_of_the_sending_connection_is_seen_while_receiving() -> None:
    seen = run_ranks(_reset_while_receiving, 2, timeout=30.0)[0]
    assert seen["peer"] == 1 and seen["said"] is None, seen
    assert seen["cause"].startswith("ECONNRESET"), seen
    assert seen["s"] < 2.0, seen  # the first poll after the reset, not a deadline


def test_data_sockets_carry_keepalive_and_a_user_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchcomms import config
    from torchcomms.transport.tcp.sockets import data_socket

    listener = socket.create_server(("127.0.0.1", 0))
    with listener, socket.create_connection(listener.getsockname()) as sock:
        monkeypatch.setenv("TORCHCOMM_TCP_USER_TIMEOUT_S", "7.5")
        monkeypatch.setenv("TORCHCOMM_TCP_KEEPALIVE_S", "10")
        data_socket(sock)
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 7500
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 10
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 2
    monkeypatch.delenv("TORCHCOMM_TCP_USER_TIMEOUT_S")
    monkeypatch.delenv("TORCHCOMM_TCP_KEEPALIVE_S")
    assert (config.tcp_user_timeout_s(), config.tcp_keepalive_s()) == (30.0, 5.0)
    for name in ("TORCHCOMM_TCP_USER_TIMEOUT_S", "TORCHCOMM_TCP_KEEPALIVE_S"):
        for bad, why in (("soon", "expected seconds"), ("-1", "must be >= 0")):
            monkeypatch.setenv(name, bad)
            with pytest.raises(ValueError, match=f"{name}: {bad!r} \\({why}"):
                (config.tcp_user_timeout_s if "USER" in name else config.tcp_keepalive_s)()
        monkeypatch.setenv(name, "0")  # off: the kernel's own behaviour
        assert (config.tcp_user_timeout_s if "USER" in name else config.tcp_keepalive_s)() == 0


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
        stray = socket.create_connection(listener.getsockname())
        stray.sendall(b"HI wrong-token 1 0 card\n")
        ctx.store.set("lane/0", _card("tok0", listener))
        ctx.store.wait(["lane/1"])
        successor = ctx.store.get("lane/1").decode()
        end = time.monotonic() + 20
        lane = tcp_meet.connect(
            listener, "tok0", 0, 2, _card("tok0", listener), successor, _address, end, print
        )
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
    listener = tcp_lane.listen("127.0.0.1")
    ctx.store.set(f"lane/{ctx.rank}", _card(f"tok{ctx.rank}", listener))
    if ctx.rank == 1:
        ctx.store.wait(["done"])
        listener.close()
        return ""
    end = time.monotonic() + 1.0

    def between(missing: list[int]) -> None:
        if time.monotonic() > end:
            raise TimeoutError(f"ranks {missing} never dialled in")

    ctx.store.wait(["lane/1"])
    successor = ctx.store.get("lane/1").decode()
    try:
        tcp_meet.connect(
            listener, "tok0", 0, 2, _card("tok0", listener), successor, _address, end, between
        )
    except TimeoutError as exc:
        return str(exc)
    finally:
        ctx.store.set("done", "1")
    return "connected"


def test_a_rank_that_never_dials_in_is_named() -> None:
    assert run_ranks(_never_dialled, 2, timeout=30.0)[0] == "ranks [1] never dialled in"


def _meet_on_threads(size: int, quiet: int | None = None) -> list[Any]:
    """``size`` ranks meet on threads of this process, each told only its successor's card;
    ``quiet``: a rank that listens but closes every connection it gets, unanswered.
    Returns each rank's lane (or the error it raised)."""
    listeners = [tcp_lane.listen("127.0.0.1") for _ in range(size)]
    cards = [_card(f"tok{r}", sock) + " and more words" for r, sock in enumerate(listeners)]
    out: list[Any] = [None] * size
    end = time.monotonic() + 20.0

    def between(missing: list[int]) -> None:
        if time.monotonic() > end:
            raise TimeoutError(f"never connected: {missing}")

    def address(card: str) -> tuple[str, int, str]:
        token, port, *_ = card.split()
        return "127.0.0.1", int(port), token

    def run(r: int) -> None:
        if r == quiet:
            listeners[r].settimeout(5.0)
            with contextlib.suppress(OSError):
                conn, _ = listeners[r].accept()
                conn.recv(4096)
                conn.close()
            listeners[r].close()
            return
        try:
            out[r] = tcp_meet.connect(
                listeners[r],
                f"tok{r}",
                r,
                size,
                cards[r],
                cards[(r + 1) % size],
                address,
                end,
                between,
            )
        except Exception as exc:  # reported to the test
            out[r] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30.0)
    return [*out, cards]


@pytest.mark.parametrize("size", [2, 5, 8, 13])
def test_each_rank_learns_every_lane_neighbours_card_from_its_successors_alone(size: int) -> None:
    """Pointer doubling: told only r + 1's card, rank r ends up holding the card of every
    r +- 2^j (exactly those), and the lane it built gathers correctly."""
    *lanes, cards = _meet_on_threads(size)
    for r, lane in enumerate(lanes):
        assert isinstance(lane, tcp_lane.Lane), (r, lane)
        near = {p for pair in tcp_lane.rounds(r, size) for p in pair}
        assert lane.cards == {p: cards[p] for p in near}, (r, lane.cards)
    got: list[Any] = [None] * size

    def gather(r: int) -> None:
        rows = memoryview(bytearray(size * CAP))
        mine = _block(r, 1)
        rows[r * CAP : r * CAP + len(mine)] = mine
        lengths = [0] * size
        lengths[r] = len(mine)
        lanes[r].all_gather(rows, CAP, lengths, lambda: None)
        got[r] = [bytes(rows[p * CAP : p * CAP + lengths[p]]) for p in range(size)]
        lanes[r].close()

    threads = [threading.Thread(target=gather, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30.0)
    assert got == [[_block(p, 1) for p in range(size)]] * size


def test_a_peer_that_hangs_up_unanswered_is_named_by_who_dialled_it() -> None:
    """Rank 2 of 4 takes a dial and closes it without an answer: rank 1, which dialled
    it, raises naming it; nobody connects, and nobody hangs."""
    *lanes, _ = _meet_on_threads(4, quiet=2)
    assert isinstance(lanes[1], ConnectionError), lanes
    assert str(lanes[1]) == "rank 2 closed the connection before answering"
    assert not any(isinstance(lane, tcp_lane.Lane) for lane in lanes), lanes


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        (b"NO thanks\n", "rank 1 answered 'NO thanks', not AT"),
        (b"x" * tcp_meet.LINE_MAX, "rank 1 answered with no line end"),
        (None, "rank 1 broke the connection before answering"),  # a reset
    ],
)
def test_a_peer_that_answers_other_than_at_is_named(answer: bytes | None, said: str) -> None:
    """Rank 0 dials rank 1, which takes the HI and answers something else (or resets the
    connection): rank 0 raises naming it, and connects nothing."""
    theirs = tcp_lane.listen("127.0.0.1")
    mine = tcp_lane.listen("127.0.0.1")

    def peer() -> None:
        conn, _ = theirs.accept()
        with conn:
            conn.settimeout(10.0)
            assert conn.recv(4096).startswith(b"HI tok1 0 0 ")
            if answer is None:  # close at once with a reset, not a goodbye
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return
            conn.sendall(answer)
            with contextlib.suppress(OSError):
                conn.recv(1)  # until rank 0 hangs up

    thread = threading.Thread(target=peer)
    thread.start()
    end = time.monotonic() + 20.0

    def between(missing: list[int]) -> None:
        if time.monotonic() > end:
            raise TimeoutError(f"never connected: {missing}")

    try:
        with pytest.raises(ConnectionError) as info:
            tcp_meet.connect(
                mine,
                "tok0",
                0,
                2,
                _card("tok0", mine),
                _card("tok1", theirs),
                _address,
                end,
                between,
            )
    finally:
        thread.join(20.0)
        theirs.close()
    assert str(info.value) == said


def test_waits_spin_briefly_while_every_core_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """``transport.contention``: with more spinning processes than this process's cores,
    the run queue says the cores are busy, and a lane that may spin spins only
    ``BUSY_SPIN_S``, or not at all for a peer that needs this core (a lane that may not
    spin never does)."""
    from torchcomms.transport import contention

    lane = tcp_lane.Lane(0, 1, [], [], spin_s=tcp_lane.SPIN_S)
    still = tcp_lane.Lane(0, 1, [], [], spin_s=0.0)
    affinity = os.sched_getaffinity(0)
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(len(os.sched_getaffinity(0)) + 1)
    ]
    try:
        seen = False
        give_up = time.monotonic() + 10.0
        while not seen and time.monotonic() < give_up:
            time.sleep(contention.REFRESH_S)
            seen = contention.cores_busy()
        assert seen, "the run queue never showed the spinning processes"
        assert lane.spin_budget() == tcp_lane.BUSY_SPIN_S
        assert still.spin_budget() == 0.0
        # A peer that last sent from the core this thread runs on, on this kernel (this
        # host, or a network namespace of it) needs that core: no spin at all.  On another
        # core, or from another kernel (another host), the short spin.
        me = contention.current_cpu()
        assert me >= 0
        os.sched_setaffinity(0, {me})
        kernel = contention.KERNEL_ID
        assert kernel != 0
        lane.peer_cores([-1, me, me + 1, me], [kernel, kernel, kernel, kernel ^ 1])
        assert lane.spin_budget(1) == tcp_lane.BUSY_SPIN_S  # not heard yet
        lane.heard_cores()
        assert lane.spin_budget(1) == 0.0
        assert lane.spin_budget(2) == tcp_lane.BUSY_SPIN_S
        assert lane.spin_budget(3) == tcp_lane.BUSY_SPIN_S
        assert lane.spin_budget(0) == tcp_lane.BUSY_SPIN_S  # never heard from: unknown
        assert still.spin_budget(1) == 0.0
        time.sleep(tcp_lane.CORES_FRESH_S * 1.5)  # stale: the scheduler may have moved it
        assert lane.spin_budget(1) == tcp_lane.BUSY_SPIN_S
        lane.heard_cores()
        assert lane.spin_budget(1) == 0.0
        # Where the core cannot be known (no sched_getcpu: -1 on both sides), it is not shared.
        monkeypatch.setattr(contention, "current_cpu", lambda: -1)
        lane.peer_cores([-1, -1], [kernel, kernel])
        lane.heard_cores()
        assert lane.spin_budget(1) == tcp_lane.BUSY_SPIN_S
        # Where this kernel's boot id could not be read, no peer counts as sharing a core.
        monkeypatch.setattr(contention, "current_cpu", lambda: me)
        lane.peer_cores([-1, me], [0, 0])
        lane.heard_cores()
        assert lane.spin_budget(1) == tcp_lane.BUSY_SPIN_S
        monkeypatch.setattr(contention, "KERNEL_ID", 0)
        assert lane.spin_budget(1) == tcp_lane.BUSY_SPIN_S
        lane.peer_cores([-1, me], [kernel, kernel])  # the peer knows its kernel, this rank not
        lane.heard_cores()
        assert lane.spin_budget(1) == tcp_lane.BUSY_SPIN_S
    finally:
        os.sched_setaffinity(0, affinity)
        for hog in hogs:
            hog.kill()
            hog.wait()


def test_a_run_queue_that_cannot_be_read_counts_as_busy() -> None:
    """Where ``/proc/loadavg`` cannot be read (here: its descriptor closed under it), the
    cores count as busy, so waits keep the short spin; the next reading opens it again."""
    from torchcomms.transport import contention

    contention._checked = -1.0
    contention.cores_busy()  # opens the descriptor
    fd = contention._fd
    assert fd is not None
    os.close(fd)
    contention._checked = -1.0
    assert contention.cores_busy() is True
    assert contention._fd is None
    contention._checked = -1.0
    contention.cores_busy()
    assert contention._fd is not None and contention._fd >= 0
    os.pread(contention._fd, 1, 0)  # a live descriptor again
