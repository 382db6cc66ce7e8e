"""Connect-time waits that name who is missing: a rank that dies or never arrives while a
communicator connects makes the others raise ``PeerFailureError`` or ``CommTimeoutError``
naming it, never a raw c10d ``DistStoreError`` after the full timeout.

* ``wait_keys``: wait for store keys, each written by a known rank, in short slices;
  between slices check whether a writer's process is gone (members on this host, once
  identities are known) and the deadline.
* ``guarded``: run a blocking connect (a ``ProcessGroupGloo`` constructor, which blocks in
  C++ until every pair is connected) on a helper thread while the caller checks the same
  things; a connect left behind by a failure ends at gloo's own timeout.

Runs on the thread that creates the communicator.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import TypeVar

import torch._C._distributed_c10d as c10d
import torch.distributed

from torchcomms.backends.cpu.bootstrap import CommStore
from torchcomms.backends.cpu.hier import members as members_mod
from torchcomms.errors import CommError, CommTimeoutError, PeerFailureError
from torchcomms.ranks import ranks_text
from torchcomms.runtime.deadline import Deadline
from torchcomms.transport.procs import process_alive

logger = logging.getLogger("torchcomms.backends.cpu.connect")

T = TypeVar("T")

_SLICE = timedelta(milliseconds=50)
#: The longest pause between two ``check`` polls of a connect-time wait ...
_POLL_MAX_S = 0.05
#: ... stretched by this per key polled: a poll sends every key's name (about 40 bytes),
#: so rank 0 waiting for N members sends at most about 4 MB/s of polls at any N ...
_POLL_S_PER_KEY = 1e-5
#: ... and by this per rank polling alike: N members waiting for rank 0's verdict poll
#: at most 50,000 times a second in all (a store serves about 70,000 round trips a second
#: on a small machine), from 2,500 members on.
_POLL_S_PER_POLLER = 2e-5


def poll_pause_max_s(keys: int, pollers: int) -> float:
    """The longest pause between two polls of ``keys`` keys by each of ``pollers`` ranks."""
    return max(_POLL_MAX_S, keys * _POLL_S_PER_KEY, pollers * _POLL_S_PER_POLLER)


def connect_prefix(name: str, rank: int) -> str:
    """How connect-time errors begin: ``[TorchCommGloo comm=NAME rank=R] new_comm: ``."""
    return f"[TorchCommGloo comm={name} rank={rank}] new_comm: "


def check_dead(local_pids: Mapping[int, int], ranks: Sequence[int], prefix: str, what: str) -> None:
    dead = [r for r in ranks if r in local_pids and not process_alive(local_pids[r])]
    if dead:
        error = PeerFailureError(f"{prefix}{ranks_text(dead)} died (process gone) during {what}")
        error.ranks = error.dead_ranks = tuple(dead)
        raise error


def wait_keys(
    store: c10d.Store,
    keys: Mapping[str, int],
    deadline: Deadline,
    local_pids: Mapping[int, int],
    prefix: str,
    what: str,
    verdict: str | None = None,
    pollers: int = 1,
) -> None:
    """Wait until every key exists; ``keys[k]`` is the rank that writes ``k``.

    Each poll is one ``check`` of every key (one round trip, whatever their number); only
    a wait that times out checks them one by one, to name the ranks still missing.
    Between polls, a writer whose process is gone (on this host) is named at once.
    ``verdict``: a key where rank 0 may publish that connecting failed
    (``publish_failure``); if it does, raise its verdict instead of waiting on.
    ``pollers``: how many ranks wait like this at once (every member, for rank 0's
    verdict): their polls together stay under ``1 / _POLL_S_PER_POLLER`` a second.
    """
    names = list(keys)
    writers = sorted(set(keys.values()))
    pause, longest = 0.001, poll_pause_max_s(len(names), pollers)
    # Poll with ``check``: a timed ``wait`` that expires makes c10d log a warning.
    while not store.check(names):
        check_dead(local_pids, writers, prefix, what)
        if verdict is not None:
            check_verdict(store, verdict, prefix, what)
        if deadline.passed():
            missing = sorted({keys[k] for k in names if not store.check([k])})
            if not missing:
                return
            raise timed_out(prefix, deadline, what, missing, "never arrived")
        time.sleep(min(pause, max(deadline.left_s(), 0.0)))
        pause = min(pause * 2, longest)


#: Where the tcp path's members publish their listeners (``key/{rank}``), and meet
#: (``LISTENERS_MET``, ``cpu.hier.leaders.rendezvous``) before reading their successor's
#: (``cpu.select``).
LISTENERS = "listeners"
LISTENERS_MET = "listeners/met"


def publish_transport_failure(store: c10d.Store, size: int, error: CommError) -> None:
    """Rank 0 failed to open its transport: members past that step wait for its verdict
    (the listeners' rendezvous, the final handshake)."""
    if size > 1:
        publish_failure(store, [f"{LISTENERS_MET}/all", "connected/all"], error)


def multi_set(store: c10d.Store, keys: list[str], values: list[str]) -> None:
    """Write every key in one round trip (c10d's ``multi_set``; torch's stubs omit it)."""
    store.multi_set(keys, values)  # type: ignore[attr-defined]


def store_lost(
    exc: BaseException, name: str, rank: int, peers: Sequence[tuple[str, int]]
) -> CommError | None:
    """What a member raises instead of ``exc``, which ended its connect, if ``exc`` is
    c10d's raw "connection closed" from the comm's store (served by rank 0); else None.

    That store goes away when rank 0's ``new_comm`` fails, so the other members read it as
    rank 0 dying (when its process is gone, on this host) or leaving.
    """
    if rank == 0 or not isinstance(exc, torch.distributed.DistNetworkError):
        return None
    prefix = connect_prefix(name, rank)
    what = "the connect"
    try:
        check_dead(local_pids(peers, rank) if peers else {}, [0], prefix, what)
    except PeerFailureError as dead:
        return dead
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    error = CommError(
        f"{prefix}the store served by rank 0 stopped answering during {what} ({first}): "
        "rank 0 failed or left new_comm; its own error says why"
    )
    error.ranks = (0,)
    return error


def timed_out(
    prefix: str, deadline: Deadline, what: str, ranks: Sequence[int], verb: str
) -> CommTimeoutError:
    """The connect-time timeout: ``… timed out after T s in WHAT: peer rank 2 VERB``."""
    error = CommTimeoutError(
        f"{prefix}timed out after {deadline.timeout.total_seconds():g} s in {what}: "
        f"{ranks_text(ranks)} {verb}"
    )
    error.ranks = tuple(ranks)
    return error


def guarded(
    connect: Callable[[], T],
    deadline: Deadline,
    local_pids: Mapping[int, int],
    ranks: Sequence[int],
    prefix: str,
    what: str,
) -> T:
    """``connect()`` on a helper thread; raise if one of ``ranks`` dies or time runs out."""
    done = threading.Event()
    box: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            box.append(connect())
        except BaseException as exc:  # handed to the caller
            failure.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name="torchcomms-connect", daemon=True).start()
    while not done.wait(_SLICE.total_seconds()):
        check_dead(local_pids, ranks, prefix, what)
        if deadline.passed(1.0):  # gloo's own timeout (the same budget) comes first
            error = CommTimeoutError(
                f"{prefix}timed out after {deadline.timeout.total_seconds():g} s in {what}"
            )
            error.ranks = tuple(ranks)
            raise error
    if failure:
        check_dead(local_pids, ranks, prefix, what)  # a peer's death explains the failure
        raise failure[0]
    return box[0]


def publish_failure(store: c10d.Store, keys: str | Sequence[str], error: CommError) -> None:
    """Rank 0 gave up a connect step because of ``error``: say whom it blames, under each
    of ``keys`` (one write, whatever their number)."""
    kind = "dead" if isinstance(error, PeerFailureError) else "timeout"
    verdict = f"{kind} {','.join(map(str, error.ranks))}"
    if isinstance(keys, str):
        store.set(keys, verdict)
    elif keys:
        multi_set(store, list(keys), [verdict] * len(keys))


def check_verdict(store: c10d.Store, key: str, prefix: str, what: str) -> None:
    """Raise rank 0's published failure (``publish_failure``) under ``key``, if any."""
    if store.check([key]):
        verdict = store.get(key).decode()
        if verdict != "ok":
            raise failure_from(verdict, prefix, what)


def failure_from(verdict: str, prefix: str, what: str) -> CommError:
    """The error a member raises on rank 0's published failure (``publish_failure``)."""
    kind, _, listed = verdict.partition(" ")
    ranks = tuple(int(r) for r in listed.split(",") if r)
    text = ranks_text(ranks) if ranks else "a member"  # rank 0 could not tell which
    error: CommError
    if kind == "dead":
        error = PeerFailureError(f"{prefix}{text} died (process gone) during {what}")
        error.dead_ranks = ranks
    else:
        error = CommTimeoutError(f"{prefix}{text} never finished {what} (rank 0 says)")
    error.ranks = ranks
    return error


#: The longest pause between two looks of rank 0's finalize at the members' acknowledgements.
_DETACH_POLL_MAX_S = 0.01


def members_detached(
    store: c10d.Store,
    key: str,
    size: int,
    deadline: Deadline,
    gone: Callable[[], int] = lambda: 0,
) -> bool:
    """Whether every other member acknowledged ``key`` (``rendezvous(ack=True)``), waiting
    until ``deadline`` (the comm's timeout) or until the members still missing are all
    known gone (``gone()``: how many members died).  Rank 0's ``finalize`` calls it: rank 0
    serves the comm's store, and after ``new_comm`` then ``finalize`` at once, leaving first
    cut off members still reading the verdict; on a busy machine they may take seconds to
    get there, which must not fail a healthy job."""
    if size <= 1:
        return True
    pause = 0.001
    while True:
        try:
            seen = store.add(f"{key}/seen", 0)
        except Exception:  # the store is gone already: nobody can be reading it
            return True
        if seen >= size - 1:
            return True
        if deadline.passed() or seen + gone() >= size - 1:
            logger.debug("finalize: not every member acknowledged %s", key)
            return False
        time.sleep(min(pause, max(deadline.left_s(), 0.0)))
        pause = min(pause * 2, _DETACH_POLL_MAX_S)


def split_done(
    store: CommStore, key: str, rank: int, peers: Sequence[tuple[str, int]], deadline: Deadline
) -> None:
    """This member no longer reads the parent's store for one split; rank 0 waits for all.

    The groups of a split meet on the parent's store, which rank 0 serves when the
    communicator bootstrapped without ``store=``: rank 0 (in a group or not) returns only
    once every other parent rank counted itself in under ``key`` (the last one to do so
    marks ``key/all``), so its next step (``finalize``, exit) cannot cut off a group still
    connecting.  A split is collective over the parent (as NCCL's), so every rank counts
    the same calls.  O(1) store round trips per member; rank 0 polls with ``check`` (as
    ``wait_keys`` does) and stops at ``deadline`` or once the only ones missing are members
    on this host that exited.
    """
    size = len(peers)
    if size <= 1:
        return
    if rank != 0:
        try:
            if store.store.add(key, 1) == size - 1:
                store.store.set(f"{key}/all", "1")
        except Exception as exc:  # rank 0 is gone: nobody waits for the count
            logger.debug("could not count in under %s (%s)", key, exc)
        return
    if store.durable is not None:
        return  # the store outlives every member: nothing to keep alive
    host, pause = peers[0][0], 0.001
    try:
        while not store.store.check([f"{key}/all"]):
            exited = sum(1 for h, pid in peers[1:] if h == host and not process_alive(pid))
            if deadline.passed() or (exited and store.store.add(key, 0) + exited >= size - 1):
                logger.debug("split: not every member counted in under %s", key)
                return
            time.sleep(min(pause, max(deadline.left_s(), 0.0)))
            pause = min(pause * 2, 0.02)
    except Exception:  # the store is gone already: nobody can be reading it
        return


def read_host_pids(store: c10d.Store, members: members_mod.Members) -> None:
    """Learn the pids of this rank's host's members (``host/pids/<host>``, written by its
    leader, ``cpu.hier.leaders``; one ``get`` of O(ranks on this host) bytes, none when this
    rank is alone on it)."""
    local = members.local_ranks()
    if members.local_pids_known():
        return
    key = members_mod.host_pids_key(members.host_tag)
    members.learn(local, [int(p) for p in json.loads(store.get(key).decode())])


def local_pids(peers: Sequence[tuple[str, int]], rank: int) -> dict[int, int]:
    """Comm rank -> pid of the other members on ``rank``'s host (their deaths are visible)."""
    me = peers[rank][0]
    return {r: pid for r, (host, pid) in enumerate(peers) if host == me and r != rank}
