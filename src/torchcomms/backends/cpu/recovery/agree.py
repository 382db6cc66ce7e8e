"""The survivors' agreement on who failed (ULFM's agree), through a store that outlives them.

``agree_failed`` is collective over the members still alive.  Each member starts from
what it knows has failed (the ranks its error named, the ranks the caller excludes) and
runs rounds on the store, led by a *coordinator*: the lowest rank it does not count as
failed.

1. Every member posts its set as ``r{k}/{rank}``.
2. The coordinator waits for round ``k`` from every member it does not count as failed
   (one ``check`` of their keys per poll) and reads them in one ``multi_get``; a member
   it waits for whose process is found gone (``is_dead``) joins its set, and it starts
   round ``k + 1``.  When the union of the sets equals its own, it proposes it as the
   decision (``compare_set`` on ``decided``: the first proposal wins); otherwise it
   adopts the union and starts round ``k + 1``.
3. Every other member waits for ``decided``, or for the coordinator's post of a later
   round (it adopts the coordinator's set, adds its own and posts that round), or for
   the coordinator to be found gone (the next lowest rank leads the next round).

So a member makes O(1) store round trips and reads O(failed) bytes per round, whatever
N; only the coordinator reads every member's post.  Every member returns the one
``decided`` value.  A member that is alive but silent (stopped) is waited for until the
deadline, which names it; excluding it is the caller's choice (``exclude_ranks``).

Runs on the caller's thread; every wait is bounded by the deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch._C._distributed_c10d as c10d

from torchcomms.errors import CommTimeoutError
from torchcomms.ranks import decode_ranks, encode_ranks, ranks_text
from torchcomms.runtime.deadline import Deadline

_POLL_MAX_S = 0.02
_DECIDED = "decided"


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
        store.set(f"r{round_}/{rank}", encode_ranks(failed))
        coordinator = min(r for r in range(size) if r not in failed)
        if coordinator == rank:
            views = _collect(store, round_, size, failed, is_dead, deadline, where)
            if views is not None:
                union = set().union(*views) - {rank}
                if union == failed:
                    decided = store.compare_set(_DECIDED, "", encode_ranks(failed))
                    return frozenset(decode_ranks(decided))
                failed = union
        else:
            later = _follow(store, round_, coordinator, is_dead, deadline, where)
            if later is None:
                return frozenset(decode_ranks(store.get(_DECIDED)))
            failed |= later - {rank}
        if store.check([_DECIDED]):
            return frozenset(decode_ranks(store.get(_DECIDED)))
        round_ += 1


def _collect(
    store: c10d.Store,
    round_: int,
    size: int,
    failed: set[int],
    is_dead: Callable[[int], bool],
    deadline: Deadline,
    where: str,
) -> list[frozenset[int]] | None:
    """The coordinator: every live member's set for this round; ``None`` once a decision
    exists or a member it waited for turned out dead (``failed`` then holds it)."""
    waiting = {r: f"r{round_}/{r}" for r in range(size) if r not in failed}
    pause = 0.0005
    while not store.check(list(waiting.values())):
        if store.check([_DECIDED]):
            return None
        dead = [r for r in waiting if is_dead(r)]
        if dead:
            failed.update(dead)
            return None
        if deadline.passed():
            missing = sorted(r for r, key in waiting.items() if not store.check([key]))
            if not missing:
                break
            raise _timed_out(where, missing)
        time.sleep(min(pause, max(deadline.left_s(), 0.0)))
        pause = min(pause * 2, _POLL_MAX_S)
    return [frozenset(decode_ranks(v)) for v in store.multi_get(list(waiting.values()))]


def _follow(
    store: c10d.Store,
    round_: int,
    coordinator: int,
    is_dead: Callable[[int], bool],
    deadline: Deadline,
    where: str,
) -> frozenset[int] | None:
    """A member: ``None`` once ``decided`` exists, else the failed set to post next round
    (the coordinator's next post, or the coordinator itself once it is found gone)."""
    nxt = f"r{round_ + 1}/{coordinator}"
    pause = 0.0005
    while True:
        if store.check([_DECIDED]):
            return None
        if store.check([nxt]):
            return frozenset(decode_ranks(store.get(nxt)))
        if is_dead(coordinator):
            return frozenset({coordinator})
        if deadline.passed():
            raise _timed_out(where, [coordinator])
        time.sleep(min(pause, max(deadline.left_s(), 0.0)))
        pause = min(pause * 2, _POLL_MAX_S)


def _timed_out(where: str, missing: list[int]) -> CommTimeoutError:
    error = CommTimeoutError(
        f"{where}the agreement on the failed ranks timed out: {ranks_text(missing)} "
        f"alive but never took part (stopped or cut off? exclude them explicitly)"
    )
    error.ranks = tuple(missing)
    return error
