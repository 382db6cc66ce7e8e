"""``TcpWaiter``: how the tcp path waits (gloo's calls and its own TCP lanes), so every
wait has a deadline and a name.

* A collective's gloo work is waited on in short slices (``SLICE``, non-destructive for
  gloo's collective works); between slices the waiter checks the abort flag, the peers'
  liveness (``cpu.tcp.liveness``) and the op's deadline.
* Send/recv do not use gloo (``transport/tcp/p2p``); their waits call ``check_p2p``.
* A gloo error names no peer: a broken connection waits up to ``ATTRIBUTION_S`` for a
  dying local peer's pid to show, then names it.
* A timeout names the ranks that never entered the op (a census of the members,
  ``cpu.tcp.census``), else the stopped ones, else says the transport stalled.

``left`` keeps the gloo calls a wait gave up on while they still ran: their process group
must not be destroyed before they end (that would join the stuck call's thread); ``busy``
says whether one still runs.  Runs on the op's thread; ``aborted`` may be set from any thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from torchcomms.backends.cpu.tcp.liveness import Liveness
from torchcomms.backends.cpu.tcp.mismatch import MismatchReport
from torchcomms.ranks import ranks_text
from torchcomms.runtime.deadline import Deadline
from torchcomms.runtime.fingerprint import Fingerprint
from torchcomms.transport.errors import WaitError
from torchcomms.transport.tcp.lane import GAVE_UP, Lane, LanePeerGone

#: One wait slice: how soon a waiting op sees a dead peer, an abort or its deadline.
SLICE = timedelta(milliseconds=50)
_SLICE_S = SLICE.total_seconds()
#: gloo's own timeouts (the process group's default, and per call when an op's timeout
#: is longer) run this much past the op's deadline: a backstop, so ours names who is missing.
GLOO_MARGIN_S = 5.0
GLOO_MARGIN = timedelta(seconds=GLOO_MARGIN_S)
#: How long a broken connection waits for a local peer's death to show before it is
#: reported as a failure of an unnamed peer.
ATTRIBUTION_S = 1.0


class TcpWaiter:
    """Every wait of one tcp communicator: gloo's works, the lane, p2p (module docstring)."""

    def __init__(
        self,
        rank: int,
        dead_peers: Callable[[], list[int]],
        liveness: Liveness | None,
        seq: Callable[[], int],
        lane: Lane | None = None,
        report: MismatchReport | None = None,
    ) -> None:
        self.rank = rank
        self.liveness = liveness
        self._dead_peers = dead_peers
        self._seq = seq
        self.aborted = False
        #: The communicator's lane: a gloo wait also listens there for a peer's goodbye
        #: (a peer that failed says whom it blames, so this rank need not time out).
        self.lane = lane
        #: Mismatches seen in part (ring ops) made whole (``cpu.tcp.mismatch``).
        self.report = report if report is not None else MismatchReport(None, rank, 1)
        #: ``(fingerprint, seq)`` of the collective in flight, for a relayed mismatch.
        self.current: tuple[Fingerprint, int] | None = None
        #: gloo calls a wait gave up on while they ran (``busy``), under ``_left_lock``.
        self.left: list[Any] = []
        self._left_lock = threading.Lock()
        #: The gloo call being waited for, if any (read by ``busy`` on another thread).
        self._waiting: Any = None

    def wait(
        self, work: Any, deadline: Deadline, what: str, peers: Sequence[int] | None = None
    ) -> None:
        """Wait for one gloo call in slices; between them: abort, dead peers, the deadline.

        ``peers``: the ranks a point-to-point op waits for (a collective names the ranks
        that never entered it).
        """
        self._waiting = work
        try:
            self._wait(work, deadline, what, peers)
        finally:
            self._waiting = None

    def _wait(self, work: Any, deadline: Deadline, what: str, peers: Sequence[int] | None) -> None:
        while True:
            try:
                work.wait(SLICE)
                return
            except RuntimeError:
                if work.is_completed():
                    try:
                        work.wait()  # the call's own outcome: its error, or it just finished
                    except RuntimeError as exc:
                        raise self._explained(exc, what) from exc
                    return
            try:
                self._between_slices(deadline, what, peers, lane_news=True)
            except WaitError:
                with self._left_lock:
                    self.left.append(work)  # the call still runs inside gloo
                raise

    def busy(self) -> bool:
        """Whether a gloo call of this communicator may still run (any thread)."""
        waiting = self._waiting
        if waiting is not None and not waiting.is_completed():
            return True
        with self._left_lock:
            # An ended call's work holds its gloo context, and through it the comm's store
            # (rank 0's server): let go of it at once.
            self.left = [work for work in self.left if not work.is_completed()]
            return bool(self.left)

    def check(self, deadline: Deadline, what: str) -> None:
        """Between two wait slices of a collective: abort, dead peers, the deadline."""
        self._between_slices(deadline, what, None)

    def check_p2p(self, deadline: Deadline, what: str, peers: Sequence[int]) -> None:
        """Between two wait slices of a send/recv with ``peers``: also the lane's news (a
        peer's goodbye there, or its lost connection: how a remote death shows)."""
        self._between_slices(deadline, what, peers, lane_news=True)

    def gone(self, exc: LanePeerGone, what: str) -> WaitError:
        """A lane peer's connection ended: adopt what it said, else find out who died."""
        peer, said = exc.peer, exc.said
        if said == "BYE":
            return WaitError(
                "peer_failed",
                [peer],
                f"peer rank {peer} finalized the communicator while this rank waited in {what}",
            )
        if said is not None:
            kind, _, listed = said.partition(" ")[2].partition(" ")
            ranks = [int(r) for r in listed.split(",") if r.strip().isdigit()]
            lv = self.liveness
            if kind == "dead" and ranks:
                if not (lv is not None and lv.known_alive(ranks)):
                    return _died(ranks, what, "(reported by the peer it waited for)")
                return WaitError(  # they live (on this host): failed, as the peer saw it
                    "peer_failed",
                    ranks,
                    f"{ranks_text(ranks)} failed while this rank waited in {what} (peer rank "
                    f"{peer} reports them dead; this rank sees them alive)",
                )
            if kind == "peer" and ranks:
                return WaitError(
                    "peer_failed",
                    ranks,
                    f"{ranks_text(ranks)} failed while this rank waited in {what} "
                    "(reported by the peer it waited for)",
                )
            if kind == "mismatch":
                return self.report.relayed(what, self.current, listed, peer)
            if kind == "timeout" and ranks:
                # The peer's deadline came first; ask who never entered, as our own would.
                missing = [] if lv is None else lv.missing(self._seq())
                if set(ranks) & set(missing):
                    return self._timed_out(what, None, missing)
                return WaitError(
                    "timeout",
                    ranks,
                    f"waiting for {ranks_text(ranks)} in {what} (the peer this rank waited "
                    "for timed out waiting for them)",
                )
            dead = self._dead_peers()
            if dead:  # the likely reason it failed
                return _died(dead, what)
            verb = "aborted its communicator" if kind == "aborted" else "failed"
            return WaitError("peer_failed", [peer], f"peer rank {peer} {verb} (in {what})")
        lv = self.liveness
        remote = lv is not None and peer in lv.elsewhere()
        where = f" on host {lv.host_of(peer)}" if lv is not None and remote else ""
        if exc.cause is not None and _network_gave_up(exc.cause):
            # This rank's kernel gave the connection up (its bytes went unacknowledged for
            # the user timeout, or no route): the network broke it, not a death.
            return WaitError(
                "peer_failed",
                [peer],
                f"the connection to peer rank {peer}{where} broke while this rank waited in "
                f"{what}: {exc.cause}; the network between the hosts dropped it (the peer's "
                "process may still run: it fails its op naming this rank)",
            )
        # A local peer's death shows in its pid within moments; a remote one's never does,
        # but its listener answers while it lives (``cpu.tcp.probe``).
        dead = self._dead_soon(0.0 if remote else ATTRIBUTION_S)
        if dead:
            return _died(dead, what)
        how = f" ({exc.cause})" if exc.cause else ""
        alive = lv.probe_peer(peer) if lv is not None and remote else None
        if remote and alive is False:
            return WaitError(
                "dead",
                [peer],
                f"{ranks_text([peer])} died (process gone): its connection ended without a "
                f"goodbye while this rank waited in {what}",
            )
        if remote and alive is None:  # neither seen alive nor gone: the way there is cut
            return WaitError(
                "peer_failed",
                [peer],
                f"the connection to peer rank {peer}{where} ended{how} while this rank waited "
                f"in {what}, and its host cannot be reached: the network between the hosts "
                "is down, or the host is",
            )
        return WaitError(
            "peer_failed",
            [peer],
            f"peer rank {peer}{where} closed its connection{how} while this rank waited in {what}",
        )

    def _explained(self, exc: RuntimeError, what: str) -> RuntimeError:
        """A gloo error names no peer: a broken connection is usually a peer that is
        dying right now, so give its pid a moment to show it (the failure path only)."""
        text = str(exc).strip()
        if not _broken(text):
            return exc
        dead = self._dead_soon(ATTRIBUTION_S)
        if not dead:
            return exc
        return _died(dead, what, f"({text})")

    def _dead_soon(self, within_s: float) -> list[int]:
        """The dead local peers, polled for up to ``within_s`` until one shows."""
        give_up = time.monotonic() + within_s
        while True:
            dead = self._dead_peers()
            if dead or time.monotonic() >= give_up:
                return dead
            time.sleep(0.01)

    def _between_slices(
        self,
        deadline: Deadline,
        what: str,
        peers: Sequence[int] | None,
        lane_news: bool = False,
    ) -> None:
        if self.aborted:
            raise WaitError("aborted", [], f"{what}: the communicator was aborted")
        dead = self._dead_peers()
        if dead:
            raise _died(dead, what)
        if lane_news and self.lane is not None:
            gone = self.lane.news()
            # A finalize is news only to a collective (every member takes part) or to a
            # send/recv with that very peer; other peers may well be done.
            if gone is not None and (gone.said != "BYE" or peers is None or gone.peer in peers):
                raise self.gone(gone, what)
        if time.monotonic() >= deadline.end:
            raise self._timed_out(what, peers)

    def _timed_out(
        self, what: str, peers: Sequence[int] | None, missing: Sequence[int] | None = None
    ) -> WaitError:
        """The timeout, naming who never entered the op (or, else, who is stopped);
        ``missing`` is the census's answer where the caller already asked it."""
        lv = self.liveness
        if peers is not None:
            return WaitError("timeout", peers, f"waiting for {ranks_text(peers)} in {what}")
        if missing is None:
            missing = [] if lv is None else lv.missing(self._seq())
        if missing:
            assert lv is not None
            quiet = sorted((lv.verdict.silent | lv.verdict.unknown) & set(missing))
            notes = [f"collective #{self._seq()} of this comm"]
            if quiet:
                notes.append(f"{ranks_text(quiet)} did not answer: stopped or cut off")
            if lv.verdict.gone:
                notes.append(f"{ranks_text(sorted(lv.verdict.gone))} left or died meanwhile")
            return WaitError(
                "timeout",
                missing,
                f"waiting for {ranks_text(missing)}, which never entered {what} "
                f"({'; '.join(notes)})",
            )
        stopped = [] if lv is None else lv.stopped()
        if stopped:
            return WaitError(
                "timeout", stopped, f"in {what}: {ranks_text(stopped)} stopped (not running)"
            )
        return WaitError(
            "timeout", [], f"in {what}: every rank entered it, but the transport made no progress"
        )


def _died(dead: Sequence[int], what: str, detail: str = "") -> WaitError:
    text = f"{ranks_text(dead)} died (process gone) while this rank waited in {what}"
    return WaitError("dead", dead, f"{text} {detail}" if detail else text)


def _network_gave_up(cause: str) -> bool:
    """Whether this rank's own kernel gave the connection up (``lane.GAVE_UP``)."""
    return cause.startswith(GAVE_UP)


def _broken(text: str) -> bool:
    """Whether a gloo error says a connection broke (closed or reset by the peer)."""
    lowered = text.lower()
    return "closed" in lowered or "reset" in lowered
