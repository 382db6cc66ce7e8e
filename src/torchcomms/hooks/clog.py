"""``clog``: a pipe-delimited per-rank log of communicator lifecycle and ops (upstream's ClogHook v1).

Lines (``+<ts>`` is seconds since ``base_timestamp``, millisecond precision)::

    V|1|base_timestamp=1714234567.890
    new_comm|comm=world|rank=0|world_size=8
    C1|sig|all_reduce|in_count=1024|out_count=1024|dtype=f32|red_op=sum|async_op=f|comm=world
    C1|Q|work_id=1|+0.001          enqueue (always)
    C1|S|+0.002                    start   (events LIFECYCLE or ALL)
    C1|E|+0.005                    end     (events LIFECYCLE or ALL)
    split|parent=world|child=tp|ranks=0,1
    WARN|C1|work_id=1|failed: CommTimeoutError: ...

A signature line is written once per distinct (op, parameters, communicator); its
``C<id>`` tags every event of ops with that signature.  ``verbose=["buffers"]`` adds
tensor addresses (``buf=``/``in=``/``out=``).  ``W`` (wait) events are not logged:
waits are not observable here.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from typing import IO, Any

import torch

from torchcomms import optable
from torchcomms.comm import TorchComm
from torchcomms.optable import OpName
from torchcomms.runtime import opinfo
from torchcomms.runtime.oprecord import OpRecord
from torchcomms.types import RedOpType

_LIFECYCLE_EVENTS = frozenset({"LIFECYCLE", "ALL"})
_VALID_EVENTS = _LIFECYCLE_EVENTS
_VALID_VERBOSE = frozenset({"buffers"})

_RED_OP_NAMES = {
    RedOpType.SUM: "sum",
    RedOpType.PRODUCT: "prod",
    RedOpType.MIN: "min",
    RedOpType.MAX: "max",
    RedOpType.BAND: "band",
    RedOpType.BOR: "bor",
    RedOpType.BXOR: "bxor",
    RedOpType.PREMUL_SUM: "premul_sum",
    RedOpType.AVG: "avg",
}


def _dtype(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return opinfo.SHORT_DTYPE_NAMES.get(t.dtype, "other")
    return "other"


def _counts(ts: Any) -> str:
    return ",".join(str(t.numel()) for t in ts)


def _addr(t: torch.Tensor) -> str:
    return hex(t.data_ptr())


def _side(args: Any, side: opinfo.FieldSide, prefix: str) -> tuple[str, Any]:
    """``in_count=N`` / ``in_counts=a,b`` / ``in_count=0`` for one side, and its tensors."""
    if side is None:
        return f"{prefix}_count=0", None
    value = getattr(args, side[0])
    if side[1] == optable.ONE:
        return f"{prefix}_count={value.numel()}", value
    return f"{prefix}_counts={_counts(value)}", value


def _addrs(value: Any) -> str:
    return _addr(value) if isinstance(value, torch.Tensor) else ",".join(_addr(t) for t in value)


def signature(name: OpName, args: Any, call_args: tuple[Any, ...], buffers: bool) -> str:
    """``<op>|k=v|...`` (without the comm) as upstream's ClogHook writes it, from the op's
    sides in the op table: counts, dtype, peer, buffers, reduce op, root, async_op."""
    parts = [name.name]
    entry = optable.BY_NAME.get(name)
    if name is OpName.batch_op_issue:
        parts.append(f"num_ops={args.num_ops}")
    elif entry is not None and (entry.inputs or entry.outputs):
        inputs, outputs = opinfo.IO[name]
        in_text, ins = _side(args, inputs, "in")
        out_text, outs = _side(args, outputs, "out")
        # The dtype: of the first side that is one tensor, else of the first input.
        typed = next((v for v in (ins, outs) if isinstance(v, torch.Tensor)), None)
        if typed is None and ins:
            typed = ins[0]
        if optable.INTS in entry.kinds:  # split sizes instead of counts, no buffers
            parts += [
                f"in_splits={','.join(map(str, args.input_split_sizes))}",
                f"out_splits={','.join(map(str, args.output_split_sizes))}",
                f"dtype={_dtype(typed)}",
            ]
        else:
            parts += [in_text, out_text, f"dtype={_dtype(typed)}"]
            if entry.p2p:
                parts.append(f"peer={args.peer}")
            elif buffers and inputs == outputs:  # in place: one buffer
                parts.append(f"buf={_addr(ins)}")
            elif buffers and (isinstance(ins, torch.Tensor) or isinstance(outs, torch.Tensor)):
                parts += [f"in={_addrs(ins)}", f"out={_addrs(outs)}"]
    if entry is not None and entry.reducing:
        op = opinfo.reduce_op(call_args)
        parts.append(f"red_op={_RED_OP_NAMES.get(op.type, 'unknown') if op else 'unknown'}")
    if entry is not None and entry.rooted:
        parts.append(f"root={args.root}")
    parts.append(f"async_op={'t' if getattr(args, 'async_op', False) else 'f'}")
    return "|".join(parts)


class clog:
    """Writes the log described in the module docstring to ``output``."""

    def __init__(
        self, output: str, events: list[str] | None = None, verbose: list[str] | None = None
    ) -> None:
        events = list(events or [])
        verbose = list(verbose or [])
        for e in events:
            if e not in _VALID_EVENTS:
                raise ValueError(f"clog: unknown event {e!r} (expected one of LIFECYCLE, ALL)")
        for v in verbose:
            if v not in _VALID_VERBOSE:
                raise ValueError(f"clog: unknown verbose option {v!r} (expected 'buffers')")
        self._lifecycle = any(e in _LIFECYCLE_EVENTS for e in events)
        self._buffers = "buffers" in verbose
        self._lock = threading.Lock()
        self._base_ns = time.time_ns()
        self._file: IO[str] | None = open(output, "a", buffering=1)  # noqa: SIM115
        self._sigs: dict[str, int] = {}
        self._corr = itertools.count(1)
        self._work_ids = itertools.count(1)
        # op_id -> (corr_id, work_id) while the op is in flight
        self._inflight: dict[int, tuple[int, int]] = {}
        self._comms: list[weakref.ref[TorchComm]] = []
        self._write(f"V|1|base_timestamp={self._base_ns / 1e9:.3f}")

    # -- output ------------------------------------------------------------------------------
    def _ts(self, ns: int | None = None) -> str:
        return f"+{((ns or time.time_ns()) - self._base_ns) / 1e9:.3f}"

    def _write(self, line: str) -> None:
        with self._lock:
            f = self._file
            if f is not None:
                f.write(line + "\n")

    def close(self) -> None:
        self.unregister()
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    # -- registration ------------------------------------------------------------------------
    def register_with_comm(self, comm: TorchComm) -> None:
        if not isinstance(comm, TorchComm):
            raise TypeError(f"register_with_comm expects a TorchComm, got {type(comm).__name__}")
        self._write(
            f"new_comm|comm={comm._safe_name()}|rank={comm.get_rank()}|world_size={comm.get_size()}"
        )
        comm._add_observer(self)
        self._comms.append(weakref.ref(comm))

    def comm_split(
        self, parent: TorchComm, child: TorchComm, members: list[int], op_id: int
    ) -> None:
        self._write(
            f"split|parent={parent._safe_name()}|child={child._safe_name()}"
            f"|ranks={','.join(map(str, members))}"
        )
        self.register_with_comm(child)

    def unregister(self) -> None:
        for ref in self._comms:
            comm = ref()
            if comm is not None:
                comm._remove_observer(self)
        self._comms = []

    # -- OpObserver --------------------------------------------------------------------------
    def op_scheduled(self, record: OpRecord) -> None:
        try:
            sig = signature(record.name, record.args, record.call_args, self._buffers)
        except Exception:
            sig = f"{record.name.name}|async_op={'t' if record.async_op else 'f'}"
        sig = f"{sig}|comm={record.comm._safe_name()}"
        with self._lock:
            corr = self._sigs.get(sig)
            new = corr is None
            if corr is None:
                corr = self._sigs[sig] = next(self._corr)
            work_id = next(self._work_ids)
        if new:
            self._write(f"C{corr}|sig|{sig}")
        self._write(f"C{corr}|Q|work_id={work_id}|{self._ts(record.time_created_ns)}")
        self._inflight[record.op_id] = (corr, work_id)

    def op_finished(self, record: OpRecord) -> None:
        ids = self._inflight.pop(record.op_id, None)
        if ids is None:
            return
        corr, work_id = ids
        if self._lifecycle:
            started = record.started_ns or record.time_completed_ns
            self._write(f"C{corr}|S|{self._ts(started)}")
            self._write(f"C{corr}|E|{self._ts(record.time_completed_ns)}")
        if record.error is not None:
            msg = str(record.error).replace("\n", " ")
            self._write(
                f"WARN|C{corr}|work_id={work_id}|failed: {type(record.error).__name__}: {msg}"
            )
