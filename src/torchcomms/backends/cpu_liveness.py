"""``Liveness``: who of a gloo communicator is gone, and who never entered a timed-out op.

gloo's own errors neither name a peer nor reach the survivors that are not a dead
rank's ring neighbours, so the tcp and hierarchical paths keep their own facts:

* **Dead peers on this host**, from their pids (a zombie counts as dead), checked by a
  watcher thread every ``period_s``; an op waiting in gloo polls ``dead`` between
  short wait slices, so every survivor learns within about a period, whether or not it
  talks to the dead rank.
* **Who entered which op**: the op thread bumps ``seq`` as it enters a collective (a
  plain int store, no lock); the watcher publishes it to the store when it changed
  (``lv/seq/{rank}``: one ``set`` per period at most, O(1) per rank).  On a timeout the
  failing rank reads every member's value once (the failure path only) and names the
  ranks that never entered.

Threads: one daemon watcher per communicator (``torchcomms-liveness-NAME``); ``dead``
is replaced whole (a tuple), so readers on any thread need no lock.  ``close`` stops the
watcher within a period.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import torch._C._distributed_c10d as c10d

from torchcomms.transport import shm_segment

logger = logging.getLogger("torchcomms.backends.cpu_liveness")

#: How often the watcher checks pids and publishes this rank's op sequence number.
PERIOD_S = 0.05


def process_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP, a debugger): alive, but never answers."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


class Liveness:
    """Per-communicator facts about the peers (see the module docstring)."""

    def __init__(
        self,
        store: c10d.Store,
        rank: int,
        peers: Sequence[tuple[str, int]],
        name: str,
        period_s: float = PERIOD_S,
    ) -> None:
        self.rank = rank
        self.size = len(peers)
        self._store = store
        self._period_s = period_s
        me = peers[rank][0]
        self._local = [(r, pid) for r, (host, pid) in enumerate(peers) if r != rank and host == me]
        self._pids = {r: pid for r, (host, pid) in enumerate(peers) if host == me}
        #: The collective this rank entered last (written by the op thread).
        self.seq = 0
        self._published = 0
        #: Ranks whose process is known gone, sorted.
        self.dead: tuple[int, ...] = ()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, name=f"torchcomms-liveness-{name}", daemon=True
        )
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self._period_s):
            self.check_pids()
            seq = self.seq
            if seq != self._published:
                try:
                    self._store.set(f"seq/{self.rank}", str(seq))
                    self._published = seq
                except Exception:  # the store's host may be gone; pids still tell
                    logger.debug("liveness: publishing seq failed", exc_info=True)

    def check_pids(self) -> tuple[int, ...]:
        """Refresh and return ``dead`` from the local peers' pids."""
        dead = tuple(r for r, pid in self._local if not shm_segment.process_alive(pid))
        if dead != self.dead and dead:
            self.dead = tuple(sorted(set(self.dead) | set(dead)))
        return self.dead

    def stopped(self) -> list[int]:
        """Local peers that are stopped (state T): alive, but not running."""
        return [r for r, pid in self._local if process_stopped(pid)]

    def missing(self, seq: int, ranks: Sequence[int] | None = None) -> list[int]:
        """Ranks (of ``ranks``, default all) that never entered collective ``seq``.

        Failure path only: waits one period so live peers' watchers publish, then reads
        every member's published sequence number (a rank with none entered nothing).
        """
        time.sleep(2 * self._period_s)
        among = [r for r in (range(self.size) if ranks is None else ranks) if r != self.rank]
        keys = [f"seq/{r}" for r in among]
        try:
            present = [self._store.check([k]) for k in keys]
            values = [
                int(self._store.get(k).decode()) if ok else 0
                for k, ok in zip(keys, present, strict=True)
            ]
        except Exception:
            logger.debug("liveness: reading seqs failed", exc_info=True)
            return []
        return [r for r, v in zip(among, values, strict=True) if v < seq]

    def close(self) -> None:
        self._stop.set()
