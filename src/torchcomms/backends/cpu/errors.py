"""How the CPU backend names a transport error: a typed error naming comm, op, op_id, peers.

A gloo ``RuntimeError`` is recognised by its text (gloo raises no typed errors): a
timeout or a broken connection is a communicator failure, explained by a dead local peer
when there is one.  A ``WaitError`` carries its kind.  Runs on the failing op's thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta

from torchcomms.errors import (
    CollectiveMismatchError,
    CommAbortedError,
    CommError,
    CommTimeoutError,
    PeerFailureError,
)
from torchcomms.ranks import ranks_text
from torchcomms.transport.errors import WaitError

_TIMEOUT_MARKERS = ("timed out", "timeout")
_PEER_MARKERS = (
    "connection closed by peer",
    "connection reset",
    "pair closure",
    "broken pipe",
    "connection refused",
    "socket closed",
)


def typed_error(
    exc: BaseException,
    prefix: str,
    timeout: timedelta,
    peers: Sequence[int],
    dead_peers: Callable[[], list[int]],
) -> tuple[BaseException, bool]:
    """``(error to raise, whether the communicator failed)`` for an op that raised ``exc``.

    ``prefix`` is ``[TorchCommGloo comm=… rank=…] op op_id=…: ``; ``peers`` are the p2p
    peers of the op (named in a timeout); ``dead_peers()`` lists members known gone.
    """
    if isinstance(exc, CommError):
        return exc, False
    if isinstance(exc, WaitError):
        return _shm_error(exc, prefix, timeout), True
    if not isinstance(exc, RuntimeError):
        return exc, False
    text = str(exc).strip()
    lowered = text.lower()
    timed_out = any(m in lowered for m in _TIMEOUT_MARKERS)
    if not timed_out and not any(m in lowered for m in _PEER_MARKERS):
        return CommError(prefix + text), False
    dead = dead_peers()
    if dead:
        # A dead local peer explains a broken connection or a timeout: say so, by rank.
        error = PeerFailureError(prefix + f"{ranks_text(dead)} died (process gone) ({text})")
        error.ranks = error.dead_ranks = tuple(dead)
        return error, True
    if timed_out:
        waiting = f" waiting for {ranks_text(peers)}" if peers else ""
        return CommTimeoutError(
            prefix + f"timed out after {timeout.total_seconds():g} s{waiting} ({text})"
        ), True
    who = ranks_text(peers) if peers else "a peer"
    return PeerFailureError(prefix + f"{who} failed ({text})"), True


def _shm_error(exc: WaitError, prefix: str, timeout: timedelta) -> CommError:
    error: CommError
    if exc.kind == "timeout":
        error = CommTimeoutError(prefix + f"timed out after {timeout.total_seconds():g} s {exc}")
    elif exc.kind == "mismatch":
        error = CollectiveMismatchError(prefix + str(exc))
    elif exc.kind == "aborted":
        error = CommAbortedError(prefix + str(exc))
    else:  # dead, peer_failed
        error = PeerFailureError(prefix + str(exc))
    error.ranks = tuple(exc.ranks)
    error.dead_ranks = error.ranks if exc.kind == "dead" else ()
    return error
