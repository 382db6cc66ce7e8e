"""Windows across hosts: one server thread per communicator, one client link per remote peer.

Why a thread: a one-sided op must make progress on its target while the target computes,
waits in ``wait_signal`` or runs a collective.  Each rank that has peers on other hosts
runs ``WindowServer`` (daemon thread ``torchcomms-windows-NAME``): it accepts one
connection from each such peer and serves, in arrival order, the frames that peer sends.
A rank's ``PeerLink`` to a peer is the connection it dialled to that peer's server; only
the communicator's op thread uses it (window ops run in issue order, one at a time).

**Frames** (little endian): ``u8 op, u32 window, u64 offset, u64 nbytes`` then, for a
put, ``nbytes`` bytes.  Ops: ``PUT`` (write into the target's window), ``GET`` (the server
answers ``u8 status, u64 nbytes`` and the bytes), ``SIGNAL`` (bump the target's counter for
the sender), ``FLUSH`` (answered once every earlier frame was served: deregistration
waits for it), ``BYE`` (the sender finalized).  One connection per ordered pair, served
by one thread in order, is what keeps put -> signal order per peer: a signal is applied
only after every put sent before it has been written.

**Failures.**  A connection that ends without ``BYE`` means the peer's process is gone:
the server adds it to ``dead`` (read by waits on any thread; a set replaced whole).  A
frame that stalls for ``_FRAME_S`` (a stopped peer) drops the connection without calling
the peer dead; its later ops fail on the broken link.  A
client waiting for an answer checks the deadline and the liveness callback every
``SLICE_S``.  A target window that is unknown (never registered or deregistered) cannot
be written: the server drops the payload and answers a GET with an error status.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import selectors
import socket
import struct
import threading
from collections.abc import Callable

import torch

from torchcomms.transport.stream import recv_exact
from torchcomms.transport.window.memory import SignalBlock

logger = logging.getLogger("torchcomms.transport.window.tcp")

PUT, GET, SIGNAL, FLUSH, BYE = 1, 2, 3, 4, 5
_HEAD = struct.Struct("<BIQQ")
_REPLY = struct.Struct("<BQ")
#: How long a client blocks on its socket before its checks run.
SLICE_S = 0.05
#: How long the server waits for the rest of a frame whose header arrived.
_FRAME_S = 30.0
_DRAIN = 1 << 20


class LinkError(Exception):
    """A link cannot finish: ``kind`` is ``gone`` (peer process gone) or ``error``."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class _Target:
    __slots__ = ("data", "signals")

    def __init__(self, data: torch.Tensor, signals: SignalBlock) -> None:
        self.data = data
        self.signals = signals


class WindowServer:
    """Serves this rank's windows to peers on other hosts (see the module docstring).

    ``add``/``remove`` (op thread) and the serving thread share ``_targets`` under ``_lock``.
    """

    def __init__(self, rank: int, bind: str, name: str) -> None:
        self.rank = rank
        self.token = secrets.token_hex(8)
        family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.bind((bind, 0))
        self._listener.listen(64)
        self.port = int(self._listener.getsockname()[1])
        self._targets: dict[int, _Target] = {}
        self._lock = threading.Lock()
        #: Peers whose connection ended without a goodbye (process gone).
        self.dead: frozenset[int] = frozenset()
        #: Peers that said goodbye (they finalized the communicator).
        self.left: frozenset[int] = frozenset()
        self._stop = False
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._thread = threading.Thread(
            target=self._serve, name=f"torchcomms-windows-{name}", daemon=True
        )
        self._thread.start()

    def add(self, window: int, data: torch.Tensor, signals: SignalBlock) -> None:
        with self._lock:
            self._targets[window] = _Target(data, signals)

    def remove(self, window: int) -> None:
        with self._lock:
            self._targets.pop(window, None)

    def close(self) -> None:
        self._stop = True
        self._thread.join(1.0)

    # -- the serving thread ------------------------------------------------------------------
    def _serve(self) -> None:
        try:
            while not self._stop:
                for key, _ in self._sel.select(SLICE_S):
                    if key.data is None:
                        self._accept()
                    elif not self._frame(key.fileobj, key.data):  # type: ignore[arg-type]
                        self._sel.unregister(key.fileobj)
                        key.fileobj.close()  # type: ignore[union-attr]
        except Exception:  # a bug here must not pass silently: waits then time out
            logger.exception("torchcomms window server of rank %d stopped", self.rank)
        finally:
            for key in list(self._sel.get_map().values()):
                with contextlib.suppress(OSError):
                    key.fileobj.close()  # type: ignore[union-attr]
            self._sel.close()

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        conn.settimeout(_FRAME_S)
        line = b""
        try:
            # One byte at a time: the peer's first frames may already follow its hello in
            # the socket buffer, and they must stay there.
            while not line.endswith(b"\n") and len(line) < 128:
                chunk = conn.recv(1)
                if not chunk:
                    break
                line += chunk
        except OSError:
            conn.close()
            return
        words = line.decode(errors="replace").split()
        if len(words) != 3 or words[0] != "WIN" or words[1] != self.token:
            conn.close()  # not one of ours
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sel.register(conn, selectors.EVENT_READ, int(words[2]))

    def _frame(self, conn: socket.socket, peer: int) -> bool:
        """Serve one frame from ``peer``; False once its connection is over."""
        head = bytearray(_HEAD.size)
        try:
            if not recv_exact(conn, memoryview(head)):
                self._lost(peer)
                return False
            op, window, offset, nbytes = _HEAD.unpack(head)
            if op == BYE:
                self.left = self.left | {peer}
                return False
            with self._lock:
                target = self._targets.get(window)
            fits = target is not None and offset + nbytes <= target.data.numel()
            if op == PUT:
                if fits and target is not None and nbytes:
                    view = target.data[offset : offset + nbytes].numpy().data
                    if not recv_exact(conn, view):
                        self._lost(peer)
                        return False
                elif nbytes:
                    self._drain(conn, nbytes)
                    logger.error(
                        "rank %d dropped a put from rank %d (window %d)", self.rank, peer, window
                    )
            elif op == GET:
                if fits and target is not None:
                    conn.sendall(_REPLY.pack(0, nbytes))
                    if nbytes:
                        conn.sendall(target.data[offset : offset + nbytes].numpy().data)
                else:
                    conn.sendall(_REPLY.pack(1, 0))
            elif op == SIGNAL:
                if target is not None:
                    target.signals.bump(peer)
            elif op == FLUSH:
                conn.sendall(_REPLY.pack(0, 0))
            return True
        except TimeoutError:
            # A frame that stalls (a stopped peer, or one that abandoned a get's answer):
            # drop the connection, so the peer's later ops fail, but it is not dead.
            logger.warning(
                "rank %d dropped its window connection from rank %d: a frame stalled for %g s",
                self.rank,
                peer,
                _FRAME_S,
            )
            return False
        except OSError:
            self._lost(peer)
            return False

    def _drain(self, conn: socket.socket, nbytes: int) -> None:
        scratch = bytearray(min(nbytes, _DRAIN))
        while nbytes:
            n = conn.recv_into(scratch, min(nbytes, len(scratch)))
            if n == 0:
                raise ConnectionResetError("peer gone mid-frame")
            nbytes -= n

    def _lost(self, peer: int) -> None:
        if peer not in self.left:
            self.dead = self.dead | {peer}


class PeerLink:
    """This rank's connection to one remote peer's window server (op thread only)."""

    def __init__(self, rank: int, peer: int, host: str, port: int, token: str, timeout_s: float):
        self.peer = peer
        self.sock = socket.create_connection((host, port), timeout=max(timeout_s, 0.1))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(f"WIN {token} {rank}\n".encode())
        self.broken = ""

    def _send(self, parts: list[bytes | memoryview], deadline_s: float) -> None:
        if self.broken:
            raise LinkError("error", self.broken)
        self.sock.settimeout(max(deadline_s, 0.001))
        try:
            for part in parts:
                self.sock.sendall(part)
        except TimeoutError:
            self.broken = "a send timed out part-way (the link is unusable)"
            raise LinkError("timeout", "timed out sending to the peer") from None
        except OSError as exc:
            self.broken = f"connection lost ({exc})"
            raise LinkError("gone", self.broken) from None

    def put(self, window: int, offset: int, payload: memoryview, deadline_s: float) -> None:
        self._send([_HEAD.pack(PUT, window, offset, len(payload)), payload], deadline_s)

    def signal(self, window: int, deadline_s: float) -> None:
        self._send([_HEAD.pack(SIGNAL, window, 0, 0)], deadline_s)

    def get(
        self,
        window: int,
        offset: int,
        into: memoryview,
        left_s: Callable[[], float],
        check: Callable[[], None],
    ) -> bool:
        """Read ``len(into)`` bytes of the peer's window; False if it has no such window."""
        self._send([_HEAD.pack(GET, window, offset, len(into))], left_s())
        reply = bytearray(_REPLY.size)
        self._recv(memoryview(reply), check)
        status, _ = _REPLY.unpack(reply)
        if status != 0:
            return False
        self._recv(into, check)
        return True

    def flush(self, left_s: Callable[[], float], check: Callable[[], None]) -> None:
        """Return once the peer served every frame sent before this one."""
        self._send([_HEAD.pack(FLUSH, 0, 0, 0)], left_s())
        self._recv(memoryview(bytearray(_REPLY.size)), check)

    def _recv(self, view: memoryview, check: Callable[[], None]) -> None:
        self.sock.settimeout(SLICE_S)
        got = 0
        while got < len(view):
            try:
                n = self.sock.recv_into(view[got:])
            except TimeoutError:
                try:
                    check()
                except BaseException:
                    self.broken = "a reply was abandoned part-way (the link is unusable)"
                    raise
                continue
            except OSError as exc:
                self.broken = f"connection lost ({exc})"
                raise LinkError("gone", self.broken) from None
            if n == 0:
                self.broken = "the peer closed the connection"
                raise LinkError("gone", self.broken)
            got += n

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.settimeout(0.5)
            self.sock.sendall(_HEAD.pack(BYE, 0, 0, 0))
        with contextlib.suppress(OSError):
            self.sock.close()
