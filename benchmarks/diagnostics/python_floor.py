"""How fast Python itself can pass a small message to a process on another core and back:
the floor under the small send/recv and broadcast.

    python benchmarks/diagnostics/python_floor.py [--calls 20000] [--rounds 5] [--json OUT]

Two forked processes, each pinned to a core of its own where there are two, ping-pong
through one shared page, in steps that each add what any Python communication library has
to do:

* ``counter``: each side spins on a turn counter (a ``memoryview`` of the page) and bumps
  it: the interpreter's loop and the cache line's trip between the cores, nothing else;
* ``payload``: plus the bytes: the sender copies an 8-byte tensor into the page and the
  receiver copies them out into its tensor (``ctypes.memmove`` by ``data_ptr()``);
* ``call``: plus one Python method per send and per receive that checks its arguments
  (a tensor, a peer in range) and returns an object, as an API must;
* ``comm``: the same ping-pong through ``TorchComm.send``/``recv`` on a 2-rank shm
  communicator (what ``python -m torchcomms.bench --op sendrecv -b 8 -e 8`` times).

Each rank of the comm step also times a plain Python function call before its loop (the
slower rank's is printed): on this VM a process's Python speed differs from one launch to the
next (the same call 50-60 ns in some, 75-90 ns in others), and the round trips follow.  Prints the p50 round trip of each step (timed one by one on the first process) and half
of it, the one-way time the bench reports for sendrecv, best of ``--rounds`` rounds of
``--calls`` round trips.  Open MPI's own on the same machine:
``mpirun -n 2 python -m torchcomms.bench --vs mpi --op sendrecv -b 8 -e 8``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import sys
import tempfile
import time
import timeit
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _doc import write_doc
from _ranks import round_trip, run_local_ranks

_CHILD = "PYTHON_FLOOR_CHILD"
_OUT = "PYTHON_FLOOR_OUT"
_STEPS = ("counter", "payload", "call")


class _Sent:
    """What the ``call`` step's methods return (an API returns a work or status object)."""

    __slots__ = ("peer",)

    def __init__(self, peer: int) -> None:
        self.peer = peer


class _Endpoint:
    """The ``call`` step: a send and a receive with argument checks, over the page."""

    def __init__(self, words: memoryview, base: int, me: int) -> None:
        self.words, self.base, self.me = words, base, me

    def send(self, tensor: torch.Tensor, peer: int, turn: int) -> _Sent:
        if not isinstance(tensor, torch.Tensor) or not 0 <= peer < 2 or peer == self.me:
            raise ValueError("bad send")
        ctypes.memmove(self.base + 64, tensor.data_ptr(), 8)
        self.words[0] = turn + 1
        return _Sent(peer)

    def recv(self, tensor: torch.Tensor, peer: int, turn: int) -> _Sent:
        if not isinstance(tensor, torch.Tensor) or not 0 <= peer < 2 or peer == self.me:
            raise ValueError("bad recv")
        words = self.words
        while words[0] != turn:
            pass
        ctypes.memmove(tensor.data_ptr(), self.base + 64, 8)
        return _Sent(peer)


_CORES = sorted(os.sched_getaffinity(0))


def _pin(me: int) -> None:
    os.sched_setaffinity(0, {_CORES[me % len(_CORES)]})


def _play(step: str, words: memoryview, base: int, me: int, calls: int) -> list[int]:
    """Rank 0 sends first (turn 2i), rank 1 answers (turn 2i+1); each round trip timed."""
    mine, got = torch.full((1,), float(me)), torch.zeros(1)
    endpoint = _Endpoint(words, base, me)
    src, dst = mine.data_ptr(), got.data_ptr()
    slot = base + 64
    clock = time.perf_counter_ns
    times = []
    for i in range(calls):
        t0 = clock()
        for turn in (2 * i, 2 * i + 1):
            sending = (turn % 2 == 0) == (me == 0)
            if step == "call":
                if sending:
                    endpoint.send(mine, 1 - me, turn)
                else:
                    endpoint.recv(got, 1 - me, turn + 1)
                continue
            if sending:
                if step == "payload":
                    ctypes.memmove(slot, src, 8)
                words[0] = turn + 1
            else:
                while words[0] != turn + 1:
                    pass
                if step == "payload":
                    ctypes.memmove(dst, slot, 8)
        times.append(clock() - t0)
    return times


def _p50_us(times_ns: list[int]) -> float:
    return sorted(times_ns)[len(times_ns) // 2] / 1e3


def _forked(step: str, calls: int) -> float:
    """The p50 round trip of ``calls``, in µs, timed on the first process."""
    mm = mmap.mmap(-1, 4096)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    words = memoryview(mm).cast("q")
    pid = os.fork()
    if pid == 0:
        _pin(1)
        _play(step, words, base, 1, calls)
        os._exit(0)
    _pin(0)
    times = _play(step, words, base, 0, calls)
    os.waitpid(pid, 0)
    os.sched_setaffinity(0, _CORES)
    del words
    return _p50_us(times)


def _comm_child(calls: int, rounds: int) -> None:
    import torchcomms

    rank = int(os.environ["TORCHCOMM_RANK"])
    _pin(rank)
    comm = torchcomms.new_comm(
        "gloo", torch.device("cpu"), name="floor", timeout=timedelta(seconds=60)
    )
    mine, got = torch.full((1,), float(rank)), torch.zeros(1)
    clock = time.perf_counter_ns
    py_call_ns = _py_call_ns()  # each rank's own speed, beside its round trips
    best = float("inf")
    for _ in range(rounds):
        times = []
        for _ in range(calls):
            t0 = clock()
            round_trip(comm, rank, mine, got)
            times.append(clock() - t0)
        best = min(best, _p50_us(times))
    transport = str(getattr(comm.get_backend_impl(), "transport", ""))
    slower = torch.tensor([py_call_ns], dtype=torch.float64)
    comm.all_reduce(slower, torchcomms.ReduceOp.MAX, False)
    py_call_ns = float(slower[0])
    comm.finalize()
    if rank == 0:
        doc = {"comm": best, "transport": transport, "py_call_ns": py_call_ns}
        Path(os.environ[_OUT]).write_text(json.dumps(doc))


def _py_call_ns() -> float:
    """One call of a two-argument Python function, best of 3 x 100000, in ns: how fast this
    process runs plain Python (on this VM it differs from one launch to the next)."""

    def add(a: int, b: int) -> int:
        return a + b

    return min(timeit.repeat(lambda: add(1, 2), number=100_000, repeat=3)) / 100_000 * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if os.environ.get(_CHILD):
        _comm_child(args.calls, args.rounds)
        return
    results: dict[str, float] = {}
    for step in _STEPS:
        results[step] = min(_forked(step, args.calls) for _ in range(args.rounds))
    out = os.path.join(tempfile.mkdtemp(), "comm.json")
    os.environ[_OUT] = out
    if run_local_ranks(__file__, _CHILD) != 0:
        sys.exit("the comm step failed")
    comm = json.loads(Path(out).read_text())
    results["comm"] = comm["comm"]
    print(f"{len(_CORES)} usable cores; 8-byte ping-pong p50, best of {args.rounds} x {args.calls}")
    print("  step      round trip   one way (the bench's sendrecv column)")
    for step, us in results.items():
        print(f"  {step:8s} {us:8.2f} us {us / 2:8.2f} us")
    print(
        f"  (comm over {comm['transport']}; a Python call took {comm['py_call_ns']:.0f} ns there)"
    )
    if args.json:
        write_doc(
            args.json,
            " ".join(sys.argv),
            results,
            unit="us per round trip, p50",
            transport=comm["transport"],
            comm_py_call_ns=comm["py_call_ns"],
        )


if __name__ == "__main__":
    main()
