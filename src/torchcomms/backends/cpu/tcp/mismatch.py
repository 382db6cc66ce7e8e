"""``MismatchReport``: the whole picture of a mismatch that one rank saw only in part.

The header exchange (``cpu.tcp.exchange``) shows every rank every header, so each names
who passed what.  A ring op (``transport.tcp.ring``) shows a rank only its neighbour's: the rank
that sees a difference fails, and says so to the ranks it sends to (``FAILED mismatch
…``), which fail in turn around the ring.  Each such rank then publishes its own
``(fingerprint, seq)`` under a per-comm key in the store and reads every other's, so it
too can say ``rank 1 passed count=8, ranks 0, 2 count=4``.  A rank that does not publish
within ``GATHER_S`` (dead, stuck in another kind of op) leaves the pairwise text.

Failure path only, on the op's thread; a comm fails at its first mismatch, so one
report per comm.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta

from torch._C._distributed_c10d import Store

from torchcomms.backends.cpu.tcp.liveness import within
from torchcomms.runtime import fingerprint as F
from torchcomms.runtime.fingerprint import Fingerprint
from torchcomms.transport.errors import WaitError

#: How long a rank waits for the others' headers before it settles for what it saw.
GATHER_S = 3.0


class MismatchReport:
    """Mismatch texts of one rank of one comm (see the module docstring)."""

    def __init__(
        self,
        store: Store | None,
        rank: int,
        size: int,
        announce: Callable[[list[int], str], None] | None = None,
    ) -> None:
        self._store = store
        self.rank = rank
        self.size = size
        #: Tells the ranks waiting on this one (``FAILED mismatch ranks text``); it runs
        #: before this rank waits for the others' headers, or they would wait for it.
        self._announce = announce

    def close(self) -> None:
        """Let go of the store (the comm is released; a report would find nobody)."""
        self._store = None
        self._announce = None

    def full(
        self, what: str, mine: tuple[Fingerprint, int], ranks: list[int], text: str
    ) -> WaitError:
        """This rank saw every header (the header exchange): publish its own for ranks
        that saw only part, and raise."""
        self._say(ranks, text)
        self._publish(mine)
        return self._error(what, ranks, text)

    def pairwise(
        self, what: str, mine: tuple[Fingerprint, int], peer: int, theirs: tuple[Fingerprint, int]
    ) -> WaitError:
        """This rank saw ``peer``'s header differ from its own: the error to raise."""
        pair = [self.rank, peer]
        found = F.mismatch([mine, theirs], pair)
        text = found[1] if found is not None else "different headers"
        text += f" (seen between ranks {min(pair)} and {max(pair)})"
        self._say(sorted(pair), text)
        return self._whole(what, mine, sorted(pair), text)

    def relayed(
        self, what: str, mine: tuple[Fingerprint, int] | None, said: str, by: int
    ) -> WaitError:
        """A peer said ``FAILED mismatch ranks text``: the error to raise here."""
        listed, _, text = said.partition(" ")
        ranks = [int(r) for r in listed.split(",") if r.strip().isdigit()]
        text = text or "different headers"
        self._say(ranks, text)  # on around the ring
        if mine is None:
            return self._error(what, ranks, f"{text} (reported by peer rank {by})")
        return self._whole(what, mine, ranks, f"{text} (reported by peer rank {by})")

    def _whole(
        self, what: str, mine: tuple[Fingerprint, int], ranks: Sequence[int], fallback: str
    ) -> WaitError:
        everyone = self._gather(mine)
        if everyone is not None:
            found = F.mismatch(everyone)
            if found is not None:
                return self._error(what, found[0], found[1])
        return self._error(what, ranks, fallback)

    @staticmethod
    def _error(what: str, ranks: Sequence[int], text: str) -> WaitError:
        return WaitError("mismatch", list(ranks), f"{what}: collective mismatch: {text}")

    def _say(self, ranks: Sequence[int], text: str) -> None:
        if self._announce is not None:
            self._announce(list(ranks), text)

    def _publish(self, mine: tuple[Fingerprint, int]) -> None:
        store = self._store
        if store is not None:
            (digest, desc, count), seq = mine
            key, value = f"hdr/{self.rank}", f"{digest} {desc} {count} {seq}"
            within(1.0, lambda: store.set(key, value), "mismatch")

    def _gather(self, mine: tuple[Fingerprint, int]) -> list[tuple[Fingerprint, int]] | None:
        """Every rank's ``(fingerprint, seq)`` through the store, or None within ``GATHER_S``."""
        store = self._store
        if store is None:
            return None
        keys = [f"hdr/{r}" for r in range(self.size)]
        self._publish(mine)

        def read() -> list[tuple[Fingerprint, int]]:
            out: list[tuple[Fingerprint, int]] = []
            store.wait(keys, timedelta(seconds=GATHER_S))
            for key in keys:
                d, c, n, s = (int(x) for x in store.get(key).decode().split())
                out.append(((d, c, n), s))
            return out

        return within(GATHER_S + 0.5, read, "mismatch")
