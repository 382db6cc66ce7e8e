"""Counting what communicators ask of their stores (``TORCHCOMM_STORE_COUNTS=1``).

With the setting on, ``bootstrap.create_comm_store`` wraps the store a communicator is
given and the store it moves to in a ``CountingStore``, so every operation on them,
ours and gloo's (its C++ calls reach a Python store too), adds to this process's
``COUNTS``: operations by kind and bytes each way.  ``check`` and ``read_counter`` (an
``add`` of 0) are how waits poll here, so they are counted apart from the operations
that move keys, and so is ``liveness``: the
liveness watcher's periodic publish of its sequence number (``seq/{rank}``), a load per
second (bounded in ``cpu.tcp.liveness``) that lands inside whatever window is measured only
when a period happens to end in it.  Off (the default), nothing is wrapped and nothing
is counted.

Read it around the call to measure (``snapshot()`` before and after, ``diff``); the
scale diagnostics (``benchmarks/diagnostics/scale_counts.py``) do, per rank.  Any thread
may count (gloo's threads do); a lock guards ``COUNTS``.
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from datetime import timedelta
from typing import Any

import torch._C._distributed_c10d as c10d

#: Operations by kind (``set``, ``get``, ``check``, ...) plus ``bytes_out`` / ``bytes_in``
#: (the bytes of every operation but the timing-dependent ones) and ``poll_bytes`` (the
#: bytes of ``check`` polls and liveness publishes, both ways).
COUNTS: Counter[str] = Counter()
_lock = threading.Lock()
#: The liveness watcher's publish (``cpu.tcp.liveness``), under whatever prefixes.
_LIVENESS_KEY = re.compile(r"(^|/)seq/\d+$")
_alive: list[CountingStore] = []


#: Kinds whose number depends on timing: their bytes go to ``poll_bytes``.
TIMED_KINDS = ("check", "read_counter", "liveness")


def _count(kind: str, out: int = 0, back: int = 0) -> None:
    with _lock:
        COUNTS[kind] += 1
        if kind in TIMED_KINDS:
            COUNTS["poll_bytes"] += out + back
        else:
            COUNTS["bytes_out"] += out
            COUNTS["bytes_in"] += back


def snapshot() -> dict[str, int]:
    with _lock:
        return dict(COUNTS)


def diff(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    """What happened between two snapshots, kinds that did not change left out."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def _size(value: Any) -> int:
    return len(value.encode()) if isinstance(value, str) else len(value)


class CountingStore(c10d.Store):
    """A store that forwards every call to ``inner`` and counts it in ``COUNTS``."""

    def __init__(self, inner: c10d.Store) -> None:
        super().__init__()
        self.inner = inner
        # A PrefixStore over this one holds only its C++ half: were the Python object
        # collected, calls through it would fail ("Not implemented").  Counting is a
        # diagnostic mode: these live as long as the process.
        with _lock:
            _alive.append(self)

    def set(self, key: str, value: Any) -> None:
        kind = "liveness" if _LIVENESS_KEY.search(key) else "set"
        _count(kind, len(key) + _size(value))
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        value = self.inner.get(key)
        _count("get", len(key), len(value))
        return value

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        _count("multi_set", sum(len(k) for k in keys) + sum(_size(v) for v in values))
        self.inner.multi_set(keys, values)  # type: ignore[attr-defined]  # not in torch's stubs

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = [bytes(v) for v in self.inner.multi_get(keys)]
        _count("multi_get", sum(len(k) for k in keys), sum(len(v) for v in values))
        return values

    def add(self, key: str, amount: int) -> int:
        # Adding 0 reads a counter: how waits on a count poll (``cpu.hier.leaders``).
        _count("add" if amount else "read_counter", len(key) + 8, 8)
        return int(self.inner.add(key, amount))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        value = self.inner.compare_set(key, expected, desired)
        _count("compare_set", len(key) + _size(expected) + _size(desired), len(value))
        return value

    def check(self, keys: list[str]) -> bool:
        _count("check", sum(len(k) for k in keys), 1)
        return bool(self.inner.check(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        _count("wait", sum(len(k) for k in keys))
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        _count("delete_key", len(key), 1)
        return bool(self.inner.delete_key(key))

    def num_keys(self) -> int:
        _count("num_keys", 0, 8)
        return int(self.inner.num_keys())

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:
        found: timedelta = getattr(self.inner, "timeout", timedelta(seconds=300))
        return found
