"""``FlightRecorderHook``: a ring buffer of recent ops in PyTorch's flight-recorder format (v2.10).

Every entry has PyTorch's fields (``record_id``, ``pg_id``, ``process_group``,
``collective_seq_id``, ``p2p_seq_id``, ``op_id``, ``profiling_name``, sizes, dtypes,
``state``, discovered start/completion times, ``duration_ms``, ``retired``, ``timeout_ms``,
``is_p2p``, ``frames``, ``thread_id``, ``thread_name``) plus ``error`` for failed ops.
States are real: an entry is ``scheduled`` until its op runs, ``started`` while it runs,
``completed`` when it finished (with ``error`` set if it failed).

Dumps: ``dump_json()`` returns JSON; ``dump_file(rank)`` writes a pickle (mode 0600) to
``<TORCHCOMM_FR_DUMP_TEMP_FILE><rank>`` (default: ``<tempdir>/torchcomm_fr-<uid>/rank_<rank>``,
a directory of this user's alone; see ``_fr_dump.dump_path``), the per-rank file layout that
the unmodified ``python -m torch.distributed.flight_recorder.fr_trace DIR`` reads.

Always on: ``import torchcomms`` installs a process-wide recorder (``TORCHCOMM_FR_BUFFER_SIZE``
entries, default 2000; ``0`` turns it off for communicators created while it is 0).  On a
timeout, peer failure or abort it dumps to ``<prefix><global rank>`` and appends
``[flight recorder dump: PATH]`` to the error's message.  ``SIGUSR1`` also dumps, when
nothing else handles that signal (``faulthandler.register(SIGUSR1)`` or a native handler
is left alone; ``TORCHCOMM_FR_DUMP_ON_SIGUSR1=1`` takes the signal anyway, still calling a
Python-level previous handler, ``=0`` never takes it).

Modules: this one is the recorder (the ring buffer observer, the process-wide buffer,
auto-dumps, the hook); ``_fr_dump`` holds the dump format, communicator metadata and file
writing, ``_fr_signal`` the SIGUSR1 handler.  Their public names are importable from here.

Threads: ``op_scheduled`` (and ``comm_split``) run on the thread issuing the op and append
one entry; ``op_finished`` runs on whichever thread finished the op (see
``torchcomms.runtime.oprecord``) and only dumps if the op failed; the abort hook runs on the
aborting thread.  Dumps copy the buffer (retrying if it changes underneath) and may run on
any thread, concurrently with recording.

Cost: one tuple per op, appended to a ``deque`` (about 0.8 us/op on top of the ~1 us shared
``OpRecord``); no stack capture unless ``TORCHCOMM_FR_STACK=1``.  Entries keep the op's
record (times, error, and so its communicator object) until they are overwritten, never
tensors.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from torchcomms import config
from torchcomms.comm import RemovableHandle, TorchComm, add_default_observer
from torchcomms.errors import CommAbortedError, CommTimeoutError, PeerFailureError
from torchcomms.hooks import _fr_signal
from torchcomms.hooks._fr_dump import (
    DUMP_MARK,
    FR_VERSION,
    CommMeta,
    Entry,
    comm_meta,
    dump_document,
    dump_path,
    entry_to_dict,
    find_meta,
    process_global_rank,
    write_dump_file,
)
from torchcomms.optable import OpName
from torchcomms.runtime import opinfo
from torchcomms.runtime.oprecord import OpRecord, SyncRecord

logger = logging.getLogger("torchcomms.hooks.fr")

__all__ = [
    "DUMP_MARK",
    "FR_VERSION",
    "CommMeta",
    "Entry",
    "FlightRecorderHook",
    "auto_dump",
    "comm_meta",
    "dump_path",
    "entry_to_dict",
    "global_ring",
    "install_signal_handler",
    "process_global_rank",
    "write_dump",
]

_AUTO_DUMP_ERRORS = (CommTimeoutError, PeerFailureError, CommAbortedError)
_EMPTY_SHAPES: opinfo.Shapes = ((), (), (), ())


# -- entries ---------------------------------------------------------------------------------------
class _SplitRecord:
    """Stands in for an ``OpRecord`` for a split (observers see splits only via ``comm_split``)."""

    __slots__ = ("name", "op_id", "started_ns", "time_completed_ns", "time_created_ns", "timeout")

    error = None
    state = "completed"

    def __init__(self, op_id: int, timeout: Any) -> None:
        self.name = OpName.split
        self.op_id = op_id
        self.timeout = timeout
        now = time.time_ns()
        self.time_created_ns = self.started_ns = self.time_completed_ns = now


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _python_frames() -> list[dict[str, Any]]:
    """The issuing Python stack, innermost first, without torchcomms' own frames."""
    frames: list[dict[str, Any]] = []
    f: Any = sys._getframe(1)
    while f is not None and len(frames) < 32:
        code = f.f_code
        if not code.co_filename.startswith(_PACKAGE_DIR):
            frames.append({"name": code.co_name, "filename": code.co_filename, "line": f.f_lineno})
        f = f.f_back
    return frames


class _SeqState:
    __slots__ = ("coll", "meta", "p2p")

    def __init__(self, meta: CommMeta) -> None:
        self.meta = meta
        self.coll = 0
        self.p2p = 0


_NO_FRAMES: list[Any] = []
# Keyed by the enum's raw value: hashing an Enum member runs Python code (hot path).
_P2P_VALUES = frozenset(n._value_ for n in opinfo.P2P_OPS)
_SHAPES_BY_VALUE = {n._value_: fn for n, fn in opinfo.SHAPES.items()}
_current_thread = threading.current_thread
_ONE_TENSOR = frozenset(n._value_ for n in opinfo.ONE_TENSOR_OPS)


# -- the ring buffer (the observer attached to communicators) -------------------------------------
def _nobody() -> None:
    return None


class _Ring:
    """A bounded buffer of entries; it is the ``OpObserver`` attached to each communicator."""

    def __init__(self, max_entries: int, is_global: bool) -> None:
        self.max_entries = max_entries
        self.is_global = is_global
        self.buf: deque[Entry] = deque(maxlen=max_entries)
        self.ids = itertools.count()
        self.seqs: weakref.WeakKeyDictionary[TorchComm, _SeqState] = weakref.WeakKeyDictionary()
        # The last comm seen, weakly: a recorder must not keep a comm dropped without
        # ``finalize`` (its threads and sockets) alive.
        self.last_comm: Callable[[], TorchComm | None] = _nobody
        self.last_seq: _SeqState | None = None
        self.regs: weakref.WeakKeyDictionary[TorchComm, list[RemovableHandle]] = (
            weakref.WeakKeyDictionary()
        )
        self.default_comms: weakref.WeakSet[TorchComm] = weakref.WeakSet()
        self.stack = config.fr_stack()

    # hot path -----------------------------------------------------------------------------------
    def _seq(self, comm: TorchComm) -> _SeqState:
        st = self.seqs.get(comm)
        if st is None:
            st = self.seqs[comm] = _SeqState(comm_meta(comm))
        self.last_comm = weakref.ref(comm)
        self.last_seq = st
        return st

    def op_scheduled(self, record: OpRecord) -> None:
        comm = record.comm
        st = self.last_seq if self.last_comm() is comm else self._seq(comm)
        assert st is not None
        value = record.name._value_
        args = record.args
        if value in _P2P_VALUES:
            st.p2p += 1
            peer = getattr(args, "peer", -1)
        else:
            st.coll += 1
            peer = -1
        if value in _ONE_TENSOR:  # the common case, inlined: no helper calls
            t = args.tensor
            shapes: Any = t.shape
            dtype = t.dtype
        else:
            dtype = None
            fn = _SHAPES_BY_VALUE.get(value)
            try:
                shapes = fn(args) if fn is not None else _EMPTY_SHAPES
            except Exception:
                shapes = _EMPTY_SHAPES
        self._append(record, st, shapes, dtype, peer)

    def op_sync(
        self,
        comm: TorchComm,
        name: OpName,
        op_id: int,
        tensor: Any,
        peer: int,
        timeout: Any,
    ) -> SyncRecord:
        """``op_scheduled`` for a sync op on the fast lane (``oprecord.LaneObserver``)."""
        st = self.last_seq if self.last_comm() is comm else self._seq(comm)
        assert st is not None
        if peer >= 0:
            st.p2p += 1
        else:
            st.coll += 1
        record = SyncRecord(name, op_id, timeout)
        if tensor is None:
            self._append(record, st, _EMPTY_SHAPES, None, peer)
        elif type(tensor) is tuple:  # (input, output): the shapes as ``op_scheduled`` has them
            i, o = tensor
            self._append(record, st, ((i.shape,), (i.dtype,), (o.shape,), (o.dtype,)), None, peer)
        else:
            self._append(record, st, tensor.shape, tensor.dtype, peer)
        return record

    def _append(self, record: Any, st: _SeqState, shapes: Any, dtype: Any, peer: int) -> None:
        """The one place an ``Entry`` is built (``_fr_dump.entry_to_dict`` reads it)."""
        self.buf.append(
            (
                record,
                next(self.ids),
                st.meta,
                st.coll,
                st.p2p,
                shapes,
                dtype,
                peer,
                _current_thread(),
                _python_frames() if self.stack else _NO_FRAMES,
            )
        )

    def op_finished(self, record: OpRecord) -> None:
        error = record.error
        if error is not None and isinstance(error, _AUTO_DUMP_ERRORS):
            auto_dump(self, error, record.comm)

    def comm_split(
        self, parent: TorchComm, child: TorchComm, members: list[int], op_id: int
    ) -> None:
        """A split is the child's first collective: every member records it, nobody else."""
        comm_meta(child, parent, members)
        self.register(child, default=parent in self.default_comms)
        st = self._seq(child)
        st.coll += 1
        self._append(_SplitRecord(op_id, child.get_options().timeout), st, _EMPTY_SHAPES, None, -1)

    # registration --------------------------------------------------------------------------------
    def register(self, comm: TorchComm, default: bool = False) -> None:
        if default:
            self.default_comms.add(comm)
        comm_meta(comm)
        comm._add_observer(self)
        if comm in self.regs:
            return
        ref = weakref.ref(comm)

        def on_abort() -> None:
            c = ref()
            if c is not None:
                auto_dump(self, None, c)

        self.regs[comm] = [comm.register_abort_hook(on_abort)]

    def unregister(self, comm: TorchComm) -> None:
        if self.is_global and comm in self.default_comms:
            return
        comm._remove_observer(self)
        for handle in self.regs.pop(comm, []):
            handle.remove()

    # dumping -------------------------------------------------------------------------------------
    def snapshot(self) -> list[Entry]:
        for _ in range(10):
            try:
                return list(self.buf)
            except RuntimeError:  # mutated while copying: retry
                continue
        return []

    def reset(self) -> None:
        # record_id restarts too: fr_trace aligns ranks' dumps by record_id.
        self.buf.clear()
        self.ids = itertools.count()

    def dump_dict(self, include_completed: bool = True, reason: str = "") -> dict[str, Any]:
        entries = [entry_to_dict(e) for e in self.snapshot()]
        if not include_completed:
            entries = [d for d in entries if d["state"] != "completed"]
        metas: dict[str, CommMeta] = {}
        for comm in list(self.seqs.keys()) + list(self.regs.keys()):
            meta = find_meta(comm)
            if meta is not None:
                metas.setdefault(meta.name, meta)
        for e in self.snapshot():  # entries of communicators that are gone
            metas.setdefault(e[2].name, e[2])
        return dump_document(entries, metas, reason)


def write_dump(ring: _Ring, rank: int, include_completed: bool = True, reason: str = "") -> str:
    """Pickle ``ring`` to ``<prefix><rank>`` (atomically) and return the path."""
    return write_dump_file(ring.dump_dict(include_completed, reason), rank)


def auto_dump(ring: _Ring, error: BaseException | None, comm: TorchComm) -> str | None:
    """Dump on a failure (once per error) and name the file in the error's message."""
    if not config.fr_auto_dump():
        return None
    if error is not None:
        done = getattr(error, "_torchcomms_fr_dump", None)
        if done is not None:
            return str(done)
    meta = comm_meta(comm)
    reason = "abort" if error is None else f"{type(error).__name__}: {error}"
    try:
        path = write_dump(ring, meta.global_rank, True, reason)
    except Exception:
        logger.exception("torchcomms: flight recorder dump failed")
        return None
    logger.warning(
        "torchcomms: flight recorder dumped %d entries to %s (%s)",
        len(ring.buf),
        path,
        reason.split("\n", 1)[0],
        extra={"comm": meta.name, "rank": meta.rank, "fr_dump": path},
    )
    if error is not None:
        with contextlib.suppress(Exception):
            error._torchcomms_fr_dump = path  # type: ignore[attr-defined]
            if error.args and isinstance(error.args[0], str):
                error.args = (f"{error.args[0]} [{DUMP_MARK}{path}]", *error.args[1:])
    return path


# -- the process-wide recorder ---------------------------------------------------------------------
_global_ring: _Ring | None = None
_global_lock = threading.Lock()


def global_ring(max_entries: int = config.FR_DEFAULT_BUFFER_SIZE) -> _Ring:
    """The shared buffer of non-isolated recorders (grown to the largest size asked for)."""
    global _global_ring
    with _global_lock:
        ring = _global_ring
        if ring is None:
            ring = _global_ring = _Ring(max_entries, is_global=True)
        elif max_entries > ring.max_entries:
            ring.max_entries = max_entries
            ring.buf = deque(ring.buf, maxlen=max_entries)
    install_signal_handler()
    return ring


def _default_recorder(comm: TorchComm) -> Any:
    size = config.fr_buffer_size()
    if size <= 0:
        return None
    ring = global_ring(size)
    ring.register(comm, default=True)
    return ring


add_default_observer(_default_recorder)


# -- SIGUSR1 ---------------------------------------------------------------------------------------
def _signal_dump() -> None:
    ring = _global_ring
    if ring is None:
        return
    try:
        path = write_dump(ring, process_global_rank(), True, "SIGUSR1")
        logger.warning("torchcomms: flight recorder dumped to %s on SIGUSR1", path)
    except Exception:
        logger.exception("torchcomms: flight recorder SIGUSR1 dump failed")


def install_signal_handler() -> bool:
    """Dump the process-wide recorder on SIGUSR1 (``_fr_signal``; ``config.fr_dump_on_signal``)."""
    return _fr_signal.install(_signal_dump)


# -- the public hook -------------------------------------------------------------------------------
class FlightRecorderHook:
    """Records every op of the communicators it is registered with (see the module docstring)."""

    def __init__(self, max_entries: int = 2048, isolated: bool = False) -> None:
        if not isinstance(max_entries, int) or isinstance(max_entries, bool):
            raise TypeError(f"max_entries must be an int, got {type(max_entries).__name__}")
        self._max_entries = max_entries
        self._isolated = bool(isolated)
        self._ring: _Ring | None = None
        if max_entries > 0:
            self._ring = _Ring(max_entries, False) if isolated else global_ring(max_entries)
        self._comms: weakref.WeakSet[TorchComm] = weakref.WeakSet()
        self._registered = False
        self._epoch_start = 0

    def register_with_comm(self, comm: TorchComm) -> None:
        """Record ``comm``'s ops (and those of communicators split from it from now on)."""
        if not isinstance(comm, TorchComm):
            raise TypeError(f"register_with_comm expects a TorchComm, got {type(comm).__name__}")
        self._registered = True
        if self._ring is None:
            return
        self._ring.register(comm)
        self._comms.add(comm)

    def unregister(self) -> None:
        """Stop recording the communicators registered through this hook (entries stay)."""
        ring = self._ring
        if ring is not None:
            for comm in list(self._comms):
                ring.unregister(comm)
                for child in _descendants(ring, comm):
                    ring.unregister(child)
        self._comms = weakref.WeakSet()
        self._registered = False

    def is_enabled(self) -> bool:
        return self._registered and self._ring is not None

    def size(self) -> int:
        """Entries recorded since the last ``reset()`` (at most ``max_entries``)."""
        return 0 if self._ring is None else len(self._ring.buf)

    def __len__(self) -> int:
        return self.size()

    def reset(self) -> None:
        """Drop every entry (of the shared buffer, for a non-isolated recorder)."""
        if self._ring is not None:
            self._ring.reset()

    def dump_json(self, include_completed: bool = True) -> str:
        if self._ring is None:
            return json.dumps(_Ring(1, False).dump_dict(include_completed))
        return json.dumps(self._ring.dump_dict(include_completed))

    def dump_file(self, rank: int, include_completed: bool = True) -> str:
        """Pickle (0600) to ``dump_path(rank)`` (fr_trace's format); returns the path."""
        ring = self._ring if self._ring is not None else _Ring(1, False)
        return write_dump(ring, int(rank), include_completed, "dump_file")

    def __repr__(self) -> str:
        kind = "isolated" if self._isolated else "shared"
        return f"FlightRecorderHook(max_entries={self._max_entries}, {kind}, size={self.size()})"


def _descendants(ring: _Ring, comm: TorchComm) -> list[TorchComm]:
    meta = find_meta(comm)
    if meta is None:
        return []
    prefix = f"split:{meta.name}"
    out = []
    for child in list(ring.regs.keys()):
        cmeta = find_meta(child)
        if cmeta is not None and cmeta.desc == prefix and child is not comm:
            out.append(child)
            out.extend(_descendants(ring, child))
    return out
