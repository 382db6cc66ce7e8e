"""``P2P``: point-to-point messages over direct TCP connections, dialled on first use.

Why not gloo: a gloo send/recv work never reports completion without a blocking
``wait()``, and a timed wait closes the pair, so each gloo p2p wait needs a helper
thread; those hand-offs cost 100-200 µs per message on a small VM.  Here the thread
that waits moves the bytes itself.

**Connections.**  Rank ``a`` sends to ``b`` over a connection ``a`` dialled to ``b``'s
listener (``HI token rank``), made the first time ``a`` sends to ``b``: a job whose ranks
talk to two neighbours holds four sockets per rank, not ``2 (n-1)``.  The kernel
completes the handshake even before ``b`` accepts, so a send never waits for the
receiver to be in a call.

**Frames.**  ``u64 length``, ``i64 tag``, then the payload; a length of ``2**64 - 1``
starts a goodbye (``u32 length`` + text).  Messages of one pair and tag match in order;
a message that arrives before its receive is posted waits in a per-peer queue (one
copy), one whose receive is posted is read straight into the tensor.

**Progress.**  A send posted with nothing queued ahead of it on its connection, while no
thread drives, goes out at once (what the socket takes; the rest is queued first in line),
so a small message is done when ``post_send`` returns.  Otherwise whoever waits drives:
``wait(ops)`` sends and receives for every posted op (not only its own: so two ranks that
both send first never deadlock) until its ops are done, a spin first where allowed, then
``poll`` in slices with ``between`` (abort, liveness, deadline) after each idle one.
While ops are posted that no thread waits for (an async receive posted before a
collective), a helper thread drives in short slices, so a sender is never stuck behind a
receiver busy elsewhere.  One driver at a time (``_drive``); ``post_*`` may run on any
thread.
"""

from __future__ import annotations

import collections
import contextlib
import select
import socket
import struct
import threading
import time
from collections.abc import Callable

from torchcomms.transport.tcp_lane import SLICE_MS, LanePeerGone, LaneProtocolError, send_some

_HEAD = struct.Struct("<Qq")
_U32 = struct.Struct("<I")
_GOODBYE = (1 << 64) - 1
_IN = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP
#: How long a wait spins (non-blocking passes) before it blocks in ``poll``, when every
#: rank of the host has a core: longer than the lane's, since a reply comes only after
#: the peer's whole call returned and its next one started (a ``poll`` wake-up of an idle
#: vCPU costs 0.1-4 ms here).
SPIN_S = 1e-3
#: How long the helper thread drives before it lets a waiting thread take over.
_HELPER_SLICE_MS = 5
#: How long posted ops wait for a thread of their own before the helper drives them.
_HELPER_GRACE_S = 0.002


class Transfer:
    """One posted send or receive; ``done`` once its bytes moved, ``error`` if it failed."""

    __slots__ = ("done", "error", "length", "peer", "tag", "view")

    def __init__(self, peer: int, tag: int, view: memoryview) -> None:
        self.peer = peer
        self.tag = tag
        self.view = view
        self.length = len(view)
        self.done = False
        self.error: BaseException | None = None


class _Out:
    """This rank's connection to one peer, and the sends queued on it."""

    __slots__ = ("parts", "queue", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.queue: collections.deque[Transfer] = collections.deque()
        self.parts: list[memoryview | bytes] = []  # the head send's unsent bytes


class _In:
    """A connection from one peer: the message being read and what it goes into."""

    __slots__ = ("eof", "got", "head", "into", "peer", "said", "sock", "stage", "tag", "target")

    def __init__(self, sock: socket.socket, peer: int) -> None:
        self.sock = sock
        self.peer = peer
        self.head = bytearray(_HEAD.size)
        self.stage = 0  # 0: the head, 1: the payload, 2: a goodbye's text
        self.target = memoryview(self.head)
        self.got = 0
        self.into: Transfer | bytearray | None = None
        self.tag = 0
        self.eof = False
        self.said: str | None = None


class P2P:
    """The point-to-point engine of one rank of one communicator (module docstring)."""

    def __init__(
        self,
        rank: int,
        listener: socket.socket,
        token: str,
        address_of: Callable[[int], tuple[str, int, str]],
        spin_s: float = 0.0,
    ) -> None:
        self.rank = rank
        self._listener = listener
        listener.setblocking(False)
        self._token = token
        self._address_of = address_of
        self.spin_s = spin_s
        self._outs: dict[int, _Out] = {}
        self._ins: dict[int, _In] = {}  # by fd
        self._dialled_in: set[int] = set()  # peers whose connection to this rank is accepted
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

    # -- posting (any thread) --------------------------------------------------------------
    def post_send(self, peer: int, tag: int, view: memoryview) -> Transfer:
        op = Transfer(peer, tag, view)
        out = self._outs.get(peer)
        if out is None:
            with self._dialling:  # one connection per peer, whichever thread posts first
                out = self._outs.get(peer)
                if out is None:
                    try:
                        out = self._outs[peer] = _Out(self._dial(peer))
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

    def _send_now(self, out: _Out, op: Transfer) -> bool:
        """Send ``op`` on ``out`` (queue empty, driver held): whether it is done (sent or
        failed); otherwise ``out.parts`` holds what is left of it, for ``_send_all``."""
        parts: list[memoryview | bytes] = [_HEAD.pack(op.length, op.tag)]
        if op.length:
            parts.append(op.view)
        left = send_some(out.sock, parts)
        if left is None:  # the connection broke: the peer is gone
            self._broken(op.peer, out)
            op.error, op.done = LanePeerGone(op.peer, None), True
            return True
        if not left:
            op.done = True
            return True
        out.parts = [] if left is parts else left  # nothing sent: _send_all starts over
        return False

    def post_recv(self, peer: int, tag: int, view: memoryview) -> Transfer:
        op = Transfer(peer, tag, view)
        with self._lock:
            early = self._early.get(peer)
            if early:
                for i, (t, data) in enumerate(early):
                    if t == tag:
                        del early[i]
                        _deliver(op, data)
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
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(f"HI {theirs} {self.rank}\n".encode())
        sock.setblocking(False)
        return sock

    # -- waiting ---------------------------------------------------------------------------
    def wait(self, ops: list[Transfer], between: Callable[[], None]) -> None:
        """Drive until every op of ``ops`` is done; raise the first one's error."""
        if not all(op.done for op in ops):  # (a send that went out when posted is done)
            self._drive_until(ops, between)
        for op in ops:
            if op.error is not None:
                raise op.error

    def _drive_until(self, ops: list[Transfer], between: Callable[[], None]) -> None:
        """Move every posted op, one driver at a time, until ``ops`` are done."""
        with self._wake:
            self._waiting += 1
        try:
            idle_since = 0.0
            while not all(op.done for op in ops):
                if not self._drive.acquire(timeout=SLICE_MS / 1000):
                    between()
                    continue
                try:
                    moved = self._progress(0)
                    if not moved and not all(op.done for op in ops):
                        now = time.perf_counter()
                        if not idle_since:
                            idle_since = now
                        if now - idle_since >= self.spin_s and not self._progress(SLICE_MS):
                            between()
                    else:
                        idle_since = 0.0
                finally:
                    self._drive.release()
        finally:
            with self._wake:
                self._waiting -= 1
                self._wake.notify()

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
        # ``accept`` is a syscall: on a spin pass only when a receive waits for a peer
        # that has not dialled in yet (a blocking pass polls the listener too).
        moved = self._read_all(self._unconnected_receives()) or moved
        if moved or not timeout_ms:
            return moved
        poller = select.poll()
        poller.register(self._listener, select.POLLIN)
        for fd in self._ins:
            poller.register(fd, _IN)
        for out in list(self._outs.values()):
            if out.queue:
                poller.register(out.sock, select.POLLOUT)
        if not poller.poll(timeout_ms):
            return False
        self._send_all()
        self._read_all(True)
        return True

    def _unconnected_receives(self) -> bool:
        """Whether a posted receive waits for a peer with no connection in yet."""
        with self._lock:  # ``post_recv`` may add a peer meanwhile
            return any(q and p not in self._dialled_in for p, q in self._posted.items())

    def _send_all(self) -> bool:
        moved = False
        for out in list(self._outs.values()):  # a poster may add one meanwhile
            while out.queue:
                op = out.queue[0]
                if not out.parts:
                    out.parts = [_HEAD.pack(op.length, op.tag)]
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

    def _broken(self, peer: int, out: _Out) -> None:
        """Sending to ``peer`` failed: fail every send queued for it."""
        gone = LanePeerGone(peer, None)
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
            peer = _hello(conn, self._token)
            if peer is None:
                conn.close()  # not one of ours
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setblocking(False)
            self._ins[conn.fileno()] = _In(conn, peer)
            self._dialled_in.add(peer)

    def _read_all(self, accept: bool) -> bool:
        if accept:
            self._accept()
        moved = False
        for conn in list(self._ins.values()):
            if conn.eof:
                continue
            while True:
                try:
                    n = conn.sock.recv_into(conn.target[conn.got :]) if conn.target else 0
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    n = -1
                if n <= 0 and conn.target:
                    self._lost(conn)
                    break
                moved = True
                conn.got += n
                if conn.got == len(conn.target):
                    self._next(conn)
        return moved

    def _next(self, conn: _In) -> None:
        """``conn``'s current part is complete: deliver it, set up the next."""
        if conn.stage == 0:
            length, tag = _HEAD.unpack(conn.head)
            if length == _GOODBYE:
                conn.stage, conn.into = 2, None
                conn.target, conn.got = memoryview(bytearray(4)), 0
                return
            with self._lock:
                op = self._match(conn.peer, tag)
            if op is not None and op.length != length:
                op.error = LaneProtocolError(
                    f"a receive of {op.length} B from rank {conn.peer} met a message of "
                    f"{length} B (tag {tag})"
                )
                with self._lock:
                    op.done = True
                    self._pending -= 1
                op = None
            if op is not None:
                conn.into, conn.target = op, op.view
            else:
                buf = bytearray(length)
                conn.into, conn.target = buf, memoryview(buf)
            conn.stage, conn.got, conn.tag = 1, 0, tag
            if length == 0:
                self._next(conn)
            return
        if conn.stage == 1:
            into = conn.into
            if isinstance(into, Transfer):
                with self._lock:
                    into.done = True
                    self._pending -= 1
            elif into is not None:  # read early: a receive may have been posted meanwhile
                with self._lock:
                    op = self._match(conn.peer, conn.tag)
                    if op is None:
                        self._early[conn.peer].append((conn.tag, into))
                    else:
                        _deliver(op, into)
                        self._pending -= 1
        elif conn.stage == 2:
            if conn.into is None:  # the goodbye's length: now its text
                (n,) = _U32.unpack(conn.target)
                buf = bytearray(min(n, 4096))
                conn.into, conn.target, conn.got = buf, memoryview(buf), 0
                return
            conn.said = bytes(conn.target).decode(errors="replace")
            self._lost(conn)
            return
        conn.stage, conn.into, conn.target, conn.got = 0, None, memoryview(conn.head), 0

    def _match(self, peer: int, tag: int) -> Transfer | None:
        """(``_lock`` held) The first posted receive from ``peer`` with ``tag``, unposted."""
        posted = self._posted.get(peer)
        if posted:
            for i, op in enumerate(posted):
                if op.tag == tag:
                    del posted[i]
                    return op
        return None

    def _lost(self, conn: _In) -> None:
        """``conn``'s peer said goodbye or its connection ended: fail what waits on it."""
        conn.eof = True
        gone = LanePeerGone(conn.peer, conn.said)
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
        data = text.encode()
        frame = _HEAD.pack(_GOODBYE, 0) + _U32.pack(len(data)) + data
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
        for sock in [
            self._listener,
            *(o.sock for o in self._outs.values()),
            *(c.sock for c in self._ins.values()),
        ]:
            with contextlib.suppress(OSError):
                sock.close()


def _deliver(op: Transfer, data: bytearray) -> None:
    """(``_lock`` held) A message that arrived early, into its receive."""
    if len(data) != op.length:
        op.error = LaneProtocolError(
            f"a receive of {op.length} B from rank {op.peer} met a message of {len(data)} B "
            f"(tag {op.tag})"
        )
    elif op.length:
        op.view[:] = data
    op.done = True


def _hello(conn: socket.socket, token: str) -> int | None:
    """The rank of a dialling peer (``HI token rank``), or None if it is not one.  Reads
    exactly the line: the peer's first message may follow it in the same segment."""
    conn.settimeout(2.0)
    try:
        while True:
            data = conn.recv(128, socket.MSG_PEEK)
            if not data:
                return None
            end = data.find(b"\n")
            if end >= 0:
                data = conn.recv(end + 1)
                break
            if len(data) >= 128:
                return None
            time.sleep(0.001)
    except OSError:
        return None
    words = data.decode(errors="replace").split()
    if len(words) != 3 or words[0] != "HI" or words[1] != token:
        return None
    try:
        return int(words[2])
    except ValueError:
        return None
