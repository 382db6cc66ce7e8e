"""The error hierarchy: every class is a ``RuntimeError`` so upstream-style ``except RuntimeError`` works."""

from __future__ import annotations

import traceback


class CommError(RuntimeError):
    """Base class of every error raised by a communicator."""

    #: The peer ranks this error blames (dead, missing or differing), when known.
    ranks: tuple[int, ...] = ()
    #: Those of ``ranks`` whose process is known gone.
    dead_ranks: tuple[int, ...] = ()


class CommValidationError(CommError):
    """An argument of a public call is invalid (wrong size, rank out of range, bad dtype)."""


class CommStateError(CommError):
    """The communicator is in a state that forbids the call (finalized, not initialized)."""


class CommTimeoutError(CommError):
    """A blocking wait passed its deadline."""


class PeerFailureError(CommError):
    """A peer died or its connection broke while this rank waited for it."""


class CommAbortedError(CommError):
    """The communicator was aborted; later operations fail fast."""


class CommRevokedError(CommError):
    """A member revoked the communicator (``revoke()``); recover with ``shrink`` or ``reconfigure``."""


class CollectiveMismatchError(CommError):
    """Ranks issued different collectives at the same sequence number."""


class RemoteAccessError(CommError):
    """A one-sided access was refused by the memory's owner: a wrong or stale access key (the
    memory was deregistered), or a range outside the registered memory (``torchcomms._transport``)."""


class BackendNotImplementedError(CommError):
    """The backend does not implement the called method (upstream's "pure virtual" error)."""


def forget_frames(exc: BaseException) -> None:
    """Drop the locals of every finished frame an exception chain holds (the text of its
    traceback stays): an error a caller or the flight recorder keeps must not keep what
    those frames held alive (a gloo call, and through it a store server)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        current = current.__cause__ or current.__context__
