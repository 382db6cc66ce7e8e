"""``TORCHCOMM_CHECK_COLLECTIVES=1``: ranks compare every collective before running it.

Before each collective, each rank contributes a fingerprint (op, dtype, numel and shape,
root, reduce op, and the communicator's collective sequence number) and gathers everyone's
through the communicator's backend directly (no op_id consumed, no hooks or observers
fired).  If they differ, every rank raises ``CollectiveMismatchError`` naming its own and
the differing ranks' fingerprints, instead of hanging or computing a wrong result.

Scope: collectives with more than one rank, on every backend that implements
``all_gather_single`` (built-in or plug-in, through ``TorchComm._backend``; one raising
``BackendNotImplementedError`` is not checked).  Point-to-point ops are
not checked (their peers differ by design); neither are the rank-dependent sizes of the
``*_v`` ops and ``all_to_all`` (only their dtypes).  The check costs one small all-gather
per collective, and it drains the communicator's queued async ops first.  The variable is
read at each ``new_comm``.

Threads: ``CollectiveChecker.op_scheduled`` runs on the thread issuing the op, before the
backend sees it; the exchange is a blocking all-gather on that thread, and a mismatch
raises there (so the op is not run).
"""

from __future__ import annotations

import threading

import torch

from torchcomms import config
from torchcomms.comm import TorchComm, add_default_observer
from torchcomms.errors import BackendNotImplementedError, CollectiveMismatchError
from torchcomms.optable import OpName
from torchcomms.runtime import fingerprint as F
from torchcomms.runtime import opinfo
from torchcomms.runtime.oprecord import OpRecord
from torchcomms.types import OpOptions, RedOpType

_MAGIC = 0x7C0FF1CE
_LEN = 12
_MAX_DIMS = 4

_OPS = list(OpName)
_DTYPES = list(F.DTYPES)
_REDOPS = list(RedOpType)
_SKIPPED = opinfo.P2P_OPS


def fingerprint(record: OpRecord, seq: int) -> list[int]:
    name = record.name
    fp = [-1] * _LEN
    fp[0] = _MAGIC
    fp[1] = seq
    fp[2] = _OPS.index(name)
    tensor, shape_matters = opinfo.key_tensor(name, record.args)
    if tensor is not None:
        fp[3] = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else 99
        if shape_matters:
            fp[4] = int(tensor.numel())
            fp[5] = tensor.dim()
            for i, d in enumerate(tensor.shape[:_MAX_DIMS]):
                fp[6 + i] = int(d)
    root = getattr(record.args, "root", None)
    if root is not None:
        fp[10] = int(root)
    op = opinfo.reduce_op(record.call_args)
    if op is not None:
        fp[11] = _REDOPS.index(op.type)
    return fp


def describe(fp: list[int]) -> str:
    """A fingerprint as people read it: ``all_reduce(seq=3, dtype=float32, shape=[4], ...)``."""
    if len(fp) != _LEN or fp[0] != _MAGIC:
        return f"<unreadable fingerprint {fp}>"
    op = _OPS[fp[2]].name if 0 <= fp[2] < len(_OPS) else f"op#{fp[2]}"
    parts = [f"seq={fp[1]}"]
    if fp[3] >= 0:
        parts.append(
            f"dtype={str(_DTYPES[fp[3]]).removeprefix('torch.')}"
            if fp[3] < len(_DTYPES)
            else "dtype=?"
        )
    if fp[5] >= 0:
        dims = [d for d in fp[6 : 6 + min(fp[5], _MAX_DIMS)]]
        more = ", ..." if fp[5] > _MAX_DIMS else ""
        parts.append(f"numel={fp[4]}, shape=[{', '.join(map(str, dims))}{more}]")
    if fp[10] >= 0:
        parts.append(f"root={fp[10]}")
    if fp[11] >= 0:
        parts.append(f"red_op={_REDOPS[fp[11]].name}")
    return f"{op}({', '.join(parts)})"


class CollectiveChecker:
    """The observer: exchanges and compares fingerprints in ``op_scheduled``."""

    def __init__(self) -> None:
        self._seqs: dict[int, int] = {}
        self._lock = threading.Lock()

    def op_scheduled(self, record: OpRecord) -> None:
        if record.name in _SKIPPED:
            return
        comm = record.comm
        size = comm.get_size()
        if size <= 1:
            return
        key = id(comm)
        seq = self._seqs.get(key, 0) + 1
        self._seqs[key] = seq
        mine = fingerprint(record, seq)
        out = torch.empty(size * _LEN, dtype=torch.int64)
        opts = OpOptions(record.timeout, {}, "check_collectives", None)
        # Straight to the backend (backends/contract.py): no op_id, hooks or observers.
        try:
            comm._backend.all_gather_single(out, torch.tensor(mine, dtype=torch.int64), False, opts)
        except BackendNotImplementedError:  # a backend without all_gather_single is not checked
            return
        rows = out.view(size, _LEN).tolist()
        rank = comm.get_rank()
        differing = [r for r, fp in enumerate(rows) if fp != mine]
        if not differing:
            return
        theirs = "; ".join(f"rank {r}: {describe(rows[r])}" for r in differing)
        raise CollectiveMismatchError(
            f"[comm={comm._safe_name()} rank={rank}] {record.name.name} op_id={record.op_id}: "
            f"collective mismatch across ranks (TORCHCOMM_CHECK_COLLECTIVES=1): "
            f"rank {rank}: {describe(mine)}; {theirs}"
        )

    def op_finished(self, record: OpRecord) -> None:
        pass


_checker = CollectiveChecker()


def _factory(comm: TorchComm) -> CollectiveChecker | None:
    return _checker if config.check_collectives() else None


def install() -> None:
    """Attach to every communicator ``new_comm`` creates (``torchcomms.hooks`` calls this)."""
    add_default_observer(_factory)
