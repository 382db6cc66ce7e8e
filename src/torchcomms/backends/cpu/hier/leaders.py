"""Meeting through host leaders: rank 0 hears from one member per host, never from all.

A communicator's connect meets three times on its store: the identity exchange (who is
where), the listeners' rendezvous (tcp) and the final handshake.  Each meets in two
levels, so a member makes O(1) store round trips with O(1) bytes, a host's leader
O(ranks on its host) bytes, and rank 0 O(hosts) besides leading its own host:

* **Identity exchange** (``exchange_identities``), before anyone knows the placement.
  Rank 0 writes its rank and pid as number 0 of its host (``host/m/<host>/0``).  Any other
  member takes a number on its host (``add host/n/<host>``): the first signs its host in
  with its own entry (``host/l/<i>``, ``i`` from ``add host/signed``), the others write
  theirs under their numbers.  Then every member counts itself in (``host/arrived``).
  Once the count is full, each leader of a host of several members (rank 0 on its own
  host, the holder of number 1 elsewhere) reads its host's entries in one ``multi_get``
  and writes the host's ranks as ranges (``host/s/<host>``) and its pid list; rank 0
  reads the sign-ins and the hosts' counts (a host of one needs nothing more), then the
  summaries, plans the placement (``cpu.hier.members``) and writes one bundle for all
  (``host/all``), which every member reads.  A member: 4 round trips; a host's first:
  one more; a leader of several: two more.
* **Rendezvous** (``rendezvous``), once the placement is known: a host's leader is its
  lowest rank.  Members write ``key/{rank}``; each leader of several waits for its host's
  (a dead member on its host is named at once) and writes ``key/h/{leader}``: ``ok`` or
  whom it blames; rank 0 waits for those and for the members alone on their hosts, and
  publishes the verdict under ``key/all``.

Failures: rank 0's verdict is what every member raises.  A leader's own wait ends at
the deadline; rank 0 waits ``GRACE_S`` longer for the leaders' verdicts (so a member
missing on another host is named, not its leader) and the members ``2 * GRACE_S``
longer for rank 0's.  When members never arrive at the identity exchange, rank 0 names
them by reading every entry (the failure path alone: O(N)).  Waits on the count poll it
(an ``add`` of 0, counted with the polls by ``store_counts``).

Runs on the thread that creates the communicator.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping

import torch._C._distributed_c10d as c10d

from torchcomms.backends.cpu import connect as cpu_connect
from torchcomms.backends.cpu.hier.members import Members, Placement, from_bundle, host_pids_key
from torchcomms.errors import CommError, CommTimeoutError
from torchcomms.ranks import decode_ranks, encode_ranks
from torchcomms.runtime.deadline import Deadline

#: How much longer rank 0 waits for the leaders' verdicts than the leaders wait for
#: their members (the members wait twice as much longer for rank 0's).
GRACE_S = 1.0
_IDENTITY = "the identity exchange"
#: Where the members count themselves in, and the hosts' first members sign them in.
_ARRIVED = "host/arrived"
_HOSTS = "host/signed"
#: Where rank 0 writes the bundle (or whom it blames).
_VERDICT = "host/all"


def host_tag(identity: str) -> str:
    """A host identity as a store key's part (identities hold ``/`` and may be long)."""
    return hashlib.sha1(identity.encode(), usedforsecurity=False).hexdigest()[:16]


def _later(deadline: Deadline, by_s: float) -> Deadline:
    return Deadline(deadline.timeout, deadline.end + by_s)


def _wait_verdict(
    store: c10d.Store, key: str, size: int, deadline: Deadline, prefix: str, what: str
) -> str:
    """Rank 0's verdict under ``key`` (waited for ``GRACE_S`` twice past ``deadline``):
    what follows its ``ok``, or raise the failure it says.  Every member waits so: their
    polls are spread by the comm's ``size``."""
    later = _later(deadline, 2 * GRACE_S)
    cpu_connect.wait_keys(store, {key: 0}, later, {}, prefix, what, pollers=size)
    verdict = store.get(key).decode()
    if verdict != "ok" and not verdict.startswith("ok "):
        raise cpu_connect.failure_from(verdict, prefix, what)
    return verdict[3:]


def _poll(store: c10d.Store, size: int, verdict: str, deadline: Deadline) -> bool:
    """Wait until every member counted itself in (or ``verdict`` exists: False, as when
    the deadline passes first).  A host's first member and rank 0 wait so: up to one
    poller per member, spread as ``connect.wait_keys`` spreads them."""
    pause, longest = 0.001, cpu_connect.poll_pause_max_s(1, size)
    while store.add(_ARRIVED, 0) < size:
        if store.check([verdict]) or deadline.passed():
            return False
        time.sleep(min(pause, max(deadline.left_s(), 0.0)))
        pause = min(pause * 2, longest)
    return True


def exchange_identities(
    store: c10d.Store,
    rank: int,
    size: int,
    identity: str,
    deadline: Deadline,
    prefix: str,
    pid: int | None = None,
) -> Members:
    """Who the members are (``cpu.hier.members``), met through host leaders (module docstring).
    ``pid``: the process this rank is (this one's by default)."""
    pid = os.getpid() if pid is None else pid
    tag = host_tag(identity)
    if size == 1:
        return Members(0, 1, Placement("blocked", 1), {0: pid}, tag)
    if rank == 0:  # number 0 on its host, whose leader it is
        store.set(f"host/m/{tag}/0", f"0 {pid}")
        store.add(_ARRIVED, 1)
        number = 0
    else:
        number = store.add(f"host/n/{tag}", 1)
        if number == 1:  # its host's first: sign the host in, with this member's entry
            store.set(f"host/l/{store.add(_HOSTS, 1)}", f"{tag} {rank} {pid}")
        else:
            store.set(f"host/m/{tag}/{number}", f"{rank} {pid}")
        store.add(_ARRIVED, 1)  # last: whoever sees the count full finds every entry
    if number <= 1:
        wait = deadline if rank == 0 else _later(deadline, GRACE_S)
        if not _poll(store, size, _VERDICT, wait):
            if rank == 0:
                error = _never_arrived(store, size, deadline, prefix)
                cpu_connect.publish_failure(store, _VERDICT, error)
                raise error
        elif rank == 0:
            return _plan(store, tag, pid, size, deadline, prefix)
        elif not store.check([f"host/m/{tag}/0"]):  # else rank 0 leads this host
            count = store.add(f"host/n/{tag}", 0)
            if count > 1:  # a host of one: rank 0 has all it needs from the sign-in
                cpu_connect.multi_set(store, *_host_summary(store, tag, count, [(rank, pid)]))
    bundle = _wait_verdict(store, _VERDICT, size, deadline, prefix, _IDENTITY)
    return from_bundle(rank, size, bundle, pid, tag)


def _host_summary(
    store: c10d.Store, tag: str, count: int, known: list[tuple[int, int]]
) -> tuple[list[str], list[str]]:
    """A leader: what to write of its host (keys, values): its ranks as ranges for rank 0
    (``host/s/<host>``) and, for a host of several members, their pids in rank order.
    ``known``: the (rank, pid) of numbers 0 and 1; the others' are read (numbers 2..count).
    """
    numbers = [f"host/m/{tag}/{i}" for i in range(2, count + 1)]
    entries = [bytes(e).decode().split() for e in store.multi_get(numbers)] if numbers else []
    pairs = sorted([*known, *((int(r), int(p)) for r, p in entries)])
    keys, values = [f"host/s/{tag}"], [encode_ranks(r for r, _ in pairs)]
    if len(pairs) > 1:
        keys.append(host_pids_key(tag))
        values.append(json.dumps([p for _, p in pairs]))
    return keys, values


def _plan(
    store: c10d.Store, tag: str, pid: int, size: int, deadline: Deadline, prefix: str
) -> Members:
    """Rank 0, once every member counted itself in: every host's ranks (a host of one from
    its sign-in, its own host's from the entries, the others' from their leaders'
    summaries), the placement, and one bundle for all."""
    signins = [f"host/l/{i}" for i in range(1, store.add(_HOSTS, 0) + 1)]
    signed = [bytes(v).decode().split() for v in store.multi_get(signins)] if signins else []
    counts = (
        [int(c) for c in store.multi_get([f"host/n/{t}" for t, _, _ in signed])] if signed else []
    )
    first_here = [(int(r), int(p)) for t, r, p in signed if t == tag]
    here_count = next((c for (t, _, _), c in zip(signed, counts, strict=True) if t == tag), 0)
    own = _host_summary(store, tag, here_count, [(0, pid), *first_here])
    texts = [own[1][0]]  # each host's ranks, as ranges
    led: dict[str, int] = {}  # host -> its leader, for hosts of several members
    for (t, first, _), count in zip(signed, counts, strict=True):
        if t != tag:
            if count > 1:
                led[t] = int(first)
            else:
                texts.append(first)
    summaries = {f"host/s/{t}": leader for t, leader in led.items()}
    try:
        # The leaders' own waits end at the deadline: give them the grace to say so.
        cpu_connect.wait_keys(store, summaries, _later(deadline, GRACE_S), {}, prefix, _IDENTITY)
        texts += [bytes(v).decode() for v in store.multi_get(list(summaries))] if led else []
        placement = Placement.of(_hosts_of(texts, size, prefix))
    except CommError as exc:
        cpu_connect.publish_failure(store, _VERDICT, exc)
        raise
    bundle = json.dumps({"at": placement.encode(), "p0": pid}, separators=(",", ":"))
    out_keys, out_values = own[0][1:], own[1][1:]  # this host's pids, if several
    cpu_connect.multi_set(store, [*out_keys, _VERDICT], [*out_values, "ok " + bundle])
    members = Members(0, size, placement, {0: pid}, tag)
    if out_values:  # rank 0 knows its host's pids without reading them back
        members.learn(members.local_ranks(), json.loads(out_values[0]))
    return members


def _hosts_of(texts: list[str], size: int, prefix: str) -> list[int]:
    """Each rank's host index, from each host's ranks (hosts numbered by lowest rank)."""
    hosts = [-1] * size
    for h, ranks in enumerate(sorted((sorted(decode_ranks(t)) for t in texts), key=min)):
        for r in ranks:
            if not 0 <= r < size:
                raise CommError(f"{prefix}rank {r} is outside the comm (size {size})")
            if hosts[r] != -1:
                raise CommError(f"{prefix}rank {r} was claimed twice in {_IDENTITY}")
            hosts[r] = h
    if -1 in hosts:
        raise CommError(f"{prefix}rank {hosts.index(-1)} is on no host in {_IDENTITY}")
    return hosts


def _never_arrived(store: c10d.Store, size: int, deadline: Deadline, prefix: str) -> CommError:
    """Rank 0, on the failure path: which ranks wrote no entry (reads them all: O(N))."""
    seen = {0}
    for i in range(1, store.add(_HOSTS, 0) + 1):
        if not store.check([f"host/l/{i}"]):
            continue
        tag, first, _ = store.get(f"host/l/{i}").decode().split()
        seen.add(int(first))
        for n in range(2, store.add(f"host/n/{tag}", 0) + 1):
            key = f"host/m/{tag}/{n}"
            if store.check([key]):
                seen.add(int(store.get(key).decode().split()[0]))
    missing = sorted(set(range(size)) - seen)
    if missing:
        return cpu_connect.timed_out(prefix, deadline, _IDENTITY, missing, "never arrived")
    error = CommTimeoutError(
        f"{prefix}timed out after {deadline.timeout.total_seconds():g} s in {_IDENTITY}: "
        "a member wrote its identity but never counted itself in (it died meanwhile?)"
    )
    error.ranks = ()
    return error


def rendezvous(
    store: c10d.Store,
    key: str,
    members: Members,
    deadline: Deadline,
    local_pids: Mapping[int, int],
    prefix: str,
    what: str,
    ack: bool = False,
    posted: str | None = None,
) -> None:
    """Every member reached this step, or every member raises naming who did not (module
    docstring).  ``ack``: the members count themselves in ``key/seen`` once they read the
    verdict (``connect.members_detached`` waits for that).  ``posted``: every member
    already wrote ``{posted}/{rank}`` (what it brings): that is its arrival."""
    rank, size = members.rank, members.size
    if size == 1:
        return
    here = members.local_ranks()
    arrival = key if posted is None else posted
    if rank != here[0] or (len(here) == 1 and rank != 0):  # alone: rank 0 waits for it
        if posted is None:
            store.set(f"{key}/{rank}", "1")
    else:
        mine = {f"{arrival}/{r}": r for r in here if r != rank}
        try:
            cpu_connect.wait_keys(store, mine, deadline, local_pids, prefix, what)
        except CommError as exc:
            cpu_connect.publish_failure(
                store, f"{key}/all" if rank == 0 else f"{key}/h/{rank}", exc
            )
            raise
        if rank != 0:
            store.set(f"{key}/h/{rank}", "ok")
    if rank == 0:
        _hear_leaders(store, key, arrival, members, deadline, local_pids, prefix, what)
        return
    _wait_verdict(store, f"{key}/all", size, deadline, prefix, what)
    if ack:
        store.add(f"{key}/seen", 1)


def _hear_leaders(
    store: c10d.Store,
    key: str,
    arrival: str,
    members: Members,
    deadline: Deadline,
    local_pids: Mapping[int, int],
    prefix: str,
    what: str,
) -> None:
    """Rank 0: every other host's leader's verdict (a member alone on its host: its
    arrival, under ``arrival``), then the verdict for all."""
    hosts = [(r, count) for r, count in members.leaders() if r != 0]
    alone = {f"{arrival}/{r}": r for r, count in hosts if count == 1}
    leaders = {f"{key}/h/{r}": r for r, count in hosts if count > 1}
    try:
        cpu_connect.wait_keys(
            store, {**alone, **leaders}, _later(deadline, GRACE_S), local_pids, prefix, what
        )
        if leaders:
            for value in store.multi_get(list(leaders)):
                said = bytes(value).decode()
                if said != "ok":
                    raise cpu_connect.failure_from(said, prefix, what)
    except CommError as exc:
        cpu_connect.publish_failure(store, f"{key}/all", exc)
        raise
    store.set(f"{key}/all", "ok")
