"""The wire format and per-connection records of ``transport.tcp.p2p`` (its module docstring says how
they are used): the frame head, the goodbye frame (written and read), a posted ``Transfer``,
the outgoing and incoming connection of one peer (and what the incoming one says of the
core its peer sends from), and the hello line a dialling peer sends first.

Everything here is plain data; the engine's driver thread reads and writes it.
"""

from __future__ import annotations

import collections
import socket
import struct
import time

from torchcomms.transport.contention import on_this_core
from torchcomms.transport.tcp.lane import LaneProtocolError

#: ``u64 length``, ``i64 tag``, ``i32 core``: the core the sending thread ran on as it wrote
#: the head (-1 unknown), for ``P2P.shares_core``.
HEAD = struct.Struct("<Qqi")
U32 = struct.Struct("<I")
GOODBYE = (1 << 64) - 1
#: Per connection: frames up to this size (head included) are read whole into it.
READ_BUF = 64 << 10


class Transfer:
    """One posted send or receive; ``done`` once its bytes moved, ``error`` if it failed.

    ``owner``: what keeps ``view``'s memory alive while the op is posted, when ``view``
    does not (a non-owning view of a tensor): a receive that outlives its wait (a
    timeout) may still be written into."""

    __slots__ = ("done", "error", "length", "owner", "peer", "tag", "view")

    def __init__(self, peer: int, tag: int, view: memoryview, owner: object = None) -> None:
        self.peer = peer
        self.tag = tag
        self.view = view
        self.owner = owner
        self.length = len(view)
        self.done = False
        self.error: BaseException | None = None


class OutConn:
    """This rank's connection to one peer, and the sends queued on it."""

    __slots__ = ("parts", "queue", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.queue: collections.deque[Transfer] = collections.deque()
        self.parts: list[memoryview | bytes] = []  # the head send's unsent bytes


class InConn:
    """A connection from one peer: its read buffer, and the large frame being read.

    ``buf[start:end]`` holds bytes read but not yet parsed.  ``into`` is set while a
    frame too large for the buffer is read straight into ``target`` (``got`` bytes in):
    its receive, or a new ``bytearray`` when none is posted yet."""

    __slots__ = (
        "buf",
        "core",
        "end",
        "eof",
        "error",
        "got",
        "heard",
        "into",
        "kernel",
        "mv",
        "peer",
        "said",
        "sock",
        "start",
        "tag",
        "target",
    )

    def __init__(self, sock: socket.socket, peer: int, kernel: int = 0) -> None:
        self.sock = sock
        self.peer = peer
        #: The peer's kernel (``contention.KERNEL_ID``; 0 unknown), from its hello; the
        #: core its last frame was posted from and when that frame came (``monotonic``).
        self.kernel = kernel
        self.core = -1
        self.heard = 0.0
        self.buf = bytearray(READ_BUF)
        self.mv = memoryview(self.buf)
        self.start = 0
        self.end = 0
        self.into: Transfer | bytearray | None = None
        self.target = self.mv
        self.got = 0
        self.tag = 0
        self.eof = False
        self.said: str | None = None
        #: What the socket raised when the connection broke, or None (it simply ended).
        self.error: str | None = None

    def shares_core(self, fresh_s: float) -> bool | None:
        """Whether the peer's last frame, if it came within ``fresh_s``, was posted from the
        core the calling thread runs on, on this kernel; None when none came that recently."""
        if time.monotonic() - self.heard > fresh_s:
            return None
        return on_this_core(self.kernel, self.core)


def hello(conn: socket.socket, token: str) -> tuple[int, int] | None:
    """The rank and kernel of a dialling peer (``HI token rank kernel``), or None if it is
    not one.  Reads exactly the line: the peer's first message may follow it in the same
    segment."""
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
    if len(words) != 4 or words[0] != "HI" or words[1] != token:
        return None
    try:
        return int(words[2]), int(words[3])
    except ValueError:
        return None


def goodbye_frame(text: str) -> bytes:
    """The goodbye that tells a peer why this rank stops."""
    data = text.encode()
    return HEAD.pack(GOODBYE, 0, -1) + U32.pack(len(data)) + data


def read_goodbye(conn: InConn) -> bool:
    """A goodbye heads ``conn``'s buffer: whether its whole text is in (then in
    ``conn.said``; a text longer than the buffer is cut)."""
    start, avail = conn.start, conn.end - conn.start
    text_at = start + HEAD.size + U32.size
    if avail < HEAD.size + U32.size:
        return False
    (n,) = U32.unpack_from(conn.buf, start + HEAD.size)
    n = min(n, 4096, READ_BUF - HEAD.size - U32.size)
    if conn.end - text_at < n:
        return False
    conn.said = bytes(conn.mv[text_at : text_at + n]).decode(errors="replace")
    return True


def all_done(ops: list[Transfer]) -> bool:
    """``all(op.done ...)`` without a generator: a spin asks this every pass."""
    for op in ops:  # noqa: SIM110
        if not op.done:
            return False
    return True


def deliver(op: Transfer, data: bytearray | memoryview) -> None:
    """A whole message, into its receive (or the receive fails on a size mismatch); the
    caller holds the engine's lock (``P2P._lock``)."""
    if len(data) != op.length:
        op.error = LaneProtocolError(
            f"a receive of {op.length} B from rank {op.peer} met a message of {len(data)} B "
            f"(tag {op.tag})"
        )
    elif op.length:
        op.view[:] = data
    op.done = True
