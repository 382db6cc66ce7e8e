"""``WaitError``: a transport wait that cannot finish, with the ranks to blame as data.

Kinds: ``timeout`` (ranks: those that never entered or answered), ``dead`` (their
process is gone), ``peer_failed`` (they reported a failure or left), ``mismatch`` (they
called a different collective) and ``aborted`` (this rank aborted the communicator).
The backend turns it into the typed error of ``torchcomms.errors``.

Ranks are named in the one vocabulary of ``torchcomms.ranks``; a message may be a
``RankMessage`` (kept as ``message``), so a layer that numbers the ranks differently renders
it with its own numbering (``message.text(name)``) rather than rewriting its text.
"""

from __future__ import annotations

from collections.abc import Sequence

from torchcomms.ranks import RankMessage


class WaitError(RuntimeError):
    """A wait that cannot finish: ``kind`` says why, ``ranks`` who is to blame, ``message``
    the text with its ranks as data (``str(error)`` renders it as raised)."""

    def __init__(self, kind: str, ranks: Sequence[int], message: str | RankMessage) -> None:
        self.message = message if isinstance(message, RankMessage) else RankMessage("{}", message)
        super().__init__(self.message.text())
        self.kind = kind
        self.ranks = sorted(set(ranks))
