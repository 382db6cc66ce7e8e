"""``FlightRecorderHook``: a ring buffer of recent ops in PyTorch's flight-recorder format (v2.10).

Every entry has PyTorch's fields (``record_id``, ``pg_id``, ``process_group``,
``collective_seq_id``, ``p2p_seq_id``, ``op_id``, ``profiling_name``, sizes, dtypes,
``state``, discovered start/completion times, ``duration_ms``, ``retired``, ``timeout_ms``,
``is_p2p``, ``frames``, ``thread_id``, ``thread_name``) plus ``error`` for failed ops.
States are real: an entry is ``scheduled`` until its op runs, ``started`` while it runs,
``completed`` when it finished (with ``error`` set if it failed).

Dumps: ``dump_json()`` returns JSON; ``dump_file(rank)`` writes a pickle to
``<TORCHCOMM_FR_DUMP_TEMP_FILE><rank>``, the per-rank file layout that the unmodified
``python -m torch.distributed.flight_recorder.fr_trace DIR`` reads.

Always on: ``import torchcomms`` installs a process-wide recorder (``TORCHCOMM_FR_BUFFER_SIZE``
entries, default 2000; ``0`` turns it off for communicators created while it is 0).  On a
timeout, peer failure or abort it dumps to ``<prefix><global rank>`` and appends
``[flight recorder dump: PATH]`` to the error's message.  ``SIGUSR1`` also dumps, when
nothing else handles that signal (``faulthandler.register(SIGUSR1)`` or a native handler
is left alone; ``TORCHCOMM_FR_DUMP_ON_SIGUSR1=1`` takes the signal anyway, still calling a
Python-level previous handler, ``=0`` never takes it).

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
import pickle
import signal
import socket
import sys
import threading
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any

from torchcomms import config
from torchcomms.comm import RemovableHandle, TorchComm, add_default_observer
from torchcomms.errors import CommAbortedError, CommTimeoutError, PeerFailureError
from torchcomms.hooks import _opinfo
from torchcomms.oprecord import OpRecord
from torchcomms.types import OpName

if TYPE_CHECKING:
    from collections.abc import Iterable

logger = logging.getLogger("torchcomms.hooks.fr")

FR_VERSION = "2.10"
DUMP_MARK = "flight recorder dump: "

_AUTO_DUMP_ERRORS = (CommTimeoutError, PeerFailureError, CommAbortedError)
_EMPTY_SHAPES: _opinfo.Shapes = ((), (), (), ())

# PyTorch's analyzer only knows these op names; ours map onto them.
_PROFILING_OP = {name: name.name for name in OpName}
_PROFILING_OP[OpName.gather_single] = "gather"
_PROFILING_OP[OpName.batch_op_issue] = "coalesced"


# -- per-communicator metadata (shared by every recorder) -----------------------------------------
class CommMeta:
    """How a communicator appears in dumps: name, description, global ranks, pg_id."""

    __slots__ = ("__weakref__", "backend", "desc", "name", "pg_id", "rank", "ranks")

    def __init__(
        self, name: str, desc: str, ranks: list[int], pg_id: int, backend: str, rank: int
    ) -> None:
        self.name = name
        self.desc = desc
        self.ranks = ranks
        self.pg_id = pg_id
        self.backend = backend
        self.rank = rank  # this process's rank in the communicator

    @property
    def global_rank(self) -> int:
        return self.ranks[self.rank] if 0 <= self.rank < len(self.ranks) else self.rank


_metas: weakref.WeakKeyDictionary[TorchComm, CommMeta] = weakref.WeakKeyDictionary()
_pg_ids = itertools.count()
_meta_lock = threading.Lock()


def comm_meta(
    comm: TorchComm, parent: TorchComm | None = None, members: list[int] | None = None
) -> CommMeta:
    """The metadata of ``comm``, created on first sight (a split child maps through its parent)."""
    meta = _metas.get(comm)
    if meta is not None:
        return meta
    with _meta_lock:
        meta = _metas.get(comm)
        if meta is not None:
            return meta
        try:
            rank, size = comm.get_rank(), comm.get_size()
        except Exception:
            rank, size = -1, 0
        if parent is not None and members is not None:
            pmeta = comm_meta(parent)
            ranks = [pmeta.ranks[r] if r < len(pmeta.ranks) else r for r in members]
            desc = f"split:{pmeta.name}"
        else:
            ranks = list(range(size))
            desc = "default_pg"
        meta = CommMeta(comm._safe_name(), desc, ranks, next(_pg_ids), comm.get_backend(), rank)
        _metas[comm] = meta
        return meta


def process_global_rank() -> int:
    """This process's rank in the job: ``RANK``/``TORCHCOMM_RANK`` else the first comm's rank."""
    for var in ("RANK", "TORCHCOMM_RANK"):
        value = config.env_int(var)
        if value is not None:
            return value
    for meta in list(_metas.values()):
        return meta.global_rank
    return 0


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


# An entry is a plain tuple (cheapest to build on the hot path):
# (record, record_id, meta, collective_seq_id, p2p_seq_id, shapes, dtype, peer, thread, frames)
# where a one-tensor op (in place, or p2p) stores its torch.Size in ``shapes`` and its dtype in
# ``dtype``, and every other op stores ``_opinfo.Shapes`` with ``dtype`` None (fewer objects).
Entry = tuple[Any, int, CommMeta, int, int, Any, Any, int, threading.Thread, list[Any]]


def entry_to_dict(entry: Entry) -> dict[str, Any]:
    """One entry in PyTorch's flight-recorder format (plus ``error``)."""
    record, record_id, meta, coll_seq, p2p_seq, shapes, dtype, peer, thread, frames = entry
    name = record.name
    state = record.state
    created = record.time_created_ns
    started = record.started_ns
    completed = record.time_completed_ns
    error = record.error
    if started is None and completed is not None:
        # Finished without a known start (an async op the backend completed inline).
        started = created
    op = _PROFILING_OP.get(name, name.name)
    if name is OpName.send:
        op = f"send {meta.rank}->{peer}"
    elif name is OpName.recv:
        op = f"recv {meta.rank}<-{peer}"
    if dtype is not None:
        ins = outs = (shapes,)
        ind = outd = (dtype,)
    else:
        ins, ind, outs, outd = shapes
    d: dict[str, Any] = {
        "record_id": record_id,
        "pg_id": meta.pg_id,
        "process_group": [meta.name, meta.desc],
        "collective_seq_id": coll_seq,
        "p2p_seq_id": p2p_seq,
        "op_id": record.op_id,
        "profiling_name": f"{meta.backend}:{op}",
        "time_created_ns": created,
        "input_sizes": [list(s) for s in ins],
        "input_dtypes": [_opinfo.c10_dtype_name(x) for x in ind],
        "output_sizes": [list(s) for s in outs],
        "output_dtypes": [_opinfo.c10_dtype_name(x) for x in outd],
        "state": state,
        "time_discovered_started_ns": started,
        "time_discovered_completed_ns": completed,
        "retired": completed is not None,
        "timeout_ms": int(record.timeout.total_seconds() * 1000),
        "is_p2p": name in _opinfo.P2P_OPS,
        "frames": frames,
        "thread_id": str(thread.ident),
        "thread_name": thread.name,
        "error": None if error is None else f"{type(error).__name__}: {error}",
    }
    if completed is not None and started is not None:
        d["duration_ms"] = max(completed - started, 0) / 1e6
    return d


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
_P2P_VALUES = frozenset(n._value_ for n in _opinfo.P2P_OPS)
_SHAPES_BY_VALUE = {n._value_: fn for n, fn in _opinfo.SHAPES.items()}
_current_thread = threading.current_thread
_ONE_TENSOR = frozenset(
    n._value_
    for n in (OpName.all_reduce, OpName.broadcast, OpName.reduce, OpName.send, OpName.recv)
)


# -- the ring buffer (the observer attached to communicators) -------------------------------------
class _Ring:
    """A bounded buffer of entries; it is the ``OpObserver`` attached to each communicator."""

    def __init__(self, max_entries: int, is_global: bool) -> None:
        self.max_entries = max_entries
        self.is_global = is_global
        self.buf: deque[Entry] = deque(maxlen=max_entries)
        self.ids = itertools.count()
        self.seqs: weakref.WeakKeyDictionary[TorchComm, _SeqState] = weakref.WeakKeyDictionary()
        self.last_comm: Any = None
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
        self.last_comm = comm
        self.last_seq = st
        return st

    def op_scheduled(self, record: OpRecord) -> None:
        comm = record.comm
        st = self.last_seq if comm is self.last_comm else self._seq(comm)
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
        record = _SplitRecord(op_id, child.get_options().timeout)
        self.buf.append(
            (
                record,
                next(self.ids),
                st.meta,
                st.coll,
                st.p2p,
                _EMPTY_SHAPES,
                None,
                -1,
                _current_thread(),
                _python_frames() if self.stack else _NO_FRAMES,
            )
        )

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
            meta = _metas.get(comm)
            if meta is not None:
                metas.setdefault(meta.name, meta)
        for e in self.snapshot():  # entries of communicators that are gone
            metas.setdefault(e[2].name, e[2])
        pg_config = {
            name: {"name": name, "desc": m.desc, "ranks": str(m.ranks)} for name, m in metas.items()
        }
        pg_status = {name: _pg_status(name, entries) for name in metas}
        return {
            "version": FR_VERSION,
            "comm_lib_version": "torchcomms",
            "pg_config": pg_config,
            "pg_status": pg_status,
            "entries": entries,
            "torchcomms": {
                "rank": process_global_rank(),
                "hostname": socket.gethostname(),
                "pid": os.getpid(),
                "dump_time_ns": time.time_ns(),
                "reason": reason,
            },
        }


def _pg_status(name: str, entries: Iterable[dict[str, Any]]) -> dict[str, int]:
    enqueued = started = completed = -1
    for d in entries:
        if d["process_group"][0] != name or d["is_p2p"]:
            continue
        seq = d["collective_seq_id"]
        enqueued = max(enqueued, seq)
        if d["state"] != "scheduled":
            started = max(started, seq)
        if d["state"] == "completed":
            completed = max(completed, seq)
    return {
        "last_enqueued_collective": enqueued,
        "last_started_collective": started,
        "last_completed_collective": completed,
    }


def dump_path(rank: int) -> str:
    return f"{config.fr_dump_prefix()}{rank}"


def write_dump(ring: _Ring, rank: int, include_completed: bool = True, reason: str = "") -> str:
    """Pickle ``ring`` to ``<prefix><rank>`` (atomically) and return the path."""
    path = dump_path(rank)
    data = ring.dump_dict(include_completed, reason)
    data["torchcomms"]["rank"] = rank
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}.{threading.get_ident()}"
    with open(tmp, "wb") as f:
        pickle.dump(data, f)
    os.replace(tmp, path)
    return path


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
_signal_installed = False


def _signal_dump() -> None:
    ring = _global_ring
    if ring is None:
        return
    try:
        path = write_dump(ring, process_global_rank(), True, "SIGUSR1")
        logger.warning("torchcomms: flight recorder dumped to %s on SIGUSR1", path)
    except Exception:
        logger.exception("torchcomms: flight recorder SIGUSR1 dump failed")


def _handler_is_default(signum: int) -> bool:
    """Whether the OS-level disposition of ``signum`` is SIG_DFL (no handler of any kind).

    ``signal.getsignal`` cannot see handlers installed outside Python's ``signal`` module
    (``faulthandler.register``, native libraries), so ask the kernel through ``sigaction``.
    Anything unexpected counts as "not default".
    """
    if signal.getsignal(signum) not in (signal.SIG_DFL, None):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        old = ctypes.create_string_buffer(512)  # larger than any platform's struct sigaction
        if libc.sigaction(signum, None, old) != 0:
            return False
        # The first member of struct sigaction is the handler; SIG_DFL is 0.
        return not ctypes.c_void_p.from_buffer(old).value
    except Exception:
        return False


def install_signal_handler() -> bool:
    """Dump the process-wide recorder on SIGUSR1 (see ``config.fr_dump_on_signal``).

    The dump is written by a watcher thread woken through ``signal.set_wakeup_fd``, so it
    happens within milliseconds even while the main thread is blocked inside a collective.
    """
    global _signal_installed
    wanted = config.fr_dump_on_signal()
    if _signal_installed or wanted is False:
        return False
    if threading.current_thread() is not threading.main_thread():
        return False
    if wanted is None and not _handler_is_default(signal.SIGUSR1):
        return False  # auto: leave an existing handler (e.g. faulthandler's) alone
    previous = signal.getsignal(signal.SIGUSR1)
    r, w = os.pipe()
    os.set_blocking(w, False)
    old_fd = -1
    try:
        old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except (ValueError, OSError):
        old_fd = -2
    watcher = old_fd == -1
    if not watcher:  # someone (asyncio) owns the wakeup fd: leave it, dump from the handler
        if old_fd >= 0:
            signal.set_wakeup_fd(old_fd)
        os.close(r)
        os.close(w)

    def handler(signum: int, frame: Any) -> None:
        if not watcher:
            _signal_dump()
        if callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGUSR1, handler)
    if watcher:

        def watch() -> None:
            while True:
                try:
                    data = os.read(r, 64)
                except OSError:
                    return
                if not data:
                    return
                if signal.SIGUSR1 in data:
                    _signal_dump()

        threading.Thread(target=watch, name="torchcomms-fr-signal", daemon=True).start()
    _signal_installed = True
    return True


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
        """Pickle to ``<TORCHCOMM_FR_DUMP_TEMP_FILE><rank>`` (fr_trace's format); returns the path."""
        ring = self._ring if self._ring is not None else _Ring(1, False)
        return write_dump(ring, int(rank), include_completed, "dump_file")

    def __repr__(self) -> str:
        kind = "isolated" if self._isolated else "shared"
        return f"FlightRecorderHook(max_entries={self._max_entries}, {kind}, size={self.size()})"


def _descendants(ring: _Ring, comm: TorchComm) -> list[TorchComm]:
    meta = _metas.get(comm)
    if meta is None:
        return []
    prefix = f"split:{meta.name}"
    out = []
    for child in list(ring.regs.keys()):
        cmeta = _metas.get(child)
        if cmeta is not None and cmeta.desc == prefix and child is not comm:
            out.append(child)
            out.extend(_descendants(ring, child))
    return out
