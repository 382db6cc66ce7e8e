"""The op table: one ``OpSpec`` per benchmarked op, nccl-tests style.

Each row says how many elements a row of ``S`` bytes means, the bus-bandwidth factor, what
bounds it for the ceiling column (the memory traffic of the copy-in/copy-out model; whether
every rank sends and receives at once, for the wire), and which builder makes its ``Case``.
One harness (``runner``) runs them all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchcomms.bench.cases import windows
from torchcomms.bench.cases.case import Case, CaseParams, OpSpec, _coefficients
from torchcomms.bench.cases.collectives import (
    _build_all_gather,
    _build_all_reduce,
    _build_all_to_all,
    _build_barrier,
    _build_broadcast,
    _build_reduce,
    _build_reduce_scatter,
    _build_sendrecv,
)


def _per_rank(n: int) -> int:
    return n


#: nccl-tests' busbw factor of each ``factor_text`` (``-``: no payload, so no busbw).
_BUSBW_FACTORS: dict[str, Callable[[int], float]] = {
    "2(n-1)/n": lambda n: 2 * (n - 1) / n,
    "(n-1)/n": lambda n: (n - 1) / n,
    "1": lambda n: 1.0,
    "-": lambda n: 0.0,
}


def _traffic(text: str) -> Callable[[int], float] | None:
    """The model ``k(N) = aN+b`` that a ``traffic_text`` spells, or None for ``-`` (no
    payload)."""
    if text == "-":
        return None
    a, b = _coefficients(text)
    return lambda n: a * n + b


def _spec(
    name: str,
    factor_text: str,
    traffic_text: str,
    build: Callable[[CaseParams], Case],
    **options: Any,
) -> OpSpec:
    """A table row, its formulas written once: as the header prints them."""
    return OpSpec(
        name=name,
        factor_text=factor_text,
        busbw_factor=_BUSBW_FACTORS[factor_text],
        traffic_text=traffic_text,
        traffic=_traffic(traffic_text),
        build=build,
        **options,
    )


_TABLE = (
    _spec("all_reduce", "2(n-1)/n", "5N+1", _build_all_reduce, reduces=True, copy_in_text="2N"),
    _spec(
        "reduce",
        "1",
        "3N+1",
        _build_reduce,
        reduces=True,
        rooted=True,
        copy_in_text="2N",
        checked_rank=lambda n, root: root,
        exchange=False,
    ),
    _spec("broadcast", "1", "2N", _build_broadcast, rooted=True, copy_in_text="2", exchange=False),
    _spec(
        "all_gather",
        "(n-1)/n",
        "2N+2",
        _build_all_gather,
        granularity=_per_rank,
        aliases=("all_gather_single",),
    ),
    _spec(
        "reduce_scatter",
        "(n-1)/n",
        "3N+1",
        _build_reduce_scatter,
        granularity=_per_rank,
        reduces=True,
        aliases=("reduce_scatter_single",),
    ),
    _spec(
        "all_to_all",
        "(n-1)/n",
        "4N",
        _build_all_to_all,
        granularity=_per_rank,
        placements=(False,),  # gloo's alltoall gives wrong results when output is input
        aliases=("all_to_all_single", "alltoall"),
    ),
    _spec(
        "sendrecv",
        "1",
        "4",
        _build_sendrecv,
        placements=(False,),
        min_ranks=2,
        time_divisor=2,
        checked_rank=lambda n, root: 1,
        aliases=("send_recv", "send/recv", "p2p"),
        exchange=False,  # a ping-pong: one direction at a time
    ),
    _spec(
        "barrier",
        "-",
        "-",
        _build_barrier,
        placements=(False,),
        sized=False,
        checked_rank=lambda n, root: None,
    ),
)


def _build_put(p: CaseParams) -> Case:
    return Case(*windows.build_put(p.rank, p.count, p.dtype))


def _build_get(p: CaseParams) -> Case:
    return Case(*windows.build_get(p.rank, p.count, p.dtype))


#: One-sided window ops: run only when named (``--op put,get``), not by default.
_WINDOW_TABLE = (
    _spec(
        "put",
        "1",
        "2",
        _build_put,
        placements=(False,),
        min_ranks=2,
        time_divisor=2,
        checked_rank=lambda n, root: 0,
        aliases=("window_put",),
        exchange=False,
    ),
    _spec(
        "get",
        "1",
        "2",
        _build_get,
        placements=(False,),
        min_ranks=2,
        checked_rank=lambda n, root: 0,
        aliases=("window_get",),
        exchange=False,
    ),
)

#: The ops of the default run.
OPS: dict[str, OpSpec] = {spec.name: spec for spec in _TABLE}
ALIASES: dict[str, str] = {
    **{spec.name: spec.name for spec in (*_TABLE, *_WINDOW_TABLE)},
    **{alias: spec.name for spec in (*_TABLE, *_WINDOW_TABLE) for alias in spec.aliases},
}


def resolve(names: list[str]) -> list[OpSpec]:
    """Op specs for user-given names (aliases allowed, duplicates dropped, table order kept)."""
    wanted = set()
    for name in names:
        key = name.strip().lower()
        if key not in ALIASES:
            choices = ", ".join([*OPS, *(spec.name for spec in _WINDOW_TABLE)])
            raise ValueError(f"unknown op {name!r} (choose from {choices})")
        wanted.add(ALIASES[key])
    return [spec for spec in (*_TABLE, *_WINDOW_TABLE) if spec.name in wanted]
