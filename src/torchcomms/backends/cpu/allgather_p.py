"""The CPU backend's persistent all-gather: register an output once, gather into it many times.

Upstream's (ncclx/rcclx, ctran) registers the output buffer at init, a collective exchange
of memory handles, and moves data with copy engines at each exec.  Here the registration
is the same agreement without memory handles: at init every member contributes its
output's element count and dtype (one ``all_gather_single`` of two int64 words on the
comm's transport), so members that registered different outputs all learn it there,
each raising the same ``CommValidationError`` naming them, instead of meeting a mismatch at
the first exec.  Each exec is an ``all_gather_single`` into the registered output on the
comm's transport (shm, tcp or hierarchical); free drops the registration (local, no
communication).
"""

from __future__ import annotations

import torch

from torchcomms.backends.cpu.staging import CPU_DTYPES
from torchcomms.errors import CommValidationError
from torchcomms.ranks import ranks_text

#: The code of each dtype in the init exchange (a fixed order: processes compare codes).
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(CPU_DTYPES)}
_DTYPES = dict(enumerate(CPU_DTYPES))
#: Registrations an error lists (the ranks that differ are always named in full).
_SHOWN = 8


class Registration:
    """One registered output; ``output`` is None once freed."""

    __slots__ = ("output",)

    def __init__(self, output: torch.Tensor) -> None:
        self.output: torch.Tensor | None = output


def descriptor(output: torch.Tensor) -> torch.Tensor:
    """This rank's contribution to the init exchange: (element count, dtype code)."""
    return torch.tensor([output.numel(), _DTYPE_CODES[output.dtype]], dtype=torch.int64)


def check_agreement(table: torch.Tensor, rank: int, prefix: str) -> None:
    """Raise unless every row of ``table`` (one per rank) equals this rank's row.

    Every rank holds the same table, so every rank raises the same error, naming the ranks
    whose registration differs from rank 0's.
    """
    rows = [tuple(int(v) for v in row) for row in table.view(-1, 2).tolist()]
    if all(row == rows[0] for row in rows):
        return
    differ = [r for r, row in enumerate(rows) if row != rows[0]]

    def text(row: tuple[int, ...]) -> str:
        dtype = _DTYPES.get(row[1])
        return f"{row[0]} x {str(dtype).removeprefix('torch.') if dtype else row[1]}"

    shown = [f"rank {r}: {text(row)}" for r, row in enumerate(rows)][:_SHOWN]
    more = ", ..." if len(rows) > _SHOWN else ""
    verb = "differs" if len(differ) == 1 else "differ"
    raise CommValidationError(
        f"{prefix}every member must register an output of the same size and dtype "
        f"({ranks_text(differ, 'rank')} {verb} from rank 0; this is rank {rank}; "
        f"registered: {', '.join(shown)}{more})"
    )
