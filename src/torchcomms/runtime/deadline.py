"""``Deadline``: the one form of "how long may this op still wait", used by every transport.

An op's timeout becomes an absolute deadline (``time.monotonic()``) once, when the op
starts running; every wait inside the op (a shm flag wait, a gloo call, a store wait)
is bounded by what is left of it, so a composite op never waits longer in total than
its timeout.
"""

from __future__ import annotations

import time
from datetime import timedelta

#: The smallest budget handed to a wait: gloo reads a zero timeout as "wait forever".
_MIN_LEFT_S = 0.001


class Deadline:
    """The absolute end of one op; immutable once made."""

    __slots__ = ("end", "timeout")

    def __init__(self, timeout: timedelta, end: float | None = None) -> None:
        self.timeout = timeout
        self.end = time.monotonic() + timeout.total_seconds() if end is None else end

    def left_s(self) -> float:
        """Seconds left, never below 1 ms (so no wait turns into "no timeout")."""
        return max(self.end - time.monotonic(), _MIN_LEFT_S)

    def passed(self, by_s: float = 0.0) -> bool:
        """Whether the deadline (plus ``by_s``) is behind us (``left_s`` never says so)."""
        return time.monotonic() >= self.end + by_s

    def remaining(self) -> timedelta:
        return timedelta(seconds=self.left_s())

    def __repr__(self) -> str:
        return f"Deadline(timeout={self.timeout.total_seconds():g}s, left={self.left_s():.3f}s)"
