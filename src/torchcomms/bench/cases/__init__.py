"""The bench's cases: what each benchmarked op builds, checks and calls.

* ``case``: ``OpSpec``, ``Case``, ``CaseParams``, the dtypes and reduce ops;
* ``table``: the op table (``OPS``, ``resolve``);
* ``collectives``: the collectives' and send/recv's builders;
* ``windows``: the one-sided window ops' builders (``--op put,get``).

Imports the public API, ``bench.mpi`` (only under ``--vs mpi``) and raw c10d; part of the
bench, which nothing in the library imports.
"""

from torchcomms.bench.cases.case import DTYPES, REDOPS, Case, CaseParams, OpSpec
from torchcomms.bench.cases.table import ALIASES, OPS, resolve

__all__ = ["ALIASES", "DTYPES", "OPS", "REDOPS", "Case", "CaseParams", "OpSpec", "resolve"]
