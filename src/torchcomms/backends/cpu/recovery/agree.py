"""The survivors' agreement on who failed (ULFM's agree), through a store that outlives them.

``agree_failed`` is collective over the members still alive.  Each member starts from
what it knows has failed (the ranks its error named, the ranks the caller excludes) and
runs rounds on the store:

1. it posts its set as ``r{k}/{rank}``;
2. it waits for round ``k`` from every member it does not count as failed; a member it
   waits for whose process is found gone (``is_dead``) joins its set, and it moves on to
   round ``k + 1`` (so a member that dies during the agreement is caught);
3. when all have posted, the union of their sets is compared with its own: equal means
   no member knows more, and it proposes that set as the decision (``compare_set`` on
   ``decided``: the first proposal wins); otherwise it adopts the union and posts again.

Every member reads the one ``decided`` value, also while it waits, so every member
returns the same set.  A member that is alive but silent (stopped) is waited for until
the deadline, which names it; excluding it is the caller's choice (``exclude_ranks``).

Runs on the caller's thread; every wait is bounded by the deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch._C._distributed_c10d as c10d

from torchcomms.deadline import Deadline
from torchcomms.errors import CommTimeoutError
from torchcomms.transport.errors import ranks_text

_POLL_MAX_S = 0.02
_DECIDED = "decided"


def encode(ranks: Iterable[int]) -> str:
    return ",".join(str(r) for r in sorted(set(ranks)))


def decode(text: bytes | str) -> frozenset[int]:
    raw = text.decode() if isinstance(text, bytes) else text
    return frozenset(int(r) for r in raw.split(",") if r)


def agree_failed(
    store: c10d.Store,
    rank: int,
    size: int,
    known: Iterable[int],
    is_dead: Callable[[int], bool],
    deadline: Deadline,
    where: str,
) -> frozenset[int]:
    """The failed set every surviving member agrees on (see the module docstring)."""
    failed = set(known) - {rank}
    round_ = 0
    while True:
        store.set(f"r{round_}/{rank}", encode(failed))
        views = _collect(store, round_, rank, size, failed, is_dead, deadline, where)
        if views is None:  # someone decided, or a member died and we moved on
            if store.check([_DECIDED]):
                return decode(store.get(_DECIDED))
            round_ += 1
            continue
        union = set().union(*views.values())
        if union == failed:
            return decode(store.compare_set(_DECIDED, "", encode(failed)))
        failed = union - {rank}
        round_ += 1


def _collect(
    store: c10d.Store,
    round_: int,
    rank: int,
    size: int,
    failed: set[int],
    is_dead: Callable[[int], bool],
    deadline: Deadline,
    where: str,
) -> dict[int, frozenset[int]] | None:
    """Every live member's set for this round; ``None`` once a decision exists or a member
    this rank waited for turned out dead (``failed`` then holds it)."""
    waiting = {r: f"r{round_}/{r}" for r in range(size) if r not in failed}
    views: dict[int, frozenset[int]] = {}
    pause = 0.0005
    while True:
        for r, key in list(waiting.items()):
            if store.check([key]):
                views[r] = decode(store.get(key))
                del waiting[r]
        if not waiting:
            return views
        if store.check([_DECIDED]):
            return None
        dead = [r for r in waiting if is_dead(r)]
        if dead:
            failed.update(dead)
            return None
        if deadline.passed():
            missing = sorted(waiting)
            error = CommTimeoutError(
                f"{where}the agreement on the failed ranks timed out: {ranks_text(missing)} "
                f"alive but never took part (stopped or cut off? exclude them explicitly)"
            )
            error.ranks = tuple(missing)
            raise error
        time.sleep(min(pause, max(deadline.left_s(), 0.0)))
        pause = min(pause * 2, _POLL_MAX_S)
