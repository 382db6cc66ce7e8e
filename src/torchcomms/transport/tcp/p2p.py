"""``P2P``: point-to-point messages over direct TCP connections, dialled on first use.

Why not gloo: a gloo send/recv work never reports completion without a blocking
``wait()``, and a timed wait closes the pair, so each gloo p2p wait needs a helper
thread; those hand-offs cost 100-200 µs per message on a small VM.  Here the thread
that waits moves the bytes itself.

**Connections.**  Rank ``a`` sends to ``b`` over a connection ``a`` dialled to ``b``'s
listener (``HI token rank kernel``), made the first time ``a`` sends to ``b``: a job whose ranks
talk to two neighbours holds four sockets per rank, not ``2 (n-1)``.  The kernel
completes the handshake even before ``b`` accepts, so a send never waits for the
receiver to be in a call.

**Frames.**  ``u64 length``, ``i64 tag``, ``i32 core`` (the sender's, for
``shares_core``), then the payload; a length of ``2**64 - 1``
starts a goodbye (``u32 length`` + text).  Messages of one pair and tag match in order;
a message that arrives before its receive is posted waits in a per-peer queue (one
copy).  Each connection is read into a buffer of ``READ_BUF`` bytes, so one ``recv``
takes every small frame that has arrived (a ``recv`` costs ~3 us here, raising
``EAGAIN`` included); a frame that does not fit is read straight into its receive's
tensor once its head is in.

**Progress.**  A send posted with nothing queued ahead of it on its connection, while no
thread drives, goes out at once (what the socket takes; the rest is queued first in line),
so a small message is done when ``post_send`` returns.  Otherwise whoever waits drives:
``wait(ops)`` sends and receives for every posted op (not only its own: so two ranks that
both send first never deadlock) until its ops are done, a spin first where allowed, then
``poll`` in slices with ``between`` (abort, liveness, deadline) after each idle one.  A
spin pass asks one persistent ``poll`` object (0.7 us) which connections have data,
and reads only those.
While ops are posted that no thread waits for (an async receive posted before a
collective), a helper thread drives in short slices, so a sender is never stuck behind a
receiver busy elsewhere.  One driver at a time (``_drive``); ``post_*`` may run on any
thread.
"""

from __future__ import annotations

import collections
import contextlib
import os
import select
import socket
import threading
import time
from collections.abc import Callable

from torchcomms.transport.contention import KERNEL_ID, cores_busy, current_cpu
from torchcomms.transport.tcp.lane import (  # the spins: as the lane's waits
    BUSY_SPIN_S,
    CORES_FRESH_S,
    SLICE_MS,
    SPIN_S,
    STREAM_BYTES,
    LanePeerGone,
    LaneProtocolError,
    broken,
    send_some,
    socket_error,
)
from torchcomms.transport.tcp.sockets import data_socket
from torchcomms.transport.tcp.wire import (
    GOODBYE,
    HEAD,
    READ_BUF,
    InConn,
    OutConn,
    Transfer,
    all_done,
    deliver,
    goodbye_frame,
    hello,
    read_goodbye,
)

__all__ = ["P2P", "SPIN_S", "Transfer"]

_IN = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP
#: How long the helper thread drives before it lets a waiting thread take over.
_HELPER_SLICE_MS = 5
#: How long posted ops wait for a thread of their own before the helper drives them.
_HELPER_GRACE_S = 0.002
#: How long ``close`` waits for the helper thread (it ends within a slice of a pass).
_CLOSE_WAIT_S = 1.0


class P2P:
    """The point-to-point engine of one rank of one communicator (module docstring)."""

    def __init__(
        self,
        rank: int,
        listener: socket.socket,
        token: str,
        address_of: Callable[[int], tuple[str, int, str]],
        spin_s: float = 0.0,
        yield_s: float = 0.0,
    ) -> None:
        self.rank = rank
        self._listener = listener
        listener.setblocking(False)
        self._token = token
        self._address_of = address_of
        self.spin_s = spin_s
        #: After the spin: how long passes alternate with ``sched_yield`` before a wait
        #: blocks in ``poll`` (ranks sharing cores: a peer on this core runs at once, and a
        #: reply does not pay a sleeping process's wake-up).
        self.yield_s = yield_s
        #: Whether a peer last sent from this thread's core, as the collectives' headers
        #: say (``Lane.shares_core``; set by the comm): asked when this engine's own frames
        #: from that peer say nothing fresh (``shares_core``).
        self.lane_shares_core: Callable[[int], bool] = lambda peer: False
        self._outs: dict[int, OutConn] = {}
        self._ins: dict[int, InConn] = {}  # by fd
        self._in_from: dict[int, InConn] = {}  # by peer
        self._posted: dict[int, collections.deque[Transfer]] = collections.defaultdict(
            collections.deque
        )
        self._early: dict[int, collections.deque[tuple[int, bytearray]]] = collections.defaultdict(
            collections.deque
        )
        self._gone: dict[int, LanePeerGone] = {}
        self._drive = threading.Lock()
        self._dialling = threading.Lock()
        self._lock = threading.Lock()  # the queues, against post_* from other threads
        self._pending = 0  # posted ops not done
        self._waiting = 0  # threads inside wait()
        self._closed = False
        self._wake = threading.Condition(threading.Lock())
        self._helper: threading.Thread | None = None
        self._said = False
        # The listener and every connection in (the driver's: spin passes ask it).
        self._readable = select.poll()
        self._readable.register(listener, select.POLLIN)

    # -- posting (any thread) --------------------------------------------------------------
    def post_send(self, peer: int, tag: int, view: memoryview, owner: object = None) -> Transfer:
        op = Transfer(peer, tag, view, owner)
        out = self._outs.get(peer)
        if out is None:
            with self._dialling:  # one connection per peer, whichever thread posts first
                out = self._outs.get(peer)
                if out is None:
                    try:
                        out = self._outs[peer] = OutConn(self._dial(peer))
                    except OSError:  # refused or reset: the peer's listener is gone
                        op.error, op.done = LanePeerGone(peer, None), True
                        return op
        if not out.queue and self._drive.acquire(blocking=False):
            # Nothing queued ahead of it and no other driver: send what the socket takes
            # now, here.  A small message then completes without a trip through ``wait``.
            try:
                if not out.queue:
                    if not self._send_now(out, op):
                        # Part of it went: it heads the queue (before any send another
                        # thread queued meanwhile), the rest in ``out.parts``.
                        with self._lock:
                            out.queue.appendleft(op)
                            self._pending += 1
                    return op
            finally:
                self._drive.release()
        with self._lock:
            out.queue.append(op)
            self._pending += 1
        return op

    def _send_now(self, out: OutConn, op: Transfer) -> bool:
        """Send ``op`` on ``out`` (queue empty, driver held): whether it is done (sent or
        failed); otherwise ``out.parts`` holds what is left of it, for ``_send_all``."""
        parts: list[memoryview | bytes] = [HEAD.pack(op.length, op.tag, current_cpu())]
        if op.length:
            parts.append(op.view)
        left = send_some(out.sock, parts)
        if left is None:  # the connection broke: the peer is gone, or the network broke it
            self._broken(op.peer, out)
            op.error, op.done = LanePeerGone(op.peer, None, socket_error(out.sock)), True
            return True
        if not left:
            op.done = True
            return True
        out.parts = [] if left is parts else left  # nothing sent: _send_all starts over
        return False

    def post_recv(self, peer: int, tag: int, view: memoryview, owner: object = None) -> Transfer:
        op = Transfer(peer, tag, view, owner)
        with self._lock:
            early = self._early.get(peer)
            if early:
                for i, (t, data) in enumerate(early):
                    if t == tag:
                        del early[i]
                        deliver(op, data)
                        return op
            gone = self._gone.get(peer)
            if gone is not None:
                op.error, op.done = gone, True
                return op
            self._posted[peer].append(op)
            self._pending += 1
        return op

    def _dial(self, peer: int) -> socket.socket:
        host, port, theirs = self._address_of(peer)
        sock = socket.create_connection((host, port), timeout=10.0)
        data_socket(sock)
        sock.sendall(f"HI {theirs} {self.rank} {KERNEL_ID}\n".encode())
        sock.setblocking(False)
        return sock

    # -- waiting ---------------------------------------------------------------------------
    def wait(self, ops: list[Transfer], between: Callable[[], None]) -> None:
        """Drive until every op of ``ops`` is done; raise the first one's error."""
        if not all_done(ops):  # (a send that went out when posted is done)
            self._drive_until(ops, between)
        for op in ops:
            if op.error is not None:
                raise op.error

    def _drive_until(self, ops: list[Transfer], between: Callable[[], None]) -> None:
        """Move every posted op, one driver at a time, until ``ops`` are done.  The drive
        lock is held through a spin (a pass is then one ``poll``) and released after each
        blocking slice, so another thread's wait or the helper can take over."""
        counted = self._helper is not None  # only the helper reads ``_waiting``
        if counted:
            with self._wake:
                self._waiting += 1
        try:
            while not all_done(ops):
                if not self._drive.acquire(timeout=SLICE_MS / 1000):
                    between()
                    continue
                try:
                    self._drive_slice(ops, between)
                finally:
                    self._drive.release()
        finally:
            if counted:
                with self._wake:
                    self._waiting -= 1
                    self._wake.notify()

    def _drive_slice(self, ops: list[Transfer], between: Callable[[], None]) -> None:
        """(driver) Spin while ``spin_s`` allows, yield while ``yield_s`` allows, then
        block in ``poll`` for one slice."""
        idle_since = 0.0
        spin_s = -1.0  # asked the first time nothing moved
        while True:
            moved = self._progress(0)
            if all_done(ops):
                return
            if moved:
                idle_since = 0.0
                continue
            now = time.perf_counter()
            if not idle_since:
                idle_since = now
            idle = now - idle_since
            if spin_s < 0:
                spin_s = self.spin_s
                if spin_s and any(op.length >= STREAM_BYTES for op in ops):
                    spin_s = 0.0  # a stream: block (``lane.STREAM_BYTES``)
                elif spin_s and cores_busy():
                    shared = any(not op.done and self.shares_core(op.peer) for op in ops)
                    spin_s = 0.0 if shared else min(spin_s, BUSY_SPIN_S)
            if idle < spin_s:
                continue
            if idle < spin_s + self.yield_s:
                os.sched_yield()
                continue
            if not self._progress(SLICE_MS):
                between()
            return

    def shares_core(self, peer: int) -> bool:
        """Whether ``peer`` last sent from the core this thread runs on, on this kernel:
        by its last frame here when that came within ``CORES_FRESH_S`` (a job of send and
        recv alone has no collective headers), else as the lane last heard.  Why it
        matters: ``Lane.spin_budget``."""
        conn = self._in_from.get(peer)
        said = None if conn is None else conn.shares_core(CORES_FRESH_S)
        return self.lane_shares_core(peer) if said is None else said

    def kick(self) -> None:
        """After posting: if no thread comes to wait for the ops, the helper drives them."""
        with self._wake:
            if self._helper is None and not self._closed:
                self._helper = threading.Thread(
                    target=self._help, name=f"torchcomms-p2p-{self.rank}", daemon=True
                )
                self._helper.start()
            self._wake.notify()

    def _help(self) -> None:
        """The helper thread: drives posted ops while no thread waits for them."""
        while True:
            with self._wake:
                while not self._closed and not (self._pending and not self._waiting):
                    self._wake.wait()
                if self._closed:
                    return
                self._wake.wait(_HELPER_GRACE_S)  # a sync op's own wait comes at once
                if self._closed:
                    return
                if self._waiting or not self._pending:
                    continue
            if self._drive.acquire(timeout=SLICE_MS / 1000):
                try:
                    if not self._closed:
                        self._progress(_HELPER_SLICE_MS)
                finally:
                    self._drive.release()

    # -- progress (the driver) ---------------------------------------------------------------
    def _progress(self, timeout_ms: int) -> bool:
        """One pass over every connection; with ``timeout_ms``, block in ``poll`` first
        when there is nothing to do.  Whether anything moved."""
        moved = self._send_all()
        ready = self._readable.poll(0)
        if ready:
            moved = self._read_ready(ready) or moved
        if moved or not timeout_ms:
            return moved
        poller = self._readable
        writing = [out.sock for out in list(self._outs.values()) if out.queue]
        if writing:  # sends wait for room too: a poll of its own (the slow path)
            poller = select.poll()
            poller.register(self._listener, select.POLLIN)
            for fd in self._ins:
                poller.register(fd, _IN)
            for sock in writing:
                poller.register(sock, select.POLLOUT)
        ready = poller.poll(timeout_ms)
        if not ready:
            return False
        if writing:
            self._send_all()
            ready = self._readable.poll(0)
        self._read_ready(ready)
        return True

    def _read_ready(self, ready: list[tuple[int, int]]) -> bool:
        """Accept or read what ``poll`` said is ready; whether anything moved."""
        moved = False
        listener = self._listener.fileno()
        for fd, _ in ready:
            if fd == listener:
                self._accept()
                continue
            conn = self._ins.get(fd)
            if conn is not None and not conn.eof:
                moved = self._read(conn) or moved
        return moved

    def _send_all(self) -> bool:
        moved = False
        for out in list(self._outs.values()):  # a poster may add one meanwhile
            while out.queue:
                op = out.queue[0]
                if not out.parts:
                    out.parts = [HEAD.pack(op.length, op.tag, current_cpu())]
                    if op.length:
                        out.parts.append(op.view)
                left = send_some(out.sock, out.parts)
                if left is None:  # the connection broke: the peer is gone
                    self._broken(op.peer, out)
                    moved = True
                    break
                if left is out.parts:
                    break
                moved = True
                out.parts = left
                if left:
                    break
                out.queue.popleft()
                with self._lock:
                    op.done = True
                    self._pending -= 1
        return moved

    def _broken(self, peer: int, out: OutConn) -> None:
        """Sending to ``peer`` failed: fail every send queued for it."""
        gone = LanePeerGone(peer, None, socket_error(out.sock))
        with self._lock:
            for op in out.queue:
                op.error, op.done = gone, True
                self._pending -= 1
            out.queue.clear()
            out.parts = []

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            said = hello(conn, self._token)
            if said is None:
                conn.close()  # not one of ours
                continue
            peer, kernel = said
            data_socket(conn)
            conn.setblocking(False)
            self._ins[conn.fileno()] = self._in_from[peer] = InConn(conn, peer, kernel)
            self._readable.register(conn, _IN)

    def _read(self, conn: InConn) -> bool:
        """Read what ``conn`` has and deliver every whole frame; whether anything came.
        Stops at the first short ``recv`` (drained): no ``EAGAIN`` on the common path."""
        moved = False
        while not conn.eof:
            into = conn.into
            if into is not None:  # a large frame: straight into its target
                want = len(conn.target) - conn.got
                n = self._recv(conn, conn.target[conn.got :])
                if n <= 0:
                    return moved
                moved = True
                conn.got += n
                if conn.got == len(conn.target):
                    conn.into, conn.target = None, conn.mv
                    self._arrived(conn.peer, conn.tag, into)
                if n < want:
                    return moved
                continue
            if conn.start == conn.end:
                conn.start = conn.end = 0
            elif conn.end == READ_BUF:  # a partial frame at the end: move it to the front
                left = conn.end - conn.start
                conn.buf[:left] = conn.mv[conn.start : conn.end]
                conn.start, conn.end = 0, left
            want = READ_BUF - conn.end
            n = self._recv(conn, conn.mv[conn.end :])
            if n <= 0:
                return moved
            moved = True
            conn.end += n
            self._parse(conn)
            if n < want:
                return moved
        return moved

    def _recv(self, conn: InConn, into: memoryview) -> int:
        """``recv_into``: the bytes read; 0 if none are there (``EAGAIN``), -1 when the
        connection ended (then ``_lost`` has run)."""
        try:
            n = conn.sock.recv_into(into)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as exc:
            conn.error, n = broken(exc), 0
        if n == 0:
            self._lost(conn)
            return -1
        return n

    def _parse(self, conn: InConn) -> None:
        """Deliver every whole frame of ``conn``'s buffer; start reading a large one."""
        buf, mv = conn.buf, conn.mv
        while True:
            start, avail = conn.start, conn.end - conn.start
            if avail < HEAD.size:
                return
            length, tag, core = HEAD.unpack_from(buf, start)
            if length == GOODBYE:
                if read_goodbye(conn):  # its whole text is in: lose ``conn`` with it
                    self._lost(conn)
                return
            conn.core, conn.heard = core, time.monotonic()
            whole = HEAD.size + length
            if whole <= avail:  # the common case: the whole frame is here
                body = start + HEAD.size
                conn.start = start + whole
                self._arrived_bytes(conn.peer, tag, mv[body : body + length])
                continue
            if whole <= READ_BUF:  # fits: wait for the rest of it in the buffer
                return
            # Larger than the buffer: what is here, then the rest straight into place.
            have = avail - HEAD.size
            with self._lock:
                op = self._match_size(conn.peer, tag, length)
            target = op.view if op is not None else memoryview(bytearray(length))
            target[:have] = mv[start + HEAD.size : conn.end]
            conn.start = conn.end = 0
            conn.into = op if op is not None else target.obj  # type: ignore[assignment]
            conn.target, conn.got, conn.tag = target, have, tag
            return

    def _arrived_bytes(self, peer: int, tag: int, data: memoryview) -> None:
        """A whole small frame, still in the read buffer: into its receive, or copied out
        to wait for one."""
        with self._lock:
            op = self._match_size(peer, tag, len(data))
            if op is None:
                self._early[peer].append((tag, bytearray(data)))
                return
            if op.length:
                op.view[:] = data
            op.done = True
            self._pending -= 1

    def _arrived(self, peer: int, tag: int, into: Transfer | bytearray) -> None:
        """A large frame read in full into ``into``: its receive's, or a buffer of its
        own that now goes to a receive posted meanwhile, or waits for one."""
        with self._lock:
            if isinstance(into, Transfer):
                into.done = True
                self._pending -= 1
                return
            op = self._match_size(peer, tag, len(into))
            if op is None:
                self._early[peer].append((tag, into))
            else:
                op.view[:] = into
                op.done = True
                self._pending -= 1

    def _match_size(self, peer: int, tag: int, length: int) -> Transfer | None:
        """(``_lock`` held) ``_match`` for a message of ``length`` bytes: a matching
        receive of another size fails, and the message goes to the next one (or waits)."""
        while True:
            op = self._match(peer, tag)
            if op is None or op.length == length:
                return op
            op.error = LaneProtocolError(
                f"a receive of {op.length} B from rank {op.peer} met a message of "
                f"{length} B (tag {op.tag})"
            )
            op.done = True
            self._pending -= 1

    def _match(self, peer: int, tag: int) -> Transfer | None:
        """(``_lock`` held) The first posted receive from ``peer`` with ``tag``, unposted."""
        posted = self._posted.get(peer)
        if posted:
            for i, op in enumerate(posted):
                if op.tag == tag:
                    del posted[i]
                    return op
        return None

    def _lost(self, conn: InConn) -> None:
        """``conn``'s peer said goodbye or its connection ended: fail what waits on it."""
        conn.eof = True
        with contextlib.suppress(KeyError, ValueError):
            self._readable.unregister(conn.sock)
        gone = LanePeerGone(conn.peer, conn.said, conn.error)
        with self._lock:
            self._gone[conn.peer] = gone
            posted = self._posted.pop(conn.peer, None) or ()
            for op in posted:
                op.error, op.done = gone, True
                self._pending -= 1
        out = self._outs.get(conn.peer)
        if out is not None and out.queue and conn.said is None:
            self._broken(conn.peer, out)

    # -- ending ----------------------------------------------------------------------------
    def goodbye(self, text: str) -> None:
        """Tell every peer this rank sends to why it stops (where no send is half done)."""
        if self._said:
            return
        self._said = True
        frame = goodbye_frame(text)
        for out in self._outs.values():
            if not out.parts:
                with contextlib.suppress(OSError):
                    out.sock.send(frame)

    def close(self) -> None:
        """Say ``BYE`` (unless a failure was said) and close every connection."""
        if not self._said:
            self.goodbye("BYE")
        with self._wake:
            self._closed = True
            self._wake.notify_all()
            helper = self._helper
        if helper is not None and helper is not threading.current_thread():
            helper.join(_CLOSE_WAIT_S)  # it ends at its next look at ``_closed``
        for sock in [
            self._listener,
            *(o.sock for o in self._outs.values()),
            *(c.sock for c in self._ins.values()),
        ]:
            with contextlib.suppress(OSError):
                sock.close()
        self._address_of = _closed  # the addresses came from the comm's store: let it go


def _closed(peer: int) -> tuple[str, int, str]:
    """A closed engine dials nobody."""
    raise OSError(f"the point-to-point engine is closed (peer rank {peer})")
