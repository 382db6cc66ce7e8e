"""``WaitError``: a transport wait that cannot finish, with its kind and the ranks to blame.

Kinds: ``timeout`` (ranks: those that never entered or answered), ``dead`` (their
process is gone), ``peer_failed`` (they reported a failure or left), ``mismatch`` (they
called a different collective) and ``aborted`` (this rank aborted the communicator).
The backend turns it into the typed error of ``torchcomms.errors``.
"""

from __future__ import annotations

from collections.abc import Sequence


class WaitError(RuntimeError):
    """A wait that cannot finish: ``kind`` says why, ``ranks`` who is to blame."""

    def __init__(self, kind: str, ranks: Sequence[int], message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.ranks = sorted(set(ranks))
