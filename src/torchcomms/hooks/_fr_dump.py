"""The flight recorder's dump format and files: PyTorch's flight-recorder layout (v2.10).

What ``torchcomms.hooks.fr`` (the recorder) hands over to be written out:

* ``CommMeta``: how a communicator appears in dumps (name, description, global ranks,
  ``pg_id``), created on first sight and shared by every recorder;
* ``Entry``: the tuple the recorder keeps per op, and ``entry_to_dict``, its dump form;
* ``dump_document``: the whole dump (``pg_config``, ``pg_status``, ``entries`` and a
  ``torchcomms`` section; ``comm_lib_version`` is ``FORMAT_MARK``), and ``write_dump_file``:
  an atomic pickle, mode 0600, to ``<TORCHCOMM_FR_DUMP_TEMP_FILE><rank>`` or, by default, to
  ``<tempdir>/torchcomm_fr-<uid>/rank_<rank>`` in a directory of this user's alone (0700),
  the per-rank layout the unmodified
  ``python -m torch.distributed.flight_recorder.fr_trace DIR`` reads.

Threads: ``comm_meta`` may run on any thread (first sight of a communicator: its
registration, first recorded op or split) and creates each ``CommMeta`` under a lock;
everything else runs on whichever thread dumps (a caller of ``dump_json``/``dump_file``,
the thread that finished a failed op, an aborting thread, or the SIGUSR1 watcher thread)
and only reads what it is given.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import pickle
import socket
import stat
import tempfile
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torchcomms import config
from torchcomms.comm import TorchComm
from torchcomms.optable import OpName
from torchcomms.runtime import opinfo

FR_VERSION = "2.10"
#: ``comm_lib_version`` of every dump: how ``python -m torchcomms.tools.fr`` knows its own.
FORMAT_MARK = "torchcomms"
DUMP_MARK = "flight recorder dump: "
_DEFAULT_FILE_PREFIX = "rank_"

logger = logging.getLogger("torchcomms.hooks.fr")

# PyTorch's analyzer only knows these op names; ours map onto them.
_PROFILING_OP = {name: name.name for name in OpName}
_PROFILING_OP[OpName.gather_single] = "gather"
_PROFILING_OP[OpName.batch_op_issue] = "coalesced"


# -- per-communicator metadata (shared by every recorder) -----------------------------------------
@dataclass(eq=False)
class CommMeta:
    """How a communicator appears in dumps: name, description, global ranks, pg_id."""

    name: str
    desc: str
    ranks: list[int]
    pg_id: int
    backend: str
    rank: int  # this process's rank in the communicator

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


def find_meta(comm: TorchComm) -> CommMeta | None:
    """The metadata of ``comm`` if it was ever recorded (never creates it)."""
    return _metas.get(comm)


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
# An entry is a plain tuple (cheapest to build on the hot path):
# (record, record_id, meta, collective_seq_id, p2p_seq_id, shapes, dtype, peer, thread, frames)
# where a one-tensor op (in place, or p2p) stores its torch.Size in ``shapes`` and its dtype in
# ``dtype``, and every other op stores ``opinfo.Shapes`` with ``dtype`` None (fewer objects).
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
        "input_dtypes": [opinfo.c10_dtype_name(x) for x in ind],
        "output_sizes": [list(s) for s in outs],
        "output_dtypes": [opinfo.c10_dtype_name(x) for x in outd],
        "state": state,
        "time_discovered_started_ns": started,
        "time_discovered_completed_ns": completed,
        "retired": completed is not None,
        "timeout_ms": int(record.timeout.total_seconds() * 1000),
        "is_p2p": name in opinfo.P2P_OPS,
        "frames": frames,
        "thread_id": str(thread.ident),
        "thread_name": thread.name,
        "error": None if error is None else f"{type(error).__name__}: {error}",
    }
    if completed is not None and started is not None:
        d["duration_ms"] = max(completed - started, 0) / 1e6
    return d


# -- the dump ---------------------------------------------------------------------------------------
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


def dump_document(
    entries: list[dict[str, Any]], metas: dict[str, CommMeta], reason: str = ""
) -> dict[str, Any]:
    """The dump of ``entries`` (``entry_to_dict`` forms) over the communicators ``metas``."""
    pg_config = {
        name: {"name": name, "desc": m.desc, "ranks": str(m.ranks)} for name, m in metas.items()
    }
    pg_status = {name: _pg_status(name, entries) for name in metas}
    return {
        "version": FR_VERSION,
        "comm_lib_version": FORMAT_MARK,
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


def default_dump_dir() -> str:
    """This user's private dump directory, used when ``TORCHCOMM_FR_DUMP_TEMP_FILE`` is unset."""
    return os.path.join(tempfile.gettempdir(), f"torchcomm_fr-{os.getuid()}")


def dump_path(rank: int) -> str:
    """``<TORCHCOMM_FR_DUMP_TEMP_FILE><rank>``, else ``<tempdir>/torchcomm_fr-<uid>/rank_<rank>``."""
    prefix = config.fr_dump_prefix()
    if prefix == config.FR_DEFAULT_DUMP_PREFIX:
        # One directory for every user (the old default) lets anyone read or plant dumps.
        return os.path.join(default_dump_dir(), f"{_DEFAULT_FILE_PREFIX}{rank}")
    return f"{prefix}{rank}"


def _private_dir(directory: str) -> None:
    """Create ``directory`` 0700, or check that the existing one is this user's alone.

    Refused (``PermissionError``): a symlink or non-directory, or a directory owned by
    another user. A directory of ours that others may read or write is tightened to 0700.
    """
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(
            f"flight recorder: refusing to dump into {directory}: not a directory (a symlink "
            "or file is in the way; remove it, or set TORCHCOMM_FR_DUMP_TEMP_FILE)"
        )
    if st.st_uid != os.getuid():
        raise PermissionError(
            f"flight recorder: refusing to dump into {directory}: owned by uid {st.st_uid}, "
            f"not by this user (uid {os.getuid()}); remove it, or set TORCHCOMM_FR_DUMP_TEMP_FILE"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        logger.warning("flight recorder: %s had mode %o; tightened to 700", directory, mode)
    if mode != 0o700:  # also a umask that took the owner's own bits away
        os.chmod(directory, 0o700)


def _make_dirs(directory: str) -> None:
    """``os.makedirs`` where every directory it creates is 0700 (``makedirs`` only does the last)."""
    missing = []
    current = os.path.abspath(directory)
    while not os.path.isdir(current):
        missing.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        os.chmod(path, 0o700)  # whatever the umask


def write_dump_file(data: dict[str, Any], rank: int) -> str:
    """Pickle ``data`` to ``dump_path(rank)``, mode 0600 (atomically: a temporary file, then a rename)."""
    path = dump_path(rank)
    data["torchcomms"]["rank"] = rank
    directory = os.path.dirname(path)
    if config.fr_dump_prefix() == config.FR_DEFAULT_DUMP_PREFIX:
        _private_dir(directory)
    elif directory:
        _make_dirs(directory)  # the user's choice of place, used as given
    tmp = f"{path}.tmp{os.getpid()}.{threading.get_ident()}"
    # O_EXCL | O_NOFOLLOW: never write through a file or symlink someone else put there.
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)  # whatever the umask
            pickle.dump(data, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path
