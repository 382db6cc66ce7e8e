"""The TCP path of ``torchcomms._transport``: a serving thread per transport, and its clients.

Wire format (little endian), per connection:

* hello: the client sends ``b"TCRD"`` and the 16-byte token of the transport it dialled; the
  server answers one byte, 0 when the token is its own (a client that reached another
  process's port is told so, never served);
* request: ``op`` (u8: 1 read, 2 write), ``ptr`` (u64), ``nbytes`` (u64), key length (u16),
  key (utf-8);
* reply: ``status`` (u8: 0 granted, 1 refused by the owner's checks, 2 failed), message length
  (u32), message.  A granted read is followed by its ``nbytes``; a granted write is answered
  once more, after the client's ``nbytes`` arrived.

``Server`` runs one thread: it accepts the peer's connections and serves their requests one
at a time, straight from and into the registered memory (``registry``), so the owner's own
threads take no part.  ``TcpPeer`` is the client: one connection, its requests serialised by
a lock; ``read_many`` keeps a window of requests in flight, so many small tensors pay one
round trip per window, not one each.  Every socket wait is bounded by the caller's deadline.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import selectors
import socket
import struct
import threading
import time
from collections.abc import Sequence

from torchcomms.errors import CommTimeoutError, PeerFailureError, RemoteAccessError
from torchcomms.transport import listen
from torchcomms.transport.rdma.registry import registry
from torchcomms.transport.stream import recv_exact

logger = logging.getLogger("torchcomms.transport.rdma.tcp")

HELLO = b"TCRD"
TOKEN_BYTES = 16
READ, WRITE = 1, 2
_REQUEST = struct.Struct("<BQQH")
_REPLY = struct.Struct("<BI")
GRANTED, REFUSED, FAILED = 0, 1, 2
#: Requests ``read_many`` keeps in flight.
_WINDOW = 64
#: How long the server waits for the rest of a request or a write's bytes.
_SERVER_IO_S = 60.0


def memory_at(ptr: int, nbytes: int) -> memoryview:
    """A byte view of ``nbytes`` at ``ptr`` of this process (checked by the caller)."""
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * nbytes).from_address(ptr)).cast("B")


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    if not recv_exact(sock, view):
        raise ConnectionResetError("connection closed")


def _recv_bytes(sock: socket.socket, nbytes: int) -> bytes:
    buf = bytearray(nbytes)
    _recv_exact(sock, memoryview(buf))
    return bytes(buf)


def _reply(sock: socket.socket, status: int, message: str = "") -> None:
    text = message.encode()
    sock.sendall(_REPLY.pack(status, len(text)) + text)


class Server:
    """The serving thread of one transport (started by ``bind``, stopped by ``close``)."""

    def __init__(self, advertise: str, token: bytes) -> None:
        self.token = token
        self._listener = listen.listen_socket(advertise, 0)
        self.port = self._listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(
            target=self._run, name="torchcomms-rdma-server", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, "accept")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        try:
            while True:
                for key, _ in sel.select():
                    if key.data == "wake":
                        return
                    if key.data == "accept":
                        conn, _addr = self._listener.accept()
                        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        conn.settimeout(_SERVER_IO_S)
                        self._conns.append(conn)
                        sel.register(conn, selectors.EVENT_READ, "hello")
                        continue
                    conn = key.fileobj  # type: ignore[assignment]  # a socket registered above
                    assert isinstance(conn, socket.socket)
                    try:
                        if key.data == "hello":
                            self._hello(conn)
                            sel.modify(conn, selectors.EVENT_READ, "serve")
                        else:
                            self._serve(conn)
                    except (OSError, ValueError) as exc:
                        logger.debug("rdma server: a peer connection ended: %s", exc)
                        sel.unregister(conn)
                        self._conns.remove(conn)
                        conn.close()
        finally:
            sel.close()
            for conn in self._conns:
                conn.close()
            self._conns.clear()
            self._listener.close()
            self._wake_r.close()

    def _hello(self, conn: socket.socket) -> None:
        got = _recv_bytes(conn, len(HELLO) + TOKEN_BYTES)
        ok = got == HELLO + self.token
        conn.sendall(b"\0" if ok else b"\1")
        if not ok:
            raise ValueError("a client dialled another transport")

    def _serve(self, conn: socket.socket) -> None:
        op, ptr, nbytes, keylen = _REQUEST.unpack(_recv_bytes(conn, _REQUEST.size))
        key = _recv_bytes(conn, keylen).decode()
        try:
            reg = registry().lookup(key, ptr, nbytes)
        except RemoteAccessError as exc:
            _reply(conn, REFUSED, str(exc))
            return
        if op not in (READ, WRITE):
            _reply(conn, FAILED, f"unknown op {op}")
            raise ValueError(f"unknown op {op}")
        try:
            with reg.pin():
                _reply(conn, GRANTED)
                view = memory_at(ptr, nbytes)
                if op == READ:
                    conn.sendall(view)
                else:
                    _recv_exact(conn, view)
                    _reply(conn, GRANTED)
        except RemoteAccessError as exc:
            _reply(conn, REFUSED, str(exc))

    def close(self) -> None:
        """Stop the thread and close every socket it owns (waits for the current request)."""
        if self._thread.is_alive():
            with contextlib.suppress(OSError):
                self._wake_w.send(b"x")
            self._thread.join(_SERVER_IO_S)
        self._wake_w.close()


class TcpPeer:
    """One connection to a peer transport's server."""

    def __init__(self, addr: str, port: int, token: bytes, owner: str, deadline: float) -> None:
        self.owner = owner
        self._lock = threading.Lock()
        self._failed = ""
        try:
            self._sock = socket.create_connection((addr, port), timeout=self._left(deadline))
        except OSError as exc:
            raise PeerFailureError(f"RdmaTransport.connect: cannot reach {owner}: {exc}") from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._io("RdmaTransport.connect", deadline):
            self._sock.sendall(HELLO + token)
            if _recv_bytes(self._sock, 1) != b"\0":
                raise PeerFailureError(
                    f"RdmaTransport.connect: {addr}:{port} is not the transport of {owner} "
                    "(its URL is stale)"
                )

    @staticmethod
    def _left(deadline: float) -> float:
        return max(deadline - time.monotonic(), 0.001)

    @contextlib.contextmanager
    def _io(self, what: str, deadline: float):  # type: ignore[no-untyped-def]
        """Socket errors of the body as the typed errors of a one-sided op."""
        if self._failed:
            raise PeerFailureError(f"{what}: {self._failed}")
        self._sock.settimeout(self._left(deadline))
        try:
            yield
        except TimeoutError:
            self._broken(f"{self.owner} did not answer within the timeout")
            raise CommTimeoutError(f"{what}: {self._failed}") from None
        except OSError as exc:
            self._broken(
                f"the connection to {self.owner} broke ({exc}): the peer process died or "
                "closed its transport"
            )
            raise PeerFailureError(f"{what}: {self._failed}") from None

    def _broken(self, why: str) -> None:
        # The stream is out of step after a failed request: nothing more is sent on it.
        self._failed = why
        with contextlib.suppress(OSError):
            self._sock.close()

    def _request(self, op: int, key: str, ptr: int, nbytes: int) -> bytes:
        raw = key.encode()
        return _REQUEST.pack(op, ptr, nbytes, len(raw)) + raw

    def _status(self, what: str) -> None:
        status, length = _REPLY.unpack(_recv_bytes(self._sock, _REPLY.size))
        message = _recv_bytes(self._sock, length).decode() if length else ""
        if status == REFUSED:
            raise RemoteAccessError(f"{what}: {message}")
        if status != GRANTED:
            raise PeerFailureError(f"{what}: {self.owner} failed: {message}")

    def write(self, local: memoryview, key: str, remote: int, deadline: float) -> None:
        what = f"RdmaTransport.write of {len(local)} bytes"
        with self._lock, self._io(what, deadline):
            self._sock.sendall(self._request(WRITE, key, remote, len(local)))
            self._status(what)
            self._sock.sendall(local)
            self._status(what)

    def read_many(self, items: Sequence[tuple[memoryview, str, int]], deadline: float) -> None:
        """Fill each local view from ``(key, remote ptr)`` of the peer, ``_WINDOW`` requests
        in flight; the first refusal is raised once the window has drained."""
        refused: RemoteAccessError | None = None
        with self._lock:
            sent = 0
            for done, (view, _key, _remote) in enumerate(items):
                what = f"RdmaTransport.read of {len(view)} bytes"
                with self._io(what, deadline):
                    while sent < len(items) and sent < done + _WINDOW:
                        v, k, r = items[sent]
                        self._sock.sendall(self._request(READ, k, r, len(v)))
                        sent += 1
                    try:
                        self._status(what)
                    except RemoteAccessError as exc:
                        refused = refused or exc
                        continue
                    _recv_exact(self._sock, view)
        if refused is not None:
            raise refused

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
