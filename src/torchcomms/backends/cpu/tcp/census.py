"""Who entered a timed-out collective: a census over a tree of the members' liveness
listeners, so a timeout names the ranks that never entered it in bounded time at any N,
and running ops cost the store nothing.

The tree is the binomial tree rooted at comm rank 0: rank r's children are r + 2^j for
2^j < lowbit(r) (rank 0: every 2^j < N), its subtree the ranks [r, r + lowbit(r)), its
parent r - lowbit(r).  Every one of them is r's lane neighbour (``transport.tcp.lane``:
r +- 2^j), whose listener address r learnt in the lane's handshakes at connect
(``transport.tcp.meet``, ``cpu.select``), so a census reads the store only to reach past
a silent member.

Requests, one per connection, a line each; the node says ``ACK`` at once (from its
liveness watcher), then answers ``ANS behind;silent;unknown;gone`` (rank ranges):

* ``ASK s b``: which ranks of your subtree have not entered collective ``s``?  The node
  asks its children the same and merges their answers with its own.
* ``FULL s b``: the verdict for the whole comm (from a rank whose op timed out, to its
  parent).  A node forwards one ``FULL s`` to its own parent however many children ask,
  and hands the answer to each; rank 0 runs the ``ASK`` survey.

``b`` is the budget in milliseconds; each hop passes on a little less (``hop_s``), so
answers reach the asker before it gives up.  A node that does not ``ACK`` within
``ACK_S`` (stopped, cut off) or cannot be reached is *silent*; one that refuses the
connection or closes it unanswered is *gone* (it died, or left the comm after its own
timeout: by default a timeout ends the process).  Either way its parent asks the node's
children itself (addresses from the store: the failure path only), still taking the
node's own answer should it come late; a ``FULL`` goes on to the grandparent, and when
rank 0 is not there, the asker surveys the comm itself.  What could not be asked in time
is *unknown*.  A timeout names behind + silent + unknown; the gone are said apart
(whether they entered cannot be known, and their deaths are the liveness watcher's to
report).

Cost: O(N) messages in all, O(log N) per member; time: about 4 log2 N hops plus
``2 * ACK_S`` per silent member on a path, capped by ``BUDGET_S`` (plus at most one
bounded address read, ``ADDRESS_S``).

Threads: the asker runs on its op thread; a node's share runs on a short-lived daemon
thread (``torchcomms-census``) that the watcher starts for each request.  Verdicts are
cached per (kind, collective) with an ``Event`` while pending, so concurrent requests
share one survey.  Each socket has one owner thread.
"""

from __future__ import annotations

import contextlib
import errno
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from torchcomms.ranks import decode_ranks, encode_ranks

#: How long a census may take, from the asker's timeout to its verdict.
BUDGET_S = 1.5
#: How long a node has to acknowledge a request before it counts as silent.
ACK_S = 0.25
#: The most a hop keeps of the budget for itself (less on deep trees: ``hop_s``).
HOP_MAX_S = 0.05
#: The longest a member's address may take to read from the store (``Member``).
ADDRESS_S = 0.25
#: How many collectives' verdicts a node keeps.
_CACHED = 8


def hop_s(size: int, budget_s: float = BUDGET_S) -> float:
    """What each hop keeps of the budget: a census runs about 4 log2 N hops deep."""
    depth = max((size - 1).bit_length(), 1)
    return min(HOP_MAX_S, 0.8 * budget_s / (4 * depth))


def parent(rank: int) -> int:
    return rank - (rank & -rank)


def subtree_span(rank: int, size: int) -> int:
    """How many ranks the subtree rooted at ``rank`` holds (from ``rank`` on)."""
    return size if rank == 0 else min(rank & -rank, size - rank)


def children(rank: int, size: int) -> list[int]:
    span = subtree_span(rank, size)
    out, d = [], 1
    while d < span:
        out.append(rank + d)
        d *= 2
    return out


@dataclass
class Verdict:
    """Of the ranks asked about: behind (alive, never entered), silent (did not answer),
    unknown (could not be asked in time), gone (refused: dead, or left the comm)."""

    behind: set[int] = field(default_factory=set)
    silent: set[int] = field(default_factory=set)
    unknown: set[int] = field(default_factory=set)
    gone: set[int] = field(default_factory=set)

    def merge(self, other: Verdict) -> None:
        self.behind |= other.behind
        self.silent |= other.silent
        self.unknown |= other.unknown
        self.gone |= other.gone

    def missing(self) -> set[int]:
        """The ranks a timeout names: not known to have entered, and not gone."""
        return self.behind | self.silent | self.unknown

    def encode(self) -> str:
        parts = (self.behind, self.silent, self.unknown, self.gone)
        return ";".join(encode_ranks(s) for s in parts)

    @staticmethod
    def decode(text: str) -> Verdict:
        behind, silent, unknown, gone = [*text.split(";"), "", "", "", ""][:4]
        return Verdict(*(decode_ranks(p) for p in (behind, silent, unknown, gone)))


class Member(Protocol):
    """What a census needs of this rank's liveness (``cpu.tcp.liveness.Liveness``)."""

    rank: int
    size: int
    seq: int

    def census_address(self, rank: int) -> tuple[str, int] | None:
        """Where ``rank``'s watcher listens; None if unknown within ``ADDRESS_S``."""
        ...


class _Task:
    """One request to one node, and what became of it (the asking thread only)."""

    def __init__(self, node: int, line: str, span: set[int]) -> None:
        self.node = node
        self.line = line  # the request, without its newline
        self.span = span  # the ranks this task answers for
        self.sock: socket.socket | None = None
        self.buf = b""
        self.sent = False
        self.acked = False
        self.wait_until = 0.0  # for the connection, then for the ACK
        self.answer: Verdict | None = None
        self.silent = False  # no ACK in time, or gone: its children were asked instead
        self.gone = False  # refused, or closed unanswered
        self.children: list[_Task] = []

    @property
    def done(self) -> bool:
        """Nothing more to wait for from this node itself."""
        return self.sock is None

    def verdict(self) -> Verdict:
        if self.answer is not None:
            return self.answer
        if not self.silent:
            return Verdict(unknown=set(self.span))
        out = Verdict(gone={self.node}) if self.gone else Verdict(silent={self.node})
        covered = {self.node}
        for child in self.children:
            out.merge(child.verdict())
            covered |= child.span
        out.unknown |= self.span - covered
        return out


def _subtree(rank: int, size: int) -> set[int]:
    return set(range(rank, rank + subtree_span(rank, size)))


class Census:
    """This rank's census service: asks (op thread) and answers (census threads)."""

    def __init__(self, member: Member) -> None:
        self.member = member
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int], tuple[threading.Event, list[Verdict]]] = {}

    # -- asking --------------------------------------------------------------------------
    def missing(self, seq: int, budget_s: float = BUDGET_S) -> Verdict:
        """The whole comm's verdict for collective ``seq`` (op thread, on a timeout)."""
        return self._cached("FULL", seq, budget_s, self._full)

    def _full(self, seq: int, budget_s: float) -> Verdict:
        me = self.member
        end = time.monotonic() + budget_s
        if me.rank == 0:
            return self._survey(seq, end)
        ancestor = parent(me.rank)
        while True:  # an ancestor that does not answer is only a route: rank 0's survey
            left = end - time.monotonic() - hop_s(me.size)  # says what became of it
            task = _Task(ancestor, f"FULL {seq} {int(left * 1000)}", set(range(me.size)))
            self._run([task], end, expand=False)
            if task.answer is not None or not task.silent:
                return task.verdict()
            if ancestor == 0:  # nobody above answers: survey the comm for rank 0
                root = self._task(0, seq, end)
                self._run([root], end, expand=True)
                return root.verdict()
            ancestor = parent(ancestor)

    def _survey(self, seq: int, end: float) -> Verdict:
        """My subtree's verdict: mine, and my children's (each asked for theirs)."""
        me = self.member
        out = Verdict(behind={me.rank} if me.seq < seq else set())
        tasks = [self._task(c, seq, end) for c in children(me.rank, me.size)]
        self._run(tasks, end, expand=True)
        for task in tasks:
            out.merge(task.verdict())
        return out

    def _task(self, node: int, seq: int, end: float) -> _Task:
        left = end - time.monotonic() - hop_s(self.member.size)
        return _Task(
            node, f"ASK {seq} {int(max(left, 0.0) * 1000)}", _subtree(node, self.member.size)
        )

    def _run(self, tasks: list[_Task], end: float, expand: bool) -> None:
        """Send every task's request and collect answers until all are in or ``end``.

        ``expand``: a silent node's subtree is asked of its children (``ASK`` tasks), while
        its own answer, should it come late, is still taken."""
        me = self.member
        sel = selectors.DefaultSelector()
        active: list[_Task] = []
        mine: list[_Task] = []  # my own subtree (a survey for silent rank 0): asked last

        def start(task: _Task) -> None:
            if task.node == me.rank:
                mine.append(task)
                return
            if time.monotonic() >= end:
                return  # no time left to ask it: unknown
            # Past the neighbours, an address is a bounded store read (``ADDRESS_S``).
            address = me.census_address(task.node)
            sock, code = None, errno.EHOSTUNREACH  # no address: as good as unreachable
            if address is not None:
                try:
                    sock = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET)
                    sock.setblocking(False)
                    code = sock.connect_ex(address)
                except OSError as exc:
                    code = exc.errno or errno.EHOSTUNREACH
                if code not in (0, errno.EINPROGRESS) and sock is not None:
                    sock.close()
                    sock = None
            if sock is None:
                task.gone = code == errno.ECONNREFUSED  # else unreachable: silent
                go_silent(task)
                return
            task.sock = sock
            task.wait_until = time.monotonic() + ACK_S
            sel.register(sock, selectors.EVENT_WRITE, task)
            active.append(task)

        def stop(task: _Task) -> None:
            if task.sock is not None:
                with contextlib.suppress(KeyError, ValueError):
                    sel.unregister(task.sock)
                task.sock.close()
                task.sock = None

        def go_silent(task: _Task) -> None:
            if task.silent:
                return
            task.silent = True
            if not expand:
                stop(task)
                return
            seq = int(task.line.split()[1])
            task.children = [self._task(c, seq, end) for c in children(task.node, me.size)]
            for child in task.children:
                start(child)

        def lost(task: _Task, gone: bool = True) -> None:
            """Refused, reset or closed before it answered (gone), or unreachable."""
            stop(task)
            task.gone = gone
            go_silent(task)

        def receive(task: _Task) -> None:
            assert task.sock is not None
            try:
                data = task.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                lost(task)
                return
            *lines, task.buf = (task.buf + data).split(b"\n")
            for line in lines:
                word, _, arg = line.decode(errors="replace").partition(" ")
                if word == "ACK":
                    task.acked = True
                elif word == "ANS":
                    task.answer = Verdict.decode(arg)
                    stop(task)
                    return

        def send(task: _Task) -> None:
            assert task.sock is not None
            error = task.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if error:  # the connection failed: refused is gone, anything else unreachable
                lost(task, gone=error == errno.ECONNREFUSED)
                return
            try:
                task.sock.send((task.line + "\n").encode())
            except OSError:
                lost(task)
                return
            task.sent = True
            task.wait_until = time.monotonic() + ACK_S
            sel.modify(task.sock, selectors.EVENT_READ, task)

        try:
            for task in tasks:
                start(task)
            while mine:
                task = mine.pop()
                task.answer = self._survey(int(task.line.split()[1]), end)
            while any(not t.done for t in active) and time.monotonic() < end:
                for key, _ in sel.select(min(0.02, max(end - time.monotonic(), 0.0))):
                    task = key.data
                    assert isinstance(task, _Task)
                    if task.sock is not None:
                        (receive if task.sent else send)(task)
                now = time.monotonic()
                for task in list(active):
                    if task.done or task.acked or now < task.wait_until:
                        continue
                    if not task.silent:
                        go_silent(task)  # still waited on: a late answer counts
                    elif now >= task.wait_until + ACK_S and all(c.done for c in task.children):
                        stop(task)  # its children answered for it; it stays silent
                while mine:
                    task = mine.pop()
                    task.answer = self._survey(int(task.line.split()[1]), end)
        finally:
            for task in active:
                stop(task)
            sel.close()

    # -- answering -----------------------------------------------------------------------
    def answer(self, sock: socket.socket, line: str) -> None:
        """Answer one request on ``sock`` (the watcher already said ``ACK``), on a thread."""
        threading.Thread(
            target=self._answer, args=(sock, line), name="torchcomms-census", daemon=True
        ).start()

    def _answer(self, sock: socket.socket, line: str) -> None:
        try:
            kind, seq_text, budget_text = line.split()[:3]
            seq, budget_s = int(seq_text), max(int(budget_text), 0) / 1000
            if kind == "ASK":
                verdict = self._cached("ASK", seq, budget_s, self._asked)
            else:
                verdict = self._cached("FULL", seq, budget_s, self._full)
            sock.setblocking(True)
            sock.settimeout(1.0)
            sock.sendall(f"ANS {verdict.encode()}\n".encode())
        except (OSError, ValueError):
            pass
        finally:
            sock.close()

    def _asked(self, seq: int, budget_s: float) -> Verdict:
        return self._survey(seq, time.monotonic() + budget_s)

    def _cached(
        self, kind: str, seq: int, budget_s: float, run: Callable[[int, float], Verdict]
    ) -> Verdict:
        """One survey per (kind, collective): later askers wait for the first one's."""
        key = (kind, seq)
        with self._lock:
            entry = self._pending.get(key)
            first = entry is None
            if entry is None:
                entry = self._pending[key] = (threading.Event(), [])
                for old in sorted(self._pending)[: max(len(self._pending) - _CACHED, 0)]:
                    if self._pending[old][0].is_set():
                        del self._pending[old]
        event, box = entry
        if first:
            try:
                box.append(run(seq, budget_s))
            finally:
                event.set()
        else:
            event.wait(budget_s)
        if box:
            return box[0]
        return Verdict(unknown=set(range(self.member.size)) - {self.member.rank})
