"""``WaitError``, a transport wait that cannot finish, and ``ranks_text``, how errors name ranks.

Kinds: ``timeout`` (ranks: those that never entered or answered), ``dead`` (their
process is gone), ``peer_failed`` (they reported a failure or left), ``mismatch`` (they
called a different collective) and ``aborted`` (this rank aborted the communicator).
The backend turns it into the typed error of ``torchcomms.errors``.

``ranks_text`` is the one formatter every layer uses to name ranks in a message
(``peer rank 2``, ``peer ranks 1, 3``; ``rank 2`` with ``noun="rank"``), so a user
greps one shape whichever layer raised.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class WaitError(RuntimeError):
    """A wait that cannot finish: ``kind`` says why, ``ranks`` who is to blame."""

    def __init__(self, kind: str, ranks: Sequence[int], message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.ranks = sorted(set(ranks))


def ranks_text(ranks: Iterable[int], noun: str = "peer rank") -> str:
    """``peer rank 2`` / ``peer ranks 1, 3`` (sorted, each once)."""
    unique = sorted(set(ranks))
    return f"{noun}{'s' if len(unique) > 1 else ''} {', '.join(map(str, unique))}"


def encode_ranks(ranks: Iterable[int]) -> str:
    """``1-4,9``: sorted ranks as ranges."""
    runs: list[list[int]] = []
    for r in sorted(set(ranks)):
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def decode_ranks(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.split(","):
        if part:
            first, _, last = part.partition("-")
            out.update(range(int(first), int(last or first) + 1))
    return out
