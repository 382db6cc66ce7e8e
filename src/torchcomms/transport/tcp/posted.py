"""``Owed``: the frames a two-rank lane's peer still owes this rank, and their checks.

Why: the rank of a two-rank broadcast or reduce that receives nothing (the broadcast's
root, the reduce's other rank) needs nothing from its peer but the peer's header, which
only says whether the two agreed.  Waiting for it makes every such op a meeting of the two
ranks, and with every core busy each meeting costs a scheduling delay (0.1-0.5 ms on the
2-core VM), where gloo's root returns once its bytes are out and runs ahead.  So the rank
sends (``Lane.post``, or the ring's steps) and returns; the peer's frame for that op is
*owed*, and is read and checked (``settle``) before this rank next reads the lane, or as
soon as it is there when the rank posts again.  A mismatch, a peer gone or a peer that
never sends then surfaces at this rank's next collective on the communicator
(benchmarks/results/issue53/NOTES.md, step 13).

At most ``MAX_OWED`` frames are owed: past that, posting waits for the oldest, so a rank
runs at most that many ops ahead and the peer's socket never fills with headers.

Threads: the op's thread (one op at a time per communicator), as the lane itself.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

#: How many ops a rank may run ahead of its peer's headers.
MAX_OWED = 64
#: ``check(block)``: the peer's block (its header first) of an op this rank posted; raises
#: when the two disagree.  None: read and drop (the mismatch check is off).
OwedCheck = Callable[[memoryview], None] | None


class _Frames(Protocol):
    """What ``Owed`` reads from: a lane connection's inbox (``transport.tcp.lane``)."""

    def frame(self, peer: int) -> memoryview | None: ...
    def fill(self) -> None: ...
    def consume(self) -> None: ...


class _Poller(Protocol):
    """``select.poll``'s one call used here."""

    def poll(self, timeout: float | None = ..., /) -> list[tuple[int, int]]: ...


class _Round(Protocol):
    """A lane round (``transport.tcp.lane.LaneRound``): the inbox from ``recv_from``."""

    @property
    def recv_from(self) -> int: ...
    @property
    def inbox(self) -> _Frames: ...
    @property
    def poller(self) -> _Poller: ...


class Owed:
    """The checks of the frames ``rd``'s peer owes, oldest first."""

    __slots__ = ("_await_in", "checks", "rd")

    def __init__(self, rd: _Round, await_in: Callable[[], bool]) -> None:
        self.rd = rd
        #: Blocks one wait slice for bytes from ``rd``'s peer (read into the inbox): whether
        #: any came.  Raises when the connection broke (``Lane.await_in``).
        self._await_in = await_in
        self.checks: deque[OwedCheck] = deque()

    def add(self, check: OwedCheck, between: Callable[[], None]) -> None:
        """One more frame owed; then read those already there, and wait for the oldest
        while more than ``MAX_OWED`` are owed."""
        self.checks.append(check)
        self.settle(between, wait=False)
        while len(self.checks) > MAX_OWED:
            self._one(between, wait=True)

    def settle(self, between: Callable[[], None], wait: bool = True) -> None:
        """Read and check every owed frame (``wait``), or those already arrived."""
        while self.checks:
            if not self._one(between, wait):
                return

    def _one(self, between: Callable[[], None], wait: bool) -> bool:
        """The oldest owed frame, read and checked; False if it is not there and not
        ``wait``.  A goodbye or a lost connection raises ``LanePeerGone``."""
        rd = self.rd
        inbox = rd.inbox
        body = inbox.frame(rd.recv_from)
        # Not waiting (after each post): ask ``poll`` first, 0.7 us, where a ``recv`` that
        # finds nothing costs 3 us (``transport.tcp.lane``).
        if body is None and (wait or rd.poller.poll(0)):
            inbox.fill()
            body = inbox.frame(rd.recv_from)
        while body is None:
            if not wait:
                return False
            if not self._await_in():
                between()
            body = inbox.frame(rd.recv_from)
        check = self.checks.popleft()
        try:
            if check is not None:
                check(body[4:])  # past the block's own length: a lane frame holds one block
        finally:
            inbox.consume()
        return True
