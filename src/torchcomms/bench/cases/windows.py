"""Bench cases of the one-sided window ops, ``put`` and ``get`` (``--op put,get``).

Each builder returns the parts of a ``Case`` (``ops`` wraps them, so this module needs
nothing from it): ``(ours, gloo, reset, wrong, corrupt)``.  Every rank of the bench's comm
creates the case's window on its first ``ours`` call with that comm (registration is
collective, and every rank makes the same calls), so ranks that sit the op out still
register.  A case's window lives as long as the case (per size); on the tcp path the
comm's window server keeps a reference to it until the comm is finalized.

* ``put``: ping-pong like ``sendrecv``: rank 0 puts ``S`` bytes into rank 1's window and
  signals; rank 1 waits for the signal, puts its window back into rank 0's and signals;
  one-way time = round trip / 2.  Checked on rank 0 (its window holds the echo; after
  the baseline, its receive buffer does).
  Baseline (``--vs gloo``): gloo send/recv ping-pong.
* ``get``: rank 0 reads ``S`` bytes of rank 1's window, rank 1 does nothing (on another
  host its window server answers).  Baseline: rank 1 sends, rank 0 receives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_TAG = 9

Parts = tuple[
    Callable[[Any], None],
    Callable[[Any], None],
    Callable[[], None],
    Callable[[], int],
    Callable[[], None],
]


def _payload(count: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.arange(count, dtype=torch.int64) % 80 + 1).to(dtype)


def _windows(initial: torch.Tensor) -> Callable[[Any], Any]:
    """The case's window on a comm, created (collectively) on the first call with it."""
    made: dict[int, Any] = {}

    def window(comm: Any) -> Any:
        win = made.get(id(comm))
        if win is None:
            win = made[id(comm)] = comm.new_window(initial.clone())
            comm.barrier(False)
        return win

    return window


def _sitting_out(
    window: Callable[[Any], Any],
) -> tuple[Callable[[Any], None], Callable[[Any], None]]:
    """``ours`` and ``gloo`` of a rank that sits the op out: it only creates the window."""

    def ours(comm: Any) -> None:
        window(comm)

    def gloo(pg: Any) -> None:
        return None

    return ours, gloo


def build_put(rank: int, count: int, dtype: torch.dtype) -> Parts:
    payload = _payload(count, dtype)
    window = _windows(torch.zeros(count, dtype=dtype))
    got = torch.empty_like(payload)
    last: list[Any] = []

    def own() -> torch.Tensor | None:
        return last[0].get_tensor() if last else None

    ours: Callable[[Any], None]
    gloo: Callable[[Any], None]
    if rank == 0:

        def ours(comm: Any) -> None:
            win = window(comm)
            last[:] = [win]
            win.put(payload, 1, 0, False)
            win.signal(1, False)
            win.wait_signal(1, False)

        def gloo(pg: Any) -> None:
            last.clear()  # the echo lands in ``got``: check that
            pg.send([payload], 1, _TAG).wait()
            pg.recv([got], 1, _TAG).wait()

    elif rank == 1:

        def ours(comm: Any) -> None:
            win = window(comm)
            win.wait_signal(0, False)
            win.put(win.get_tensor(), 0, 0, False)
            win.signal(0, False)

        def gloo(pg: Any) -> None:
            pg.recv([got], 0, _TAG).wait()
            pg.send([got], 0, _TAG).wait()

    else:
        ours, gloo = _sitting_out(window)

    def reset() -> None:
        mine = own()
        if mine is not None:
            mine.zero_()
        got.zero_()

    def wrong() -> int:
        if rank != 0:
            return 0
        mine = own()
        echo = got if mine is None else mine
        return int((echo != payload).sum().item())

    def corrupt() -> None:
        mine = own()
        echo = got if mine is None else mine
        if echo.numel():
            echo[0] = echo[0] + 1

    return ours, gloo, reset, wrong, corrupt


def build_get(rank: int, count: int, dtype: torch.dtype) -> Parts:
    payload = _payload(count, dtype)
    window = _windows(payload if rank == 1 else torch.zeros(count, dtype=dtype))
    got = torch.zeros_like(payload)

    ours: Callable[[Any], None]
    gloo: Callable[[Any], None]
    if rank == 0:

        def ours(comm: Any) -> None:
            window(comm).get(got, 1, 0, False)

        def gloo(pg: Any) -> None:
            pg.recv([got], 1, _TAG).wait()

    elif rank == 1:

        def ours(comm: Any) -> None:
            window(comm)

        def gloo(pg: Any) -> None:
            pg.send([payload], 0, _TAG).wait()

    else:
        ours, gloo = _sitting_out(window)

    def reset() -> None:
        got.zero_()

    def wrong() -> int:
        return int((got != payload).sum().item()) if rank == 0 else 0

    def corrupt() -> None:
        if got.numel():
            got[0] = got[0] + 1

    return ours, gloo, reset, wrong, corrupt
