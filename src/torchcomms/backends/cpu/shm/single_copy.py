"""Large collectives in one copy per byte, by cross-memory attach.

The slot path copies every byte into the sender's slot and out again on each receiver; for
large messages that is two extra passes over memory, and it is what kept these ops behind MPI
(whose shared-memory transport copies once).  Here every rank publishes the address of its
buffer in one round, reads what it needs straight out of its peers' address spaces
(``transport.cma``), and meets the others once more, so nobody returns (and reuses its buffer)
while a peer still reads it: two rounds and one copy, whatever the size.  all_gather, uniform
all_to_all and broadcast take it at any world size.  all_reduce and reduce take it between two
ranks (from 512 KiB, as broadcast does there): each rank reads the part it reduces from its
peer a piece at a time and combines it into its own tensor (all_reduce writes each combined
piece back into the peer's; a reduce's peer, while it has a core of its own, takes a third of
the root's work).  At 16 MiB and 2 ranks, in
place, the first version of this halved all_reduce and reduce (8.7 to 4.2-5.5 ms and 8.9 to
3.8 ms in one A/B run with ``TORCHCOMM_SHM_SINGLE_COPY=0``; see
benchmarks/results/issue40/NOTES.md).  With more ranks the reductions keep the slot path, whose
rounds spread the reduction over every rank.

Why one copy by cross-memory attach, when a plain copy is faster: on the 2-core AMD EPYC VM
CI runs on, ``process_vm_readv`` moves 10-13 GB/s (it pins the peer's pages one at a time)
where a copy inside a process moves 35-44 GB/s, and while the host keeps both vCPUs on one
shared cache the slot path's two copies beat the one read by 10-40 % (2 ranks, p50
interleaved, all_gather in place at 4 MiB 187-245 against 211-287 us in five launches of ten).
But the host also runs them on cores that do not share a cache (three launches of those ten
throughout, two at their start; nine of ten in another hour), and then every line a rank
writes into its slot must first be taken back from the peer that read it the round before:
the slot path turns 4-9x slower (all_gather 4 MiB 1067-1211 against 220-252 us, broadcast
1844-2226 against 189-242, a 1 MiB broadcast through the slots 460-579 us against 42-51),
while the single copy, which writes only this rank's own memory, runs as fast as before.
MPI makes the same choice (it moves large messages by cross-memory attach too).  ``python
benchmarks/diagnostics/slots_vs_single_copy.py`` measures both paths launch after launch
(benchmarks/results/issue40/slots_vs_single_copy.json; NOTES.md there, fifth round).

Used from ``SINGLE_COPY_MIN_BYTES`` per peer, where every rank can read every other: probed
once per communicator, at the first op that qualifies, in two rounds every rank runs (the
first carries that op's fingerprint, so a rank that called something else raises there, as on
the slot path).  ``TORCHCOMM_SHM_SINGLE_COPY=0``, set when a rank makes the communicator, makes
that rank report "cannot", which turns the path off for the whole communicator.  Runs on the
op's thread, like the rest of the channel.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import secrets
from collections.abc import Callable
from typing import Literal

import torch

from torchcomms import config
from torchcomms.backends.cpu import host_arrays
from torchcomms.backends.cpu.staging import overlaps
from torchcomms.ranks import RankMessage, Ranks
from torchcomms.runtime.deadline import Deadline
from torchcomms.runtime.fingerprint import Fingerprint
from torchcomms.transport import cma
from torchcomms.transport.errors import WaitError
from torchcomms.transport.shm.channel import ShmChannel

#: Bytes each rank moves to each peer from which all_gather and all_to_all take the single-copy
#: path, and the bytes from which broadcast does with three or more ranks.  Measured at 2 ranks
#: on the CI's VM (p50, two runs each way): a tie at 64 KiB per peer, ahead from 128 KiB;
#: broadcast ties with the slot path up to 1 MiB and is ahead from 4 MiB.
SINGLE_COPY_MIN_BYTES = 128 << 10
BROADCAST_MIN_BYTES = 2 << 20
#: Bytes from which broadcast, all_reduce and reduce between two ranks take the path, ahead
#: of the one-shot round through the slots: the robust choice between the VM's two states (the
#: module docstring; slots_vs_single_copy.json, slots / single copy, p50 us).  On one cache,
#: 512 KiB: broadcast 32-43 / 57-64, all_reduce 88-119 / 82-151, reduce 52-82 / 64-121; 1 MiB:
#: 45-49 / 84-91, 155-205 / 131-211, 91-133 / 101-173.  Across caches, 512 KiB: 226-287 /
#: 40-56, 353-385 / 119-140, 232-285 / 67-121; 1 MiB: 462-548 / 72-95, 583-704 / 155-191,
#: 430-541 / 101-167.
PAIR_BROADCAST_MIN_BYTES = 512 << 10
PAIR_REDUCTION_MIN_BYTES = 512 << 10
#: A reduction reads its peer's data a piece this big at a time into a scratch, and combines
#: it while it is still in cache.  Fewer, larger reads pin the peer's pages in fewer calls:
#: 2 MiB reduce, p50 interleaved in one run, 329 us with 256 KiB pieces, 260 with 1 MiB, 246
#: with 4 MiB; 8 MiB 2815 / 2138 / 2020 us.
_PIECE_BYTES = 1 << 20


class SingleCopy:
    """The single-copy path of one channel (module docstring)."""

    def __init__(self, chan: ShmChannel) -> None:
        self.chan = chan
        self.usable: bool | None = None  # unknown until probed
        #: Every rank has a core of its own (set by the probe, alike on every rank): then a
        #: rank that would wait idle takes a share of the copying (broadcast's root, the
        #: peer of a two-rank reduce's root).
        self.own_cores = False
        self._token = ctypes.c_int64(secrets.randbits(62))
        # Read when the communicator is made, like its other settings.
        self._allowed = config.shm_single_copy() and cma.available()
        self._scratch: dict[torch.dtype, torch.Tensor] = {}

    def wanted(
        self,
        per_peer_bytes: int,
        fp: Fingerprint | None,
        deadline: Deadline,
        min_bytes: int = SINGLE_COPY_MIN_BYTES,
    ) -> bool:
        """Whether an op moving ``per_peer_bytes`` to each peer takes this path (the same
        answer on every rank: the size is the op's, the probe's verdict is everyone's)."""
        if per_peer_bytes < min_bytes or self.chan.size < 2:
            return False
        if self.usable is None:
            self.usable = self._probe(fp, deadline)
        return self.usable

    def _probe(self, fp: Fingerprint | None, deadline: Deadline) -> bool:
        chan, me = self.chan, self.chan.rank
        k = chan.begin(deadline)
        chan.slot(me, k, torch.int64, 2).copy_(
            torch.tensor([ctypes.addressof(self._token), self._token.value])
        )
        chan.exchange(k, deadline, fp, "a single-copy probe")
        words = [chan.slot(r, k, torch.int64, 2).tolist() for r in range(chan.size)]
        chan.finish(k)
        ok = self._allowed
        pids = chan.pids
        for r in range(chan.size):
            if not ok:
                break
            if r != me:
                got = ctypes.c_int64(0)
                _, err = cma.copy(False, pids[r], ctypes.addressof(got), words[r][0], 8)
                ok = err == 0 and got.value == words[r][1]
        k = chan.begin(deadline)
        own_core = not chan.policy.oversubscribed
        chan.slot(me, k, torch.int64, 2).copy_(torch.tensor([int(ok), int(own_core)]))
        chan.exchange(k, deadline, None, "a single-copy probe")
        words = [chan.slot(r, k, torch.int64, 2).tolist() for r in range(chan.size)]
        chan.finish(k)
        # Decided once, alike on every rank: the ranks of an op must agree on who moves which
        # part.
        self.own_cores = all(w[1] == 1 for w in words)
        return all(w[0] == 1 for w in words)

    def _addresses(
        self,
        ptr: int,
        fp: Fingerprint | None,
        deadline: Deadline,
        what: str,
        meanwhile: Callable[[], object] | None = None,
    ) -> list[int]:
        """Every rank's ``ptr``, in one round; ``meanwhile`` (this rank's own part of the
        op) runs after this rank's address is out and before it waits for the others'."""
        chan = self.chan
        k = chan.begin(deadline)
        chan.publish(k, fp, count=ptr)  # in the round's meta line: no slot, no tensor
        if meanwhile is not None:
            meanwhile()
        chan.wait_all(k, deadline, fp, what)
        addresses = [chan.count_of(k, r) for r in range(chan.size)]
        chan.finish(k)
        return addresses

    def _done(self, deadline: Deadline, what: str) -> None:
        """Meet every rank once more: each has finished reading everybody's input."""
        chan = self.chan
        k = chan.begin(deadline)
        chan.exchange(k, deadline, None, what)
        chan.finish(k)

    def _read(self, r: int, local: int, remote: int, nbytes: int, what: str) -> None:
        self._move(False, r, local, remote, nbytes, what)

    def _move(self, write: bool, r: int, local: int, remote: int, nbytes: int, what: str) -> None:
        """Read ``nbytes`` of rank ``r`` (or write them into it); a failure names ``r``."""
        _, err = cma.copy(write, self.chan.pids[r], local, remote, nbytes)
        if err == errno.ESRCH:
            text = "{} died (process gone) while this rank {} for {}"
            doing = "wrote into its memory" if write else "read its data"
            raise WaitError("dead", [r], RankMessage(text, Ranks([r]), doing, what))
        if err:
            text = "{} {} for {} failed: {}"
            doing = "writing into the memory of" if write else "reading the data of"
            raise WaitError(
                "peer_failed", [r], RankMessage(text, doing, Ranks([r]), what, os.strerror(err))
            )

    def _peers(self) -> list[int]:
        """Every other rank, starting after this one (so ranks do not all read rank 0 first)."""
        size, me = self.chan.size, self.chan.rank
        return [(me + i) % size for i in range(1, size)]

    def all_gather(
        self, out: torch.Tensor, inp: torch.Tensor, fp: Fingerprint | None, deadline: Deadline
    ) -> None:
        """``out`` is [size, n] (contiguous): row r receives rank r's ``inp``."""
        me = self.chan.rank
        nbytes = inp.numel() * inp.element_size()
        base, src = out.data_ptr(), inp.data_ptr()  # rows by address: no tensor per row
        own = None
        if src != base + me * nbytes:  # not in place
            if overlaps(inp, out):
                inp = inp.clone()  # aliasing another row: peers must read what was passed in
                src = inp.data_ptr()
            own = functools.partial(ctypes.memmove, base + me * nbytes, src, nbytes)
        addresses = self._addresses(src, fp, deadline, "all_gather", own)
        for r in self._peers():
            self._read(r, base + r * nbytes, addresses[r], nbytes, "all_gather")
        self._done(deadline, "all_gather")
        host_arrays.mark_written((out,))

    def all_to_all(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        n: int,
        fp: Fingerprint | None,
        deadline: Deadline,
    ) -> None:
        """Uniform splits of ``n`` elements: chunk r of ``inp`` goes to rank r, chunk r of
        ``out`` comes from rank r."""
        me = self.chan.rank
        if overlaps(inp, out):
            inp = inp.clone()  # in place: peers read this rank's input while it writes out
        chunk = n * inp.element_size()
        base, src = out.data_ptr(), inp.data_ptr()  # flat and contiguous: chunks by address
        own = functools.partial(ctypes.memmove, base + me * chunk, src + me * chunk, chunk)
        addresses = self._addresses(src, fp, deadline, "all_to_all", own)
        for r in self._peers():
            self._read(r, base + r * chunk, addresses[r] + me * chunk, chunk, "all_to_all")
        self._done(deadline, "all_to_all")
        host_arrays.mark_written((out,))

    def broadcast(
        self, flat: torch.Tensor, root: int, fp: Fingerprint | None, deadline: Deadline
    ) -> None:
        """Every rank but ``root`` gets the root's ``flat`` into its own.  While each rank
        has a core, the root, idle otherwise, writes the first ``1/size`` of it into every
        peer as each peer reads the rest (2 ranks, 4 and 16 MiB: about half the time; with
        ranks sharing cores it gained nothing, so there the peers read it all)."""
        addresses = self._addresses(flat.data_ptr(), fp, deadline, "broadcast")
        nbytes = flat.numel() * flat.element_size()
        chan = self.chan
        share = nbytes // chan.size if self.own_cores else 0
        head = share & ~4095  # whole pages: fewer, aligned pins
        ptr = flat.data_ptr()
        if chan.rank == root:
            if head:
                for r in self._peers():
                    self._move(True, r, ptr, addresses[r], head, "broadcast")
        else:
            self._read(root, ptr + head, addresses[root] + head, nbytes - head, "broadcast")
            host_arrays.mark_written((flat,))
        self._done(deadline, "broadcast")

    def all_reduce_pair(
        self,
        flat: torch.Tensor,
        fn: Callable[..., torch.Tensor],
        fp: Fingerprint | None,
        deadline: Deadline,
    ) -> None:
        """In place between two ranks (two rounds): each reduces one half, a piece at a
        time: it reads the peer's piece, combines it into its own and writes the result
        back into the peer's tensor while it is still in cache.  Nobody else touches that
        half of either tensor meanwhile."""
        me, other = self.chan.rank, 1 - self.chan.rank
        addresses = self._addresses(flat.data_ptr(), fp, deadline, "all_reduce")
        n = flat.numel()
        shard = -(-n // 2)
        lo, hi = min(me * shard, n), min((me + 1) * shard, n)
        self._combine(flat, lo, hi, other, addresses[other], fn, "all_reduce", "both")
        self._done(deadline, "all_reduce")

    def reduce_pair(
        self,
        flat: torch.Tensor,
        root: int,
        fn: Callable[..., torch.Tensor],
        fp: Fingerprint | None,
        deadline: Deadline,
    ) -> None:
        """Into the root's ``flat`` between two ranks (two rounds): the root combines its
        peer's data, read a piece at a time.  While each rank has a core, the peer, idle
        otherwise, takes the first third: it reads the root's part, combines it with its own
        and writes the result back into the root's tensor (two transfers a byte to the root's
        one, hence a third)."""
        me, other = self.chan.rank, 1 - self.chan.rank
        addresses = self._addresses(flat.data_ptr(), fp, deadline, "reduce")
        n = flat.numel()
        split = n // 3 if self.own_cores else 0
        if me == root:
            self._combine(flat, split, n, other, addresses[other], fn, "reduce")
        elif split:
            self._combine(flat, 0, split, root, addresses[root], fn, "reduce", "peer")
        self._done(deadline, "reduce")

    def _combine(
        self,
        flat: torch.Tensor,
        lo: int,
        hi: int,
        peer: int,
        remote: int,
        fn: Callable[..., torch.Tensor],
        what: str,
        where: Literal["here", "both", "peer"] = "here",
    ) -> None:
        """Combine ``flat[lo:hi]`` with the peer's ``[lo:hi]``, a piece at a time, into this
        rank's ``flat`` (``here``), into both (``both``: each combined piece is written back
        while in cache), or only into the peer's (``peer``: ``flat`` is left as it was).
        For a reduce the root's operand goes first wherever the result lands, so either
        side gives the same bits; an all_reduce computes each piece once for both ranks."""
        es = flat.element_size()
        piece = max(_PIECE_BYTES // es, 1)
        scratch = self._scratch_of(flat.dtype, piece)
        for s in range(lo, hi, piece):
            e = min(s + piece, hi)
            part = scratch[: e - s]
            self._read(peer, part.data_ptr(), remote + s * es, (e - s) * es, what)
            mine = flat[s:e]
            if where == "peer":  # the root's operand first, as the root has it
                fn(part, mine, out=part)
                result = part
            else:
                fn(mine, part, out=mine)
                result = mine
            if where != "here":
                self._move(True, peer, result.data_ptr(), remote + s * es, (e - s) * es, what)

    def _scratch_of(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        got = self._scratch.get(dtype)
        if got is None or got.numel() < numel:
            got = self._scratch[dtype] = torch.empty(numel, dtype=dtype)
        return got
