"""The shared-memory channel of one communicator: layout, sequence flags, rounds, waiting.

One segment per communicator holds, for every member rank:

* its flag lines (64 bytes each, written only by that rank): ``PUBLISHED`` (the last
  round whose data is in its slot, and per slot parity the *checked word* of the op's
  fingerprint: digest + sequence number, so mismatched collectives fail instead of
  reading stale bytes), ``CONSUMED`` (the last round it finished reading), ``STATE``
  (ok / failed / finalized) and one ``META`` line per slot parity (the fingerprint's
  descriptor and count, to say what differs, and a count peers read);
* two data slots (round ``k`` uses parity ``k % 2``), so a rank may write round ``k + 1``
  while slower peers still read round ``k`` and no trailing barrier is needed: before
  writing round ``k`` a rank waits until every peer has consumed round ``k - 2``;
* point-to-point rings per ordered pair (see ``transport.shm.p2p``).

The round API (every collective is a sequence of rounds, numbered over the channel's
lifetime; ``cpu.shm.collectives`` runs them)::

    k = chan.begin(deadline)       # next round; waits until its slot parity is free
    ...write own slot for round k...
    chan.exchange(k, deadline, fp, "all_gather")  # publish, wait for all, check fp
    ...read the peers' slots for round k...
    chan.finish(k)                 # CONSUMED = k; the channel is now at round k

``begin`` is for a rank that writes its slot or meta line in the round; a rank that only
reads takes ``next_round()`` and waits with ``wait_rank``/``wait_all``.  ``publish``,
``wait_all``, ``wait_rank`` and ``check_fingerprints`` are the steps ``exchange``
bundles; a fingerprint passed to a wait is checked once the wait is over (``None``:
unchecked, as in every round after an op's first).  A round that fails (a raised
``WaitError``) is not finished: the communicator is unusable afterwards anyway.

Ordering relies on x86-64's total store order: data is written (by torch kernels, in
separate calls) before the flag store that publishes it, and readers load the flag
before the data.  The backend only selects this transport on x86-64.

Waiting has one loop (``_until``), used by flag waits (``_wait``: until given flags
reach a round) and by ``poll`` (until a predicate holds: the p2p engine's waits).  It
spins briefly when every rank has a core, then yields for ``WaitPolicy.yield_s``, then
blocks on this rank's futex doorbell (which a peer rings after writing a flag) for at
most ``WaitPolicy.DOZE_S`` at a time, or sleeps with backoff where futexes are missing;
more ranks than cores skip the spin.  From ``_FIRST_CHECK_S`` on, and then every
``_LIVENESS_PERIOD_S``, it checks the deadline, the peers' ``STATE`` and whether the
peers' processes are alive, and raises ``WaitError`` naming the ranks still waited
for, unless what it waited for arrived meanwhile (a peer that delivered, then left, is
not an error).  A flag wait with nothing to wait for returns without allocating.

Threads: a communicator runs one op at a time (on its executor thread, or inline on the
caller's thread for a sync op), so rounds never interleave.  While a collective waits
past its spin phase it calls ``idle`` (the p2p engine's progress, which takes the p2p
lock only if free), so a receive completed on another thread never stalls behind it.
``set_state`` may be called from any thread (failure and abort paths).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence

import torch

from torchcomms.ranks import Named, RankMessage, Ranks, Rename
from torchcomms.runtime.deadline import Deadline
from torchcomms.runtime.fingerprint import Fingerprint, checked_word, unpack_word
from torchcomms.runtime.fingerprint import mismatch as fingerprint_mismatch
from torchcomms.transport import core_sharing
from torchcomms.transport.core_sharing import CoreSharing
from torchcomms.transport.errors import WaitError
from torchcomms.transport.shm import futex
from torchcomms.transport.shm import segment as shm_segment
from torchcomms.transport.shm.layout import (
    _ASLEEP,
    _BELL,
    _CORE,
    CONSUMED,
    DOORBELL,
    META0,
    PUBLISHED,
    STATE,
    Layout,
)
from torchcomms.transport.wait_policy import WaitPolicy

logger = logging.getLogger("torchcomms.transport.shm")


STATE_OK, STATE_FAILED, STATE_FINALIZED, STATE_TIMED_OUT = 0, 1, 2, 3
_STATE_TEXT = {
    STATE_FAILED: "failed",
    STATE_FINALIZED: "finalized the communicator",
    STATE_TIMED_OUT: "timed out",
}

_LIVENESS_PERIOD_S = 0.005
# Ranks a STATE line can name as the cause of a failure (7 words of 63 bits).
_CAUSE_BITS = 7 * 63
# The first deadline/liveness check of a wait: short waits (the common case) never pay for
# reading /proc; the deadline is still honoured to within a few milliseconds.
_FIRST_CHECK_S = 0.002


class ShmChannel:
    """Flags, slots and the round protocol over one mapped segment (see the module docstring)."""

    def __init__(
        self,
        mm: mmap.mmap,
        layout: Layout,
        rank: int,
        pids: Sequence[int],
        policy: WaitPolicy,
        describe: str,
    ) -> None:
        self.rank = rank
        self.size = layout.size
        self.layout = layout
        self.policy = policy
        self._describe = describe  # "comm=NAME", for messages
        self._mm: mmap.mmap | None = mm
        self.flags = memoryview(mm).cast("q")
        self.data = torch.frombuffer(mm, dtype=torch.uint8)
        self._typed: dict[torch.dtype, torch.Tensor] = {torch.uint8: self.data}
        self._views: dict[tuple[object, ...], torch.Tensor] = {}
        self._slots: dict[tuple[object, ...], torch.Tensor] = {}
        self._pids = list(pids)
        self.round = 0
        self._aborted = False
        #: The communicator's collective sequence number, part of every fingerprint.
        self.op_seq = 0
        # Called while a collective waits past its spin phase (the p2p engine's progress).
        self.idle: Callable[[], None] | None = None
        self._peers = [r for r in range(self.size) if r != rank]
        # Flag indices, also used directly by the hot paths (per slot parity for meta lines).
        self.pub_index = layout.rank_flag(rank, PUBLISHED)
        self.cons_index = layout.rank_flag(rank, CONSUMED)
        self.all_pub = [layout.rank_flag(r, PUBLISHED) for r in range(self.size)]
        self.peer_cons = [layout.rank_flag(r, CONSUMED) for r in self._peers]
        self.my_meta = [layout.rank_flag(rank, META0 + p) for p in (0, 1)]
        self._base = self.data.data_ptr()
        self._bell = layout.rank_flag(rank, DOORBELL) + _BELL
        self._asleep = layout.rank_flag(rank, DOORBELL) + _ASLEEP
        self._peer_bells = [
            (layout.rank_flag(r, DOORBELL) + _ASLEEP, layout.rank_flag(r, DOORBELL) + _BELL)
            for r in self._peers
        ]
        self._bells_of = dict(zip(self._peers, self._peer_bells, strict=True))
        self._sharing: CoreSharing | None = None
        if policy.unshare_cores and core_sharing.AVAILABLE and self.size > 1:
            core_of = [layout.rank_flag(r, DOORBELL) + _CORE for r in range(self.size)]
            self._sharing = CoreSharing(self.flags, core_of[rank], core_of[:rank])
        self.all_meta = [[layout.rank_flag(r, META0 + p) for r in range(self.size)] for p in (0, 1)]
        # The checked word of each parity (``write_fingerprint``) sits in the PUBLISHED
        # line, words 1 and 2: a peer reads that line anyway, so checking costs no extra
        # cache-line transfer between cores.
        self.my_word = [self.pub_index + 1 + p for p in (0, 1)]
        self.all_word = [[i + 1 + p for i in self.all_pub] for p in (0, 1)]
        self.peer_word = [[self.all_pub[r] + 1 + p for r in self._peers] for p in (0, 1)]
        #: The fingerprint whose descriptor and count this rank's meta line of each parity
        #: holds (``write_fingerprint`` rewrites them only when they change).
        self.meta_fp: list[Fingerprint | None] = [None, None]

    @property
    def pids(self) -> list[int]:
        """Every member's pid (as the segment records them: ``read_pids``)."""
        return list(self._pids)

    # -- views -----------------------------------------------------------------------------
    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        t = self._typed.get(dtype)
        if t is None:
            t = self.data.view(dtype)
            self._typed[dtype] = t
        return t

    def view(
        self, offset: int, dtype: torch.dtype, shape: tuple[int, ...], strides: tuple[int, ...]
    ) -> torch.Tensor:
        """A (cached) strided view of the segment; ``offset`` in bytes, strides in elements."""
        key = (offset, dtype, shape, strides)
        v = self._views.get(key)
        if v is None:
            v = self.typed(dtype).as_strided(shape, strides, offset // dtype.itemsize)
            if len(self._views) > 4096:
                self._views.clear()
            self._views[key] = v
        return v

    def slot(self, rank: int, k: int, dtype: torch.dtype, numel: int, at: int = 0) -> torch.Tensor:
        """``numel`` elements of ``rank``'s slot for round ``k``, from element ``at``."""
        key = (rank, k & 1, dtype, numel, at)
        v = self._slots.get(key)
        if v is None:
            v = self.view(
                self.layout.slot_offset(k & 1, rank) + at * dtype.itemsize, dtype, (numel,), (1,)
            )
            if len(self._slots) > 4096:
                self._slots.clear()
            self._slots[key] = v
        return v

    def rows(
        self, k: int, dtype: torch.dtype, numel: int, at: int = 0, nranks: int | None = None
    ) -> torch.Tensor:
        """``[nranks, numel]``: the same element range of every rank's slot for round ``k``."""
        itemsize = dtype.itemsize
        n = self.size if nranks is None else nranks
        return self.view(
            self.layout.slot_offset(k & 1, 0) + at * itemsize,
            dtype,
            (n, numel),
            (self.layout.slot_bytes // itemsize, 1),
        )

    def slot_capacity(self, dtype: torch.dtype) -> int:
        return self.layout.slot_bytes // dtype.itemsize

    # -- round protocol (see the module docstring) -----------------------------------------
    def next_round(self) -> int:
        """The round this rank runs next, for a rank that only reads in it (nothing awaited)."""
        return self.round + 1

    def begin(self, deadline: Deadline) -> int:
        """Start the next round ``k`` as a writer: wait until its slot parity is free."""
        k = self.round + 1
        if k > 2:
            flags = self.flags
            for i in self.peer_cons:  # the common case: free already, one call, no allocation
                if flags[i] < k - 2:
                    self.acquire(k, deadline)
                    break
        return k

    def acquire(self, k: int, deadline: Deadline) -> None:
        """Before writing round ``k`` (slot or meta): wait until its last readers are done."""
        if k > 2:
            self._wait(self.peer_cons, self._peers, k - 2, deadline, "to release a slot")

    def publish(
        self, k: int, fingerprint: Fingerprint | None = None, count: int | None = None
    ) -> None:
        """Announce round ``k`` once this rank's slot holds its data.

        ``fingerprint`` (with the current ``op_seq``) and ``count`` (a number every peer
        reads with ``count_of``) go to the round's meta line first; ``None`` leaves those
        words as they were.
        """
        flags = self.flags
        if count is not None:
            flags[self.my_meta[k & 1] + 1] = count
        if fingerprint is not None:
            self.write_fingerprint(k & 1, fingerprint)
        flags[self.pub_index] = k
        self.ring()

    def write_fingerprint(self, parity: int, fingerprint: Fingerprint) -> None:
        """The checked word of ``parity`` (digest + sequence number: all the fast checks
        compare) and, in the meta line of ``parity``, the descriptor and count (words 2 and
        3: read only to say what differs, so written only when they change)."""
        flags = self.flags
        if self.meta_fp[parity] is not fingerprint:
            meta = self.my_meta[parity]
            flags[meta + 2] = fingerprint[1]
            flags[meta + 3] = fingerprint[2]
            self.meta_fp[parity] = fingerprint
        flags[self.my_word[parity]] = checked_word(fingerprint, self.op_seq)

    def count_of(self, k: int, rank: int) -> int:
        """The ``count`` that ``rank`` published with round ``k`` (after waiting for it)."""
        return self.flags[self.all_meta[k & 1][rank] + 1]

    def ring(self) -> None:
        """After writing a flag: wake the peers that went to sleep waiting for one."""
        flags = self.flags
        # Our flag store must be visible before we read the peers' "asleep": _full_fence,
        # inlined (this runs twice per round of the latency path).
        _fence_lock.acquire()
        _fence_lock.release()
        for asleep, bell in self._peer_bells:
            if flags[asleep]:
                flags[bell] += 1
                futex.wake(self._base + bell * 8)

    def ring_rank(self, rank: int) -> None:
        """``ring`` for a flag only ``rank`` waits for (a point-to-point ring's): waking
        every sleeping peer would let ranks with nothing to do take the cores that the
        pair needs, each time (4 ranks on 2 cores: 150-230 us per message)."""
        flags = self.flags
        _fence_lock.acquire()
        _fence_lock.release()
        bells = self._bells_of.get(rank)  # (none for this rank itself)
        if bells is None:
            return
        asleep, bell = bells
        if flags[asleep]:
            flags[bell] += 1
            futex.wake(self._base + bell * 8)

    def wait_all(
        self, k: int, deadline: Deadline, fingerprint: Fingerprint | None = None, what: str = ""
    ) -> None:
        """Wait until every rank has published round ``k``; then check ``fingerprint``."""
        self._wait(self.all_pub, range(self.size), k, deadline, "to arrive")
        if fingerprint is not None:
            self.check_fingerprints(k, fingerprint, what)

    def wait_rank(
        self,
        k: int,
        rank: int,
        deadline: Deadline,
        fingerprint: Fingerprint | None = None,
        what: str = "",
    ) -> None:
        """Wait until ``rank`` has published round ``k``; then check its ``fingerprint``."""
        self._wait([self.all_pub[rank]], [rank], k, deadline, "to arrive")
        if fingerprint is not None:
            self.check_fingerprints(k, fingerprint, what, (rank,))

    def exchange(
        self, k: int, deadline: Deadline, fingerprint: Fingerprint | None = None, what: str = ""
    ) -> None:
        """``publish`` round ``k``, then ``wait_all`` for it (checking ``fingerprint``)."""
        self.publish(k, fingerprint)
        self.wait_all(k, deadline, fingerprint, what)

    def check_fingerprints(
        self, k: int, mine: Fingerprint, what: str, ranks: Sequence[int] | None = None
    ) -> None:
        """After waiting for round ``k``: those ranks called the same op (sizes, root, seq)."""
        flags = self.flags
        want = checked_word(mine, self.op_seq)
        words = self.all_word[k & 1]
        among = range(self.size) if ranks is None else ranks
        for r in among:
            if flags[words[r]] != want:
                break
        else:
            return
        metas = self.all_meta[k & 1]
        every = [
            unpack_word(flags[w], flags[m + 2], flags[m + 3])
            for w, m in zip(words, metas, strict=True)
        ]
        found = fingerprint_mismatch(every)  # None: only some ranks were waited for
        bad = found[0] if found else [r for r in among if every[r] != every[self.rank]]
        message = RankMessage("{}: collective mismatch: {}", what, _Mismatch(every))
        raise WaitError("mismatch", bad or list(among), message)

    def finish(self, k: int) -> None:
        """After reading round ``k``: say so (its slots may be rewritten in round ``k + 2``)."""
        self.flags[self.cons_index] = k
        self.round = k
        self.ring()

    def set_state(self, state: int, dead: Sequence[int] = ()) -> None:
        """Publish this rank's state; a failure caused by dead peers names them (words 1-7
        of the line: a bitmask of channel ranks), so waiting peers blame them, not us."""
        if self._mm is not None:
            line = self.layout.rank_flag(self.rank, STATE)
            for r in dead:
                if 0 <= r < _CAUSE_BITS:
                    self.flags[line + 1 + r // 63] |= 1 << (r % 63)
            self.flags[line] = state
            self.ring()

    def abort(self) -> None:
        """Every wait of this channel, on any thread, raises ``aborted`` at its next check."""
        self._aborted = True

    def _cause(self, rank: int) -> list[int]:
        line = self.layout.rank_flag(rank, STATE)
        return [
            r
            for r in range(min(self.size, _CAUSE_BITS))
            if self.flags[line + 1 + r // 63] >> (r % 63) & 1
        ]

    # -- waiting ---------------------------------------------------------------------------
    def _wait(
        self,
        indices: Sequence[int],
        ranks: Sequence[int],
        value: int,
        deadline: Deadline,
        what: str,
    ) -> None:
        """Wait until ``flags[i] >= value`` for every index (``ranks[j]`` owns ``indices[j]``)."""
        flags = self.flags
        for i in indices:  # the common case: nothing to wait for, no allocation
            if flags[i] < value:
                break
        else:
            return
        pending = [(i, r) for i, r in zip(indices, ranks, strict=False) if flags[i] < value]

        def ready() -> bool:
            pending[:] = [p for p in pending if flags[p[0]] < value]
            return not pending

        self._until(ready, lambda: pending, value, deadline, what, self.idle)

    def poll(
        self,
        ready: Callable[[], bool],
        ranks: Callable[[], Sequence[int]],
        deadline: Deadline,
        what: str,
    ) -> None:
        """Wait until ``ready()``, with the same loop and checks as flag waits.

        ``ranks()`` names the peers still waited for (for liveness checks and errors); a
        peer's failed state counts whatever its flags say.  ``idle`` is not called:
        ``ready`` makes its own progress.
        """
        if ready():
            return
        self._until(ready, lambda: [(-1, r) for r in ranks()], 1, deadline, what, None)

    def _until(
        self,
        ready: Callable[[], bool],
        waiting: Callable[[], list[tuple[int, int]]],
        value: int,
        deadline: Deadline,
        what: str,
        idle: Callable[[], None] | None,
    ) -> None:
        """The one wait loop: until ``ready()`` (policy and checks: the module docstring).

        ``waiting()`` lists the ``(flag index, rank)`` pairs still pending, for the checks
        (index -1: no flag; the flag counts once ``>= value``); ``idle`` runs every pass
        after the spin phase.
        """
        policy = self.policy
        spins = policy.spins
        if spins > 0:
            spin_end = time.monotonic() + policy.spin_s
            while True:
                if ready():
                    return
                spins -= 1
                if spins <= 0 or time.monotonic() >= spin_end:
                    break
        if self._sharing is not None:  # a peer slower than the spin: is it on this core?
            self._sharing.check()
        now = time.monotonic()
        yield_until = now + policy.yield_s
        next_check = now + _FIRST_CHECK_S
        sleep_s = 0.00002
        sched_yield = os.sched_yield
        while not ready():
            if idle is not None:
                idle()
            now = time.monotonic()
            if now >= next_check:
                try:
                    self._check_waiting(waiting(), value, deadline, now, what)
                except WaitError:
                    if ready():  # the peer delivered, then left: not an error
                        return
                    raise
                next_check = now + _LIVENESS_PERIOD_S
            if now < yield_until:
                sched_yield()
            elif futex.AVAILABLE:
                self._doze(ready, min(WaitPolicy.DOZE_S, max(next_check - now, 0.0) + 1e-4))
            else:
                time.sleep(sleep_s)
                sleep_s = min(sleep_s * 2, policy.sleep_max_s)

    def _doze(self, ready: Callable[[], bool], timeout_s: float) -> None:
        """Block until a peer rings this rank's doorbell (or ``timeout_s``), unless ``ready()``."""
        flags = self.flags
        seen = flags[self._bell]
        flags[self._asleep] = 1
        _full_fence()  # "asleep" must be visible before ready() reads the peers' flags
        try:
            if not ready():  # re-check after announcing the sleep: a ring may have been missed
                futex.wait(self._base + self._bell * 8, seen, timeout_s)
        finally:
            flags[self._asleep] = 0

    def _check_waiting(
        self,
        pending: list[tuple[int, int]],
        value: int,
        deadline: Deadline,
        now: float,
        what: str,
    ) -> None:
        if self._aborted:
            raise WaitError("aborted", [], f"the communicator was aborted while waiting {what}")
        ranks = [r for _, r in pending]
        flags = self.flags
        layout = self.layout
        # Dead first: a survivor that failed (or left) because of them must not be blamed.
        dead = [r for r in ranks if not shm_segment.process_alive(self._pids[r])]
        if dead:
            text = "{} died (process gone) while this rank waited for {} {}"
            them = "them" if len(dead) > 1 else "it"
            raise WaitError("dead", dead, RankMessage(text, Ranks(dead), them, what))
        for i, r in pending:
            state = flags[layout.rank_flag(r, STATE)]
            if state != STATE_OK and (i < 0 or flags[i] < value):
                cause = self._cause(r)
                gone = [c for c in cause if not shm_segment.process_alive(self._pids[c])]
                if gone:
                    text = "{} died (process gone); {} failed on it while this rank waited {}"
                    raise WaitError("dead", gone, RankMessage(text, Ranks(gone), Ranks([r]), what))
                missing = [c for c in cause if c != self.rank]
                if state == STATE_TIMED_OUT and missing:
                    # It waited its whole timeout for them: so would we.  Name them, not it.
                    text = "waiting for {} {} ({} timed out waiting for {})"
                    them = "them" if len(missing) > 1 else "it"
                    message = RankMessage(text, Ranks(missing), what, Ranks([r]), them)
                    raise WaitError("timeout", missing, message)
                message = RankMessage("{} {}", Ranks([r]), _STATE_TEXT.get(state, "failed"))
                raise WaitError("peer_failed", [r], message)
        if now >= deadline.end:
            raise WaitError("timeout", ranks, RankMessage("waiting for {} {}", Ranks(ranks), what))

    # -- lifecycle -------------------------------------------------------------------------
    def close(self, state: int = STATE_FINALIZED) -> None:
        """Say goodbye to the peers, then unmap (once no view of the segment is left)."""
        mm = self._mm
        if mm is None:
            return
        self.set_state(state)
        self._mm = None
        self.idle = None
        self._views.clear()
        self._slots.clear()
        self._typed.clear()
        del self.data
        self.flags.release()
        try:
            mm.close()
        except BufferError:  # a view escaped; the mapping goes with its last reference
            logger.debug("shm segment view still referenced at close", extra={})


_fence_lock = threading.Lock()


def _full_fence() -> None:
    """A full memory barrier: x86 may let a later load pass an earlier store, which would let
    a waker miss "asleep" while the sleeper misses the flag (a lost wake-up).  Taking and
    releasing a lock runs locked read-modify-write instructions, which order both."""
    _fence_lock.acquire()
    _fence_lock.release()


class _Mismatch(Named):
    """Who passed what (``fingerprint.mismatch``), in the reader's rank numbering."""

    def __init__(self, every: Sequence[tuple[Fingerprint, int]]) -> None:
        self.every = every

    def text(self, name: Rename | None = None) -> str:
        labels = None if name is None else [name(r) for r in range(len(self.every))]
        found = fingerprint_mismatch(self.every, labels)
        return found[1] if found else "different arguments"
