"""gloo's eager full-mesh rendezvous in O(1) store round trips per rank.

torch 2.13's ``ProcessGroupGloo``, connecting eagerly, has every rank set ``{i}/{rank}``
(context ``i``'s addresses of this rank) and then wait for and read the key of every rank:
2N round trips per rank, 2N² at the one store.  ``GatheredRendezvous`` stands between gloo
and the store.  When gloo sets this rank's key, the key goes to the store as before; rank
0 then waits for all N keys in one ``wait``, reads them in one ``multi_get`` and publishes
them as one value, ``{i}/all``.  Each rank reads that value once, at gloo's first wait or
get of a rank's key; gloo's waits and gets of ``{i}/{r}`` are answered from it from then
on.  Keys of any other shape pass through, so a gloo that names its keys otherwise only
loses the saving.  Bytes do not shrink: eager gloo's keys hold every pair's address.

Only for eager connects: a lazy gloo sets its key at construction but reads a peer's at
that pair's first use, and rank 0's gather would stand in the way of nothing useful.

Runs on the thread that constructs the process group (``cpu.connect.guarded``'s helper).
"""

from __future__ import annotations

import re
import struct
from datetime import timedelta
from typing import Any

import torch._C._distributed_c10d as c10d

_RANK_KEY = re.compile(r"^(\d+)/(\d+)$")


def pack(values: list[bytes]) -> bytes:
    """``values`` as one blob: their lengths, then their bytes."""
    return struct.pack(f"<I{len(values)}I", len(values), *map(len, values)) + b"".join(values)


def unpack(blob: bytes) -> list[bytes]:
    (count,) = struct.unpack_from("<I", blob)
    lengths = struct.unpack_from(f"<{count}I", blob, 4)
    values, at = [], 4 + 4 * count
    for length in lengths:
        values.append(blob[at : at + length])
        at += length
    return values


class GatheredRendezvous(c10d.Store):
    """The store handed to an eager ``ProcessGroupGloo`` (see the module docstring).

    ``timeout`` bounds rank 0's gather wait (gloo passes its own to its waits).  Keep a
    reference for as long as the process group may use the store: a ``PrefixStore`` over
    a Python store holds only its C++ half.
    """

    def __init__(self, inner: c10d.Store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__()
        self.inner = inner
        self.rank = rank
        self.size = size
        self._timeout = timeout
        self._gathered: dict[str, list[bytes]] = {}  # context index -> every rank's value

    def _split(self, key: str) -> tuple[str, int] | None:
        match = _RANK_KEY.match(key)
        if match is None or int(match.group(2)) >= self.size:
            return None
        return match.group(1), int(match.group(2))

    def _all(self, context: str, timeout: timedelta) -> list[bytes]:
        values = self._gathered.get(context)
        if values is None:
            self.inner.wait([f"{context}/all"], timeout)
            values = unpack(self.inner.get(f"{context}/all"))
            self._gathered[context] = values
        return values

    def set(self, key: str, value: Any) -> None:
        self.inner.set(key, value)
        split = self._split(key)
        if split is None or split[1] != self.rank or self.rank != 0:
            return
        keys = [f"{split[0]}/{r}" for r in range(self.size)]
        self.inner.wait(keys, self._timeout)
        values = [bytes(v) for v in self.inner.multi_get(keys)]
        self._gathered[split[0]] = values
        self.inner.set(f"{split[0]}/all", pack(values))  # type: ignore[arg-type]  # bytes too

    def get(self, key: str) -> bytes:
        split = self._split(key)
        if split is None:
            return bytes(self.inner.get(key))
        return self._all(split[0], self._timeout)[split[1]]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        splits = [self._split(k) for k in keys]
        if any(s is None for s in splits):
            if timeout is None:
                self.inner.wait(keys)
            else:
                self.inner.wait(keys, timeout)
            return
        for context in {s[0] for s in splits if s is not None}:
            self._all(context, self._timeout if timeout is None else timeout)

    def check(self, keys: list[str]) -> bool:
        return bool(self.inner.check(keys))

    def add(self, key: str, amount: int) -> int:
        return int(self.inner.add(key, amount))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return bytes(self.inner.compare_set(key, expected, desired))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def delete_key(self, key: str) -> bool:
        return bool(self.inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self.inner.num_keys())

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
        self.inner.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:
        return self._timeout
