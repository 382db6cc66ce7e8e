"""Where everything sits in a communicator's shared-memory segment: flag lines, then slots.

One cache line of int64 flag words per rank and stage (each written only by its owner), one
per ordered pair for the pair rings, then the double-buffered collective slots and the
pair slots.  ``ShmChannel`` (``channel``) and ``ShmP2P`` (``p2p``) read these offsets.
"""

from __future__ import annotations

LINE = 64
_Q = LINE // 8  # int64 words per line
PAGE = 4096

# Flag lines per rank.
PUBLISHED, CONSUMED, STATE, META0, META1, DOORBELL = range(6)
_RANK_LINES = 6
# The DOORBELL line: word 0 is the futex word its owner sleeps on (bumped by whoever wakes
# it), word 1 says "I may be asleep: ring me after you write a flag", word 2 is the rank's
# pid (written by the segment's creator, so members learn each other's pids without the
# store: ``pid_words``), word 3 the core its waiting thread last ran on, plus one
# (``transport.core_sharing``).
_BELL, _ASLEEP, _PID, _CORE = 0, 1, 2, 3
# Flag lines per ordered pair (src -> dst): SENT/PMETA0/PMETA1 written by src, ACKED by dst.
SENT, ACKED, PMETA0, PMETA1 = range(4)
_PAIR_LINES = 4


class Layout:
    """Byte offsets inside a communicator's segment."""

    def __init__(self, size: int, slot_bytes: int, pair_bytes: int) -> None:
        if slot_bytes % PAGE or pair_bytes % PAGE or slot_bytes <= 0 or pair_bytes <= 0:
            raise ValueError("shm slot sizes must be positive multiples of 4096 bytes")
        self.size = size
        self.slot_bytes = slot_bytes
        self.pair_bytes = pair_bytes
        lines = size * _RANK_LINES + size * size * _PAIR_LINES
        self.flags_bytes = -(-lines * LINE // PAGE) * PAGE
        self.coll_bytes = 2 * size * slot_bytes
        self.total = self.flags_bytes + self.coll_bytes + size * size * 2 * pair_bytes

    def rank_flag(self, rank: int, line: int) -> int:
        """Index (in int64 words) of one of ``rank``'s flag lines."""
        return (rank * _RANK_LINES + line) * _Q

    def pair_flag(self, src: int, dst: int, line: int) -> int:
        return ((self.size * _RANK_LINES) + (src * self.size + dst) * _PAIR_LINES + line) * _Q

    def slot_offset(self, parity: int, rank: int) -> int:
        return self.flags_bytes + (parity * self.size + rank) * self.slot_bytes

    def pair_offset(self, src: int, dst: int, parity: int) -> int:
        return (
            self.flags_bytes
            + self.coll_bytes
            + ((src * self.size + dst) * 2 + parity) * self.pair_bytes
        )


def pid_words(layout: Layout) -> list[int]:
    """Where each member's pid sits (int64 words), written by the segment's creator."""
    return [layout.rank_flag(r, DOORBELL) + _PID for r in range(layout.size)]
