"""Collective fingerprints: what every rank must agree on before any data is combined.

A fingerprint describes one collective call: the op, the dtype, the element count (or
a digest of the per-rank sizes), the root and the reduce op, plus the communicator's
collective sequence number.  Every transport exchanges fingerprints in the first round
of every collective (shm: the meta line of the round; gloo: a fixed-size header that
gloo sees before any size the user chose), so disagreeing ranks all raise
``CollectiveMismatchError`` naming who passed what, and gloo never sees mismatched
sizes (it aborts the process on those).

The encoding is a few int64 words, equal on every process for equal arguments (no
``hash()`` randomisation of strings is involved: only ints are hashed).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torchcomms import optable
from torchcomms.ranks import ranks_text
from torchcomms.types import RedOpType, ReduceOp

#: The op families a fingerprint names, from the op table: an op and its ``_single`` form
#: share one (one algorithm, one agreement); point-to-point has none.  A family's code is its
#: position, equal on every process of one version.
OP_NAMES = ("", *dict.fromkeys(e.method.removesuffix("_single") for e in optable.OPS if not e.p2p))
_FAMILY_CODES = {name: code for code, name in enumerate(OP_NAMES) if name}


def family(name: str) -> int:
    """The code of an op family (``"all_reduce"``; ``all_to_all_v`` for ``all_to_all_v_single``)."""
    return _FAMILY_CODES[name]


# The families the CPU transports' algorithms fingerprint.
ALL_REDUCE, REDUCE, BROADCAST = family("all_reduce"), family("reduce"), family("broadcast")
ALL_GATHER, ALL_GATHER_V, GATHER = family("all_gather"), family("all_gather_v"), family("gather")
SCATTER, BARRIER = family("scatter"), family("barrier")
REDUCE_SCATTER, REDUCE_SCATTER_V = family("reduce_scatter"), family("reduce_scatter_v")
ALL_TO_ALL, ALL_TO_ALL_V = family("all_to_all"), family("all_to_all_v")

# Stable codes (never reorder: the code is what processes compare).
DTYPES = (
    *(torch.float32, torch.float64, torch.float16, torch.bfloat16),
    *(torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool),
    *(torch.int16, torch.complex64, torch.complex128),
)
_DTYPE_CODES = {dt: i for i, dt in enumerate(DTYPES)}
_DTYPES = dict(enumerate(DTYPES))
_NO = 0xFF  # "not part of this op" for dtype / reduce op codes
_MASK32 = 0xFFFFFFFF

#: The words of a fingerprint: (digest, descriptor, count).  ``digest`` covers everything
#: and is what the fast path compares; the other two say what differs when it does not.
Fingerprint = tuple[int, int, int]

#: Digests are 62-bit and non-negative, so ``digest + seq`` (``checked_word``) fits an
#: int64 for any sequence number below 2**62.
DIGEST_MASK = (1 << 62) - 1


def make(
    op: int,
    dtype: torch.dtype | None,
    count: int,
    root: int = -1,
    redop: ReduceOp | None = None,
    sizes: Sequence[int] = (),
) -> Fingerprint:
    """The fingerprint of one call; ``sizes`` (per-rank sizes of a ``_v`` op) go in ``count``."""
    dcode = _NO if dtype is None else _DTYPE_CODES.get(dtype, 0xFE)
    rcode = _NO if redop is None else redop.type.value
    if sizes:
        count = hash(tuple(sizes)) & ((1 << 62) - 1)
    desc = op | dcode << 8 | rcode << 16 | (root & _MASK32) << 24
    return digest_of(desc, count), desc, count


def digest_of(desc: int, count: int) -> int:
    """The digest of a descriptor and count (``make``'s first word)."""
    return hash((desc, count)) & DIGEST_MASK


def checked_word(fp: Fingerprint, seq: int) -> int:
    """One int64 that differs whenever the digest or the sequence number does.

    ``digest + seq``: ranks one op apart differ by one; different digests collide only
    when they differ by exactly the gap in sequence numbers (a 62-bit hash: never in
    practice).  The shm path compares this one word per peer on its hot path.
    """
    return fp[0] + seq


def unpack_word(word: int, desc: int, count: int) -> tuple[Fingerprint, int]:
    """``(fingerprint, seq)`` back from a ``checked_word`` and its descriptor and count."""
    digest = digest_of(desc, count)
    return (digest, desc, count), word - digest


def fields(fp: Fingerprint, seq: int) -> dict[str, object]:
    """The named fields of a fingerprint, for a mismatch message."""
    _, desc, count = fp
    op = desc & 0xFF
    dcode = desc >> 8 & 0xFF
    rcode = desc >> 16 & 0xFF
    root = desc >> 24 & _MASK32
    out: dict[str, object] = {"op": OP_NAMES[op] if op < len(OP_NAMES) else f"op#{op}"}
    out["dtype"] = "none" if dcode == _NO else str(_DTYPES.get(dcode, f"dtype#{dcode}"))
    out["count" if op not in (ALL_GATHER_V, REDUCE_SCATTER_V) else "sizes"] = count
    out["root"] = -1 if root == _MASK32 else root
    out["reduce_op"] = "none" if rcode == _NO else _redop_name(rcode)
    out["seq"] = seq
    return out


def _redop_name(code: int) -> str:
    try:
        return RedOpType(code).name
    except ValueError:
        return f"op#{code}"


def mismatch(
    by_rank: Sequence[tuple[Fingerprint, int]], labels: Sequence[int] | None = None
) -> tuple[list[int], str] | None:
    """``(differing ranks, text)`` when the ranks' ``(fingerprint, seq)`` disagree, else None.

    The text names the first field that differs and who passed which value, the largest
    group last: ``rank 1 passed root=1, ranks 0, 2, 3 root=0``.  ``labels``: the rank of
    each entry (default: its position).
    """
    first = by_rank[0]
    if all(x == first for x in by_rank):
        return None
    named = [fields(fp, seq) for fp, seq in by_rank]
    for key in named[0]:
        values = [f[key] for f in named]
        if len(set(map(str, values))) > 1:
            break
    else:  # digests differ with equal fields: a hash collision in the sizes digest
        key, values = "sizes", [fp[2] for fp, _ in by_rank]
    names = list(labels) if labels is not None else list(range(len(by_rank)))
    groups: dict[str, list[int]] = {}
    for r, v in zip(names, values, strict=True):
        groups.setdefault(str(v), []).append(r)
    ordered = sorted(groups.items(), key=lambda g: (-len(g[1]), min(g[1])))
    majority = ordered[0][1]
    differing = sorted(r for r in names if r not in majority)
    parts = [
        f"{ranks_text(rs, 'rank')} {'passed ' if i == 0 else ''}{key}={v}"
        for i, (v, rs) in enumerate(reversed(ordered))
    ]
    return differing, ", ".join(parts)
