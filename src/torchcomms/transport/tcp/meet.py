"""Connecting a ``Lane`` (``transport.tcp.lane``) when each rank is told one address only.

Each rank has a *card*: one line of text saying where its listeners are (what is on it is
the caller's business; ``address(card)`` reads the lane listener's ``(host, port, token)``
out of it).  A rank is given its successor's card (rank + 1) and nothing else: O(1) bytes
from the store at any world size.  The other cards it needs travel in the lane's own
handshakes, by pointer doubling:

* in round ``k`` (``d = 2**k``) rank ``r`` dials ``r + d``, saying
  ``HI <token> <r> <k> <r's card>``;
* the accepting rank ``s = r + d`` answers ``AT <card>``: the card of ``s + d``, the rank
  ``s`` itself dials in round ``k``, as soon as it knows it.  ``s + d = r + 2d`` is ``r``'s
  peer in round ``k + 1``.

So ``r`` learns the card of ``r + 2**(k+1)`` from ``r + 2**k``'s answer.  An answer in round
``k`` needs only answers of round ``k - 1``, so there is no cycle: the last one arrives
after ``ceil(log2 n)`` hops.  A rank also keeps the cards of the ranks that dial it
(``r - 2**k``); ``Lane.cards`` holds every lane neighbour's, which is also every link of
the census tree (``backends.cpu.tcp.census``).

Threads: the caller's alone.  Dials are blocking connects (to listening sockets, which
complete without the peer's help); the rest runs non-blocking in one ``poll`` loop, whose
slices call ``between``.
"""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Callable

from torchcomms.transport.tcp.lane import SLICE_MS, Lane, rounds
from torchcomms.transport.tcp.sockets import data_socket

#: The longest handshake line accepted (three listeners' host names fit many times over).
LINE_MAX = 4096
_IN = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP


def connect(
    listener: socket.socket,
    token: str,
    rank: int,
    size: int,
    card: str,
    successor: str,
    address: Callable[[str], tuple[str, int, str]],
    deadline_end: float,
    between: Callable[[list[int]], None],
    spin_s: float = 0.0,
) -> Lane:
    """Dial this rank's senders and accept its receivers, introducing each other.

    ``listener`` was published with ``token`` (dialers must say it) on this rank's
    ``card``; ``successor`` is rank + 1's card.  ``between(missing)`` runs while waiting
    (the ranks that have not dialled in or not answered) and raises to give up.  A peer
    that closes its connection before answering raises ``ConnectionError``.  Closes
    ``listener``.
    """
    if "\n" in card:
        raise ValueError("a card is one line")
    plan = rounds(rank, size)
    meeting = _Meeting(rank, card, plan, successor)
    waiting = select.poll()  # poll, not select: a long-lived process may hold fds > 1024
    try:
        listener.setblocking(False)
        waiting.register(listener, _IN)
        while not meeting.done():
            for sock in meeting.dial_next(address, deadline_end):
                waiting.register(sock, _IN)
            meeting.pay(deadline_end)
            if meeting.done():
                break
            events = waiting.poll(SLICE_MS)
            if not events:
                between(meeting.missing())
                continue
            for fd, _ in events:
                if fd == listener.fileno():
                    for conn in meeting.accept(listener):
                        waiting.register(conn, _IN)
                elif fd in meeting.greeting:
                    if meeting.greet(fd, token):
                        waiting.unregister(fd)
                elif meeting.read_answer(fd):
                    waiting.unregister(fd)
    except BaseException:
        meeting.close()
        raise
    finally:
        listener.close()
    lane = Lane(rank, size, meeting.sends(), meeting.receives(), spin_s)
    lane.cards = meeting.cards
    return lane


class _Meeting:
    """One rank's state while its lane connects (see the module docstring)."""

    def __init__(self, rank: int, card: str, plan: list[tuple[int, int]], successor: str) -> None:
        self.rank = rank
        self.card = card
        self.plan = plan
        #: Round -> the card of the rank this one dials in that round, once known.
        self.known: dict[int, str] = {0: successor} if plan else {}
        #: Rank -> card: every lane neighbour's, as learnt.
        self.cards: dict[int, str] = {}
        self.dialled: list[socket.socket] = []
        self.answered: list[bool] = []
        self.accepted: list[socket.socket | None] = [None] * len(plan)
        self.owed: dict[int, socket.socket] = {}  # round -> accepted, not answered yet
        #: fd -> (accepted connection, what it said so far): dialers whose hello is not
        #: all there yet.  Read as it comes, never waited for: a dialer that a busy
        #: machine holds back between its connect and its hello costs the others nothing.
        self.greeting: dict[int, tuple[socket.socket, bytes]] = {}

    def done(self) -> bool:
        return (
            len(self.dialled) == len(self.plan)
            and all(self.answered)
            and all(s is not None for s in self.accepted)
            and not self.owed
        )

    def missing(self) -> list[int]:
        """Who this rank waits on: senders not dialled in, dialled peers not answering."""
        late = {self.plan[k][0] for k, s in enumerate(self.accepted) if s is None}
        late.update(self.plan[k][1] for k, ok in enumerate(self.answered) if not ok)
        return sorted(late)

    def dial_next(
        self, address: Callable[[str], tuple[str, int, str]], deadline_end: float
    ) -> list[socket.socket]:
        """Dial every round whose peer's card is known and is not dialled yet."""
        out = []
        while len(self.dialled) < len(self.plan) and len(self.dialled) in self.known:
            k = len(self.dialled)
            peer_card = self.known[k]
            host, port, theirs = address(peer_card)
            left = max(deadline_end - time.monotonic(), 0.1)
            sock = socket.create_connection((host, port), timeout=left)
            self.dialled.append(sock)
            self.answered.append(False)
            self.cards[self.plan[k][1]] = peer_card
            data_socket(sock)
            sock.sendall(f"HI {theirs} {self.rank} {k} {self.card}\n".encode())
            sock.setblocking(False)
            out.append(sock)
        return out

    def pay(self, deadline_end: float) -> None:
        """Answer every accepted dialer whose round's card this rank now knows."""
        for k in [k for k in self.owed if k in self.known]:
            conn = self.owed.pop(k)
            conn.settimeout(max(deadline_end - time.monotonic(), 0.1))
            conn.sendall(f"AT {self.known[k]}\n".encode())
            conn.setblocking(False)
            self.accepted[k] = conn

    def accept(self, listener: socket.socket) -> list[socket.socket]:
        """Accept every waiting dialer; their hellos are read by ``greet`` as they come."""
        out: list[socket.socket] = []
        while True:
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return out
            conn.setblocking(False)
            self.greeting[conn.fileno()] = (conn, b"")
            out.append(conn)

    def greet(self, fd: int, token: str) -> bool:
        """Read what a dialer sent of its hello; True once it is settled (one of this
        rank's dialers, owed an answer, or a stray connection, closed)."""
        conn, data = self.greeting[fd]
        try:
            chunk = conn.recv(LINE_MAX - len(data))
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            chunk = b""
        data += chunk
        if chunk and not data.endswith(b"\n") and len(data) < LINE_MAX:
            self.greeting[fd] = (conn, data)
            return False
        del self.greeting[fd]
        hello = _hello(data, token, self.plan) if chunk else None
        if hello is None or self.accepted[hello[0]] is not None or hello[0] in self.owed:
            conn.close()  # not one of ours (a stray client, or it left): ignore it
            return True
        k, their_card = hello
        data_socket(conn)
        self.cards[self.plan[k][0]] = their_card
        self.owed[k] = conn
        return True

    def read_answer(self, fd: int) -> bool:
        """Read a dialled peer's ``AT`` line if it is all there; True once read."""
        k = next(k for k, s in enumerate(self.dialled) if s.fileno() == fd)
        sock = self.dialled[k]
        peer = self.plan[k][1]
        try:
            head = sock.recv(LINE_MAX, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            raise ConnectionError(f"rank {peer} broke the connection before answering") from exc
        if not head:
            raise ConnectionError(f"rank {peer} closed the connection before answering")
        end = head.find(b"\n")
        if end < 0:
            if len(head) >= LINE_MAX:
                raise ConnectionError(f"rank {peer} answered with no line end")
            return False
        line = sock.recv(end + 1).decode(errors="replace").rstrip("\n")
        word, _, their_card = line.partition(" ")
        if word != "AT" or not their_card:
            raise ConnectionError(f"rank {peer} answered {line[:40]!r}, not AT")
        self.answered[k] = True
        if k + 1 < len(self.plan):
            self.known[k + 1] = their_card
        return True

    def sends(self) -> list[socket.socket]:
        return [s for s in self.accepted if s is not None]

    def receives(self) -> list[socket.socket]:
        return list(self.dialled)

    def close(self) -> None:
        greeting = [conn for conn, _ in self.greeting.values()]
        for s in [*self.dialled, *self.owed.values(), *self.sends(), *greeting]:
            s.close()


def _hello(data: bytes, token: str, plan: list[tuple[int, int]]) -> tuple[int, str] | None:
    """``(round, card)`` of a dialling peer from its hello line (``HI token rank round
    card``), or None if it is not one of this rank's."""
    words = data.decode(errors="replace").rstrip("\n").split(" ", 4)
    if len(words) != 5 or words[0] != "HI" or words[1] != token:
        return None
    try:
        peer, k = int(words[2]), int(words[3])
    except ValueError:
        return None
    if not 0 <= k < len(plan) or plan[k][0] != peer:
        return None
    return k, words[4]
