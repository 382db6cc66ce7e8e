"""The tcp path's point-to-point engine (``transport/tcp/p2p.py``): real sockets, real
processes.

* Tags match in order per pair; a message that arrives before its receive waits, one
  whose receive is posted lands in place; a receive of the wrong size fails clearly.
* Two ranks that both send 8 MiB first, then receive, finish (the waiting thread also
  reads): no deadlock.
* A posted receive that no thread waits for is driven by the helper, so a peer's
  large synchronous send completes while this rank is busy elsewhere (through the
  communicator: an async recv, then a collective).
* A peer's goodbye and a peer that vanishes fail the receives waiting on it.
* Each frame carries the core its sender posted it from, the hello the sender's kernel:
  ``shares_core`` trusts a fresh frame on this kernel and otherwise asks the lane.  A
  dialler whose hello is not ``HI token rank kernel`` is closed, its frame never delivered.
* The read buffer: frames cut anywhere (one byte at a time, or many in one segment),
  frames larger than the buffer, receives posted before and after their message, a
  receive of the wrong size, and a goodbye cut in pieces, all from a raw socket that
  writes the wire format by hand.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import struct
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.harness import RankContext, RankFailure, run_ranks
from torchcomms import ReduceOp, new_comm
from torchcomms.transport import contention
from torchcomms.transport.tcp import lane as tcp_lane
from torchcomms.transport.tcp import p2p as tcp_p2p
from torchcomms.transport.tcp import wire
from torchcomms.transport.tcp.lane import LanePeerGone, LaneProtocolError
from torchcomms.transport.tcp.p2p import P2P, Transfer
from torchcomms.transport.tcp.ring import as_bytes


def _engine(ctx: RankContext) -> P2P:
    listener = tcp_lane.listen("127.0.0.1")
    token = f"p2p{ctx.rank}"
    ctx.store.set(f"p2p/{ctx.rank}", f"{token} {listener.getsockname()[1]}")

    def address_of(r: int) -> tuple[str, int, str]:
        ctx.store.wait([f"p2p/{r}"])
        theirs, port = ctx.store.get(f"p2p/{r}").decode().split()
        return "127.0.0.1", int(port), theirs

    return P2P(ctx.rank, listener, token, address_of)


def _deadline(seconds: float = 20.0):  # type: ignore[no-untyped-def]
    end = time.monotonic() + seconds

    def between() -> None:
        if time.monotonic() > end:
            raise TimeoutError("p2p wait gave up")

    return between


def _tags(ctx: RankContext) -> list[float]:
    eng = _engine(ctx)
    between = _deadline()
    if ctx.rank == 0:
        sends = [
            eng.post_send(1, tag, as_bytes(torch.full((4,), float(tag)))) for tag in (5, 7, 5, 9)
        ]
        eng.wait(sends, between)
        ctx.store.set("sent", "1")
        ctx.store.wait(["checked"])
        bad = eng.post_send(1, 11, as_bytes(torch.ones(8)))
        eng.wait([bad], between)
        ctx.store.wait(["done"])
        eng.close()
        return []
    ctx.store.wait(["sent"])  # every message is here (or on its way) before any recv
    got = {t: torch.zeros(4) for t in ("9", "5a", "7", "5b")}
    ops = [
        eng.post_recv(0, 9, as_bytes(got["9"])),
        eng.post_recv(0, 5, as_bytes(got["5a"])),
        eng.post_recv(0, 7, as_bytes(got["7"])),
        eng.post_recv(0, 5, as_bytes(got["5b"])),
    ]
    eng.wait(ops, between)
    ctx.store.set("checked", "1")
    small = torch.zeros(4)
    op = eng.post_recv(0, 11, as_bytes(small))
    try:
        eng.wait([op], between)
        raise AssertionError("a receive of the wrong size succeeded")
    except LaneProtocolError as exc:
        assert "16 B" in str(exc) and "32 B" in str(exc), exc
    ctx.store.set("done", "1")
    eng.close()
    return [float(got[k][0]) for k in ("9", "5a", "7", "5b")]


def test_tags_match_in_order_and_sizes_are_checked() -> None:
    assert run_ranks(_tags, 2, timeout=60)[1] == [9.0, 5.0, 7.0, 5.0]


def _both_send_first(ctx: RankContext) -> bool:
    eng = _engine(ctx)
    peer = 1 - ctx.rank
    mine = torch.full((1 << 21,), float(ctx.rank))  # 8 MiB: far past any socket buffer
    got = torch.zeros(1 << 21)
    eng.wait([eng.post_send(peer, 0, as_bytes(mine))], _deadline())
    eng.wait([eng.post_recv(peer, 0, as_bytes(got))], _deadline())
    ctx.store.set(f"done/{ctx.rank}", "1")
    ctx.store.wait(["done/0", "done/1"])
    eng.close()
    return bool(torch.equal(got, torch.full((1 << 21,), float(peer))))


def test_two_ranks_that_both_send_first_finish() -> None:
    assert run_ranks(_both_send_first, 2, timeout=60) == [True, True]


def _two_posting_threads(ctx: RankContext) -> bool:
    """Sends go out when posted unless one is queued ahead: two threads posting to one
    peer (one connection), with 8 MiB messages that go out in parts, keep frames whole."""
    eng = _engine(ctx)
    big = 1 << 21
    if ctx.rank == 0:
        sends: list[list[tuple[Transfer, torch.Tensor]]] = [[], []]

        def post(thread: int) -> None:
            for i in range(100):
                if thread == 1 and i % 20 == 10:  # 5 large ones, each sent in parts
                    payload = torch.full((big,), 7.0)
                    sends[1].append((eng.post_send(1, 99, as_bytes(payload)), payload))
                t = torch.full((4,), float(thread * 1000 + i))
                sends[thread].append((eng.post_send(1, 10 + thread, as_bytes(t)), t))

        threads = [threading.Thread(target=post, args=(k,)) for k in (0, 1)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        eng.wait([op for pair in sends for op, _ in pair], _deadline(60))
        ctx.store.wait(["received"])
        eng.close()
        return True
    small = {k: [torch.zeros(4) for _ in range(100)] for k in (0, 1)}
    got_big = [torch.zeros(big) for _ in range(5)]
    ops = [eng.post_recv(0, 10 + k, as_bytes(t)) for k in (0, 1) for t in small[k]]
    ops += [eng.post_recv(0, 99, as_bytes(t)) for t in got_big]
    eng.wait(ops, _deadline(60))
    ctx.store.set("received", "1")
    eng.close()
    in_order = all(
        float(t[0]) == k * 1000 + i and bool(torch.all(t == t[0]))
        for k in (0, 1)
        for i, t in enumerate(small[k])
    )
    return in_order and all(bool(torch.all(t == 7.0)) for t in got_big)


def test_sends_posted_by_two_threads_keep_whole_frames_in_order() -> None:
    assert run_ranks(_two_posting_threads, 2, timeout=90) == [True, True]


def _post_during_a_partial_send(ctx: RankContext) -> bool:
    """The race made certain: another send is posted while an 8 MiB one is in ``sendmsg``
    (the socket takes part of it).  The partial send must stay at the head of the queue."""
    eng = _engine(ctx)
    big = 1 << 21
    if ctx.rank == 0:
        payload, small = torch.full((big,), 7.0), torch.full((4,), 3.0)
        real = tcp_p2p.send_some
        posted: list[Transfer] = []

        def send_some_while_another_posts(sock, parts):  # type: ignore[no-untyped-def]
            if not posted and sum(len(p) for p in parts) > big:
                posted.append(eng.post_send(1, 11, as_bytes(small)))  # as another thread would
            return real(sock, parts)

        tcp_p2p.send_some = send_some_while_another_posts  # type: ignore[assignment]
        try:
            first = eng.post_send(1, 99, as_bytes(payload))
        finally:
            tcp_p2p.send_some = real
        eng.wait([first, *posted], _deadline(60))
        ctx.store.wait(["received"])
        eng.close()
        return len(posted) == 1
    got_big, got_small = torch.zeros(big), torch.zeros(4)
    ops = [eng.post_recv(0, 99, as_bytes(got_big)), eng.post_recv(0, 11, as_bytes(got_small))]
    eng.wait(ops, _deadline(60))
    ctx.store.set("received", "1")
    eng.close()
    return bool(torch.all(got_big == 7.0)) and bool(torch.all(got_small == 3.0))


def test_a_send_posted_during_a_partial_send_is_not_lost() -> None:
    assert run_ranks(_post_during_a_partial_send, 2, timeout=90) == [True, True]


def _busy_receiver(ctx: RankContext) -> bool:
    comm = new_comm("gloo", torch.device("cpu"), name="busy", store=ctx.store,
                    hints={"transport": "tcp"})  # fmt: skip
    big = 1 << 21  # 8 MiB
    if ctx.rank == 0:
        got = torch.zeros(big)
        work = comm.recv(got, 1, True)  # posted; nobody waits for it until the end
        t = torch.ones(4)
        comm.all_reduce(t, ReduceOp.SUM, False)  # rank 1 gets here only once its send is done
        work.wait()
        ok = bool(torch.equal(got, torch.full((big,), 3.0))) and float(t[0]) == 2.0
    else:
        comm.send(torch.full((big,), 3.0), 0, False)
        t = torch.ones(4)
        comm.all_reduce(t, ReduceOp.SUM, False)
        ok = float(t[0]) == 2.0
    comm.finalize()
    return ok


def test_a_posted_receive_progresses_while_its_rank_is_elsewhere() -> None:
    assert run_ranks(_busy_receiver, 2, timeout=60) == [True, True]


def _goodbyes(ctx: RankContext, report: str) -> str:
    eng = _engine(ctx)
    if ctx.rank == 1:
        eng.wait([eng.post_send(0, 0, as_bytes(torch.ones(1)))], _deadline())
        ctx.store.wait(["first"])
        eng.goodbye("FAILED dead 2")
        ctx.store.wait(["second"])
        eng.close()
        return ""
    if ctx.rank == 2:
        eng.wait([eng.post_send(0, 0, as_bytes(torch.ones(1)))], _deadline())
        ctx.store.wait(["first"])
        os._exit(0)  # gone without a word (the harness replaces the worker)
    one, two = torch.zeros(1), torch.zeros(1)
    eng.wait([eng.post_recv(1, 0, as_bytes(one)), eng.post_recv(2, 0, as_bytes(two))], _deadline())
    ctx.store.set("first", "1")
    seen = []
    for peer in (1, 2):
        try:
            eng.wait([eng.post_recv(peer, 0, as_bytes(one))], _deadline())
            seen.append("returned")
        except LanePeerGone as gone:
            seen.append(f"{gone.peer}:{gone.said}")
    ctx.store.set("second", "1")
    eng.close()
    Path(report).write_text(" ".join(seen))
    return " ".join(seen)


def test_a_goodbye_or_a_vanished_peer_fails_the_receive(tmp_path: Path) -> None:
    report = tmp_path / "rank0.txt"
    with pytest.raises(RankFailure) as info:  # rank 2 vanishes (os._exit)
        run_ranks(_goodbyes, 3, str(report), timeout=60)
    assert set(info.value.died) == {2}, str(info.value)
    assert report.read_text() == "1:FAILED dead 2 2:None"


def test_a_send_to_a_listener_that_is_gone_fails_naming_the_peer() -> None:
    """The dial is refused (nothing listens there any more): the send fails, it does not
    hang or pretend to have sent."""
    closed = tcp_lane.listen("127.0.0.1")
    port = closed.getsockname()[1]
    closed.close()
    mine = tcp_lane.listen("127.0.0.1")
    eng = P2P(0, mine, "tok", lambda r: ("127.0.0.1", port, "theirs"))
    op = eng.post_send(3, 0, as_bytes(torch.ones(4)))
    with pytest.raises(LanePeerGone) as info:
        eng.wait([op], _deadline(5.0))
    assert info.value.peer == 3 and info.value.said is None
    eng.close()


def test_a_send_on_a_connection_the_peer_reset_fails_naming_the_peer() -> None:
    """The peer accepted, then vanished (a reset): a send posted afterwards fails where it
    is sent, at post time, naming the peer; it never reports success."""
    srv = tcp_lane.listen("127.0.0.1")
    port = srv.getsockname()[1]
    mine = tcp_lane.listen("127.0.0.1")
    eng = P2P(0, mine, "tok", lambda r: ("127.0.0.1", port, "theirs"))
    first = eng.post_send(3, 0, as_bytes(torch.ones(4)))  # dials, goes out when posted
    assert first.done and first.error is None
    conn, _ = srv.accept()
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()  # linger 0: the peer's end sends a reset
    srv.close()
    outcomes = []
    for _ in range(200):  # until the reset has arrived; each send is sent at once
        op = eng.post_send(3, 0, as_bytes(torch.ones(4)))
        outcomes.append(op.error)
        if op.error is not None:
            break
        time.sleep(0.01)
    assert isinstance(outcomes[-1], LanePeerGone), outcomes
    assert outcomes[-1].peer == 3 and outcomes[-1].said is None
    with pytest.raises(LanePeerGone):
        eng.wait([op], _deadline(5.0))
    eng.close()


def _frame(tag: int, payload: bytes, core: int = -1) -> bytes:
    return struct.pack("<Qqi", len(payload), tag, core) + payload


def _dialled_engine() -> tuple[P2P, socket.socket]:
    """An engine, and a raw socket dialled into it as rank 5 (its hello sent)."""
    listener = tcp_lane.listen("127.0.0.1")
    eng = P2P(0, listener, "tok", lambda r: ("127.0.0.1", 1, "unused"))
    raw = socket.create_connection(listener.getsockname())
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    raw.sendall(b"HI tok 5 0\n")  # kernel 0: not said
    return eng, raw


def _write_in_pieces(raw: socket.socket, data: bytes, sizes: list[int]) -> threading.Thread:
    """Write ``data`` in pieces of the given sizes (cycled), a short pause after each."""

    def run() -> None:
        at, i = 0, 0
        while at < len(data):
            step = sizes[i % len(sizes)]
            raw.sendall(data[at : at + step])
            at, i = at + step, i + 1
            time.sleep(0.0005)

    writer = threading.Thread(target=run, daemon=True)
    writer.start()
    return writer


@pytest.mark.parametrize("cut", ["bytewise", "random", "whole"])
def test_frames_cut_anywhere_arrive_whole_and_in_order(cut: str) -> None:
    rng = random.Random(7)
    big = wire.READ_BUF  # larger than the buffer: read straight into place
    sizes = [0, 1, 8, 100, 4096, big - 16, big - 15, big + 1, 3 * big + 5, 16, 7, 0, 65]
    if cut == "bytewise":
        sizes = [s for s in sizes if s < 300]  # a byte at a time: keep it short
    payloads = [bytes(rng.randrange(256) for _ in range(n)) for n in sizes]
    tags = [i % 3 for i in range(len(sizes))]  # repeated tags: order within a tag
    stream = b"".join(_frame(t, p) for t, p in zip(tags, payloads, strict=True))
    pieces = {
        "bytewise": [1],
        "random": [rng.randrange(1, 9000) for _ in range(50)],
        "whole": [len(stream)],
    }
    eng, raw = _dialled_engine()
    # Half the receives are posted before anything is sent, half once all of it is here.
    bufs = [bytearray(n) for n in sizes]
    half = len(sizes) // 2
    ops = [eng.post_recv(5, tags[i], memoryview(bufs[i])) for i in range(half)]
    writer = _write_in_pieces(raw, stream, pieces[cut])
    eng.wait(ops, _deadline())
    writer.join(20)
    time.sleep(0.05)
    ops += [eng.post_recv(5, tags[i], memoryview(bufs[i])) for i in range(half, len(sizes))]
    eng.wait(ops, _deadline())
    for i, (got, want) in enumerate(zip(bufs, payloads, strict=True)):
        assert bytes(got) == want, (cut, i, sizes[i])
    raw.close()
    eng.close()


def test_a_receive_of_the_wrong_size_fails_and_the_message_waits_for_the_next() -> None:
    eng, raw = _dialled_engine()
    wrong = eng.post_recv(5, 4, memoryview(bytearray(3)))
    raw.sendall(_frame(4, b"abcdefgh"))
    with pytest.raises(
        LaneProtocolError, match="a receive of 3 B from rank 5 met a message of 8 B"
    ):
        eng.wait([wrong], _deadline())
    right = bytearray(8)
    eng.wait([eng.post_recv(5, 4, memoryview(right))], _deadline())
    assert bytes(right) == b"abcdefgh"
    raw.close()
    eng.close()


def test_a_goodbye_cut_in_pieces_fails_the_receive_with_its_text() -> None:
    eng, raw = _dialled_engine()
    op = eng.post_recv(5, 0, memoryview(bytearray(4)))
    text = b"FAILED dead 1,2"
    frame = struct.pack("<Qqi", (1 << 64) - 1, 0, -1) + struct.pack("<I", len(text)) + text
    writer = _write_in_pieces(raw, frame, [3, 5, 1, 13, 2])
    with pytest.raises(LanePeerGone) as info:
        eng.wait([op], _deadline())
    writer.join(20)
    assert info.value.peer == 5 and info.value.said == text.decode()
    raw.close()
    eng.close()


def _learned_core(ctx: RankContext) -> list[int]:
    """What rank 1's engine learned of rank 0 from its hello and one frame."""
    eng = _engine(ctx)
    if ctx.rank == 0:
        eng.wait([eng.post_send(1, 0, as_bytes(torch.ones(4)))], _deadline())
        ctx.store.wait(["read"])
        eng.close()
        return []
    eng.wait([eng.post_recv(0, 0, as_bytes(torch.zeros(4)))], _deadline())
    ctx.store.set("read", "1")
    conn = eng._in_from[0]
    eng.close()
    return [conn.core, int(conn.kernel == contention.KERNEL_ID)]


def test_frames_carry_the_senders_core_and_the_hello_its_kernel() -> None:
    core, same_kernel = run_ranks(_learned_core, 2, timeout=60)[1]
    assert same_kernel == 1 and 0 <= core < (os.cpu_count() or 1), (core, same_kernel)


def test_a_peer_shares_the_core_only_by_a_fresh_frame_from_it_on_this_kernel() -> None:
    """``P2P.shares_core``: the peer's last frame named this thread's core, on this kernel,
    within ``CORES_FRESH_S``; otherwise it asks the lane (the collectives' headers)."""
    here = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {here[0]})  # this thread's core is known: here[0]
    try:
        for kernel, core, want in [
            (contention.KERNEL_ID, here[0], True),
            (contention.KERNEL_ID, here[0] + 1, False),  # another core
            (contention.KERNEL_ID, -1, False),  # the sender could not tell
            (contention.KERNEL_ID ^ 1, here[0], False),  # another host's kernel
        ]:
            listener = tcp_lane.listen("127.0.0.1")
            eng = P2P(0, listener, "tok", lambda r: ("127.0.0.1", 1, "unused"))
            eng.lane_shares_core = lambda peer: peer == 5
            assert eng.shares_core(5)  # nothing from the peer yet: the lane's answer
            raw = socket.create_connection(listener.getsockname())
            raw.sendall(f"HI tok 5 {kernel}\n".encode() + _frame(0, b"abcd", core))
            eng.wait([eng.post_recv(5, 0, memoryview(bytearray(4)))], _deadline())
            assert eng.shares_core(5) is want, (kernel, core)
            time.sleep(tcp_lane.CORES_FRESH_S * 1.5)
            assert eng.shares_core(5)  # stale: the lane's answer again
            raw.close()
            eng.close()
    finally:
        os.sched_setaffinity(0, here)


def test_a_dialler_whose_hello_is_not_ours_is_closed_and_never_delivered() -> None:
    """The listener reads ``HI token rank kernel``: a wrong token, the hello of an older wire
    (no kernel) or a kernel that is not a number closes the connection, and its frame
    reaches no receive; a right hello from the same rank is delivered."""
    listener = tcp_lane.listen("127.0.0.1")
    eng = P2P(0, listener, "tok", lambda r: ("127.0.0.1", 1, "unused"))
    got = bytearray(4)
    op = eng.post_recv(5, 0, memoryview(got))
    strays = []
    for hello_line in (b"HI other 5 0\n", b"HI tok 5\n", b"HI tok 5 x\n"):
        raw = socket.create_connection(listener.getsockname())
        raw.sendall(hello_line + _frame(0, b"bad!"))
        strays.append(raw)
    for raw in strays:  # the engine accepts (and closes) them while it waits
        with pytest.raises(TimeoutError):
            eng.wait([op], _deadline(0.3))
        raw.settimeout(5.0)
        # closed with our frame unread: an end of stream, or a reset
        with contextlib.suppress(ConnectionResetError):
            assert raw.recv(16) == b"", "a stray connection was sent something"
        raw.close()
    assert not op.done and bytes(got) == bytes(4)
    good = socket.create_connection(listener.getsockname())
    good.sendall(b"HI tok 5 0\n" + _frame(0, b"good"))
    eng.wait([op], _deadline())
    assert bytes(got) == b"good"
    good.close()
    eng.close()
