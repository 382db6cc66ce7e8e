"""``TORCHCOMM_LOG_JSON=path``: a JSON-lines log of every op, one line when it finishes.

Each line: ``{"ts": <unix s>, "event": "op", "comm", "backend", "rank", "size", "op",
"op_id", "seq", "async_op", "bytes", "duration_ms", "queued_ms", "state", "error"}``
(``seq`` counts this communicator's ops of the same kind: collectives, or point-to-point;
``bytes`` is the payload this rank contributes: its input tensors, or for receives its
outputs; ``error`` is ``null`` or ``"<ErrorType>: <message>"``).  A
``{"event": "new_comm", ...}`` line is written when a communicator is created.

The variable is read at each ``new_comm``; communicators created while it is unset are
not logged.  Ranks may share one file (lines are appended whole) or use one each
(``TORCHCOMM_LOG_JSON=/tmp/ops.$RANK.jsonl`` in a shell launcher).

Threads: ``op_scheduled`` runs on the thread issuing the op, ``op_finished`` on whichever
thread finished it (the issuing thread, the comm's executor thread for async ops, or the
thread in ``wait()``; see ``torchcomms.runtime.oprecord``); each line is written whole under one
lock per file.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import IO, Any

from torchcomms import config
from torchcomms.comm import TorchComm, add_default_observer
from torchcomms.optable import OpName
from torchcomms.runtime import opinfo
from torchcomms.runtime.oprecord import OpRecord

_P2P = opinfo.P2P_OPS


def _nbytes(name: OpName, args: Any) -> int:
    ins, outs = opinfo.inputs_outputs(name, args)
    tensors = ins or outs
    return sum(int(t.numel()) * t.element_size() for t in tensors if hasattr(t, "numel"))


class JsonEventLog:
    """The observer that writes one file; shared by every communicator logging to that path."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        directory = os.path.dirname(path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        self._file: IO[str] = open(path, "a", buffering=1)  # noqa: SIM115
        self._pending: dict[int, tuple[int, int]] = {}
        self._seqs: dict[int, list[int]] = {}

    def write(self, obj: dict[str, Any]) -> None:
        line = json.dumps(obj, separators=(",", ":"))
        with self._lock:
            self._file.write(line + "\n")

    def comm_created(self, comm: TorchComm) -> None:
        self.write(
            {
                "ts": time.time(),
                "event": "new_comm",
                "comm": comm._safe_name(),
                "backend": comm.get_backend(),
                "rank": comm.get_rank(),
                "size": comm.get_size(),
                "pid": os.getpid(),
            }
        )

    def op_scheduled(self, record: OpRecord) -> None:
        seqs = self._seqs.get(id(record.comm))
        if seqs is None:
            seqs = self._seqs[id(record.comm)] = [0, 0]
        kind = 1 if record.name in _P2P else 0
        seqs[kind] += 1
        try:
            nbytes = _nbytes(record.name, record.args)
        except Exception:
            nbytes = 0
        self._pending[record.op_id] = (seqs[kind], nbytes)

    def op_finished(self, record: OpRecord) -> None:
        seq, nbytes = self._pending.pop(record.op_id, (0, 0))
        comm = record.comm
        completed = record.time_completed_ns or time.time_ns()
        started = record.started_ns
        error = record.error
        self.write(
            {
                "ts": completed / 1e9,
                "event": "op",
                "comm": comm._safe_name(),
                "backend": comm.get_backend(),
                "rank": comm.get_rank(),
                "size": comm.get_size(),
                "op": record.name.name,
                "op_id": record.op_id,
                "seq": seq,
                "async_op": record.async_op,
                "bytes": nbytes,
                "duration_ms": None if started is None else max(completed - started, 0) / 1e6,
                "queued_ms": None
                if started is None
                else max(started - record.time_created_ns, 0) / 1e6,
                "state": "failed" if error is not None else "completed",
                "error": None if error is None else f"{type(error).__name__}: {error}",
            }
        )


_logs: dict[str, JsonEventLog] = {}
_logs_lock = threading.Lock()


def _factory(comm: TorchComm) -> JsonEventLog | None:
    path = config.log_json_path()
    if not path:
        return None
    with _logs_lock:
        log = _logs.get(path)
        if log is None:
            log = _logs[path] = JsonEventLog(path)
    log.comm_created(comm)
    return log


def install() -> None:
    """Attach to every communicator ``new_comm`` creates (``torchcomms.hooks`` calls this)."""
    add_default_observer(_factory)
