"""A peer process for ``tests/test_rdma_transport.py``: one end of an ``RdmaTransport``.

Run as ``python -m tests.rdma_peer ROLE`` (also inside a network namespace).  It speaks JSON
lines: it prints ``{"url": ..., "buffers": {name: pickled RdmaRemoteBuffer (hex)}}`` once
set up, then reads commands from stdin, one JSON object a line, and answers each with one
JSON line.  Roles:

* ``owner``: registers ``pattern`` (``OWNER_BYTES`` of a known pattern) and ``inbox``
  (zeros, with guard bytes either side that must never change); commands ``connect``
  (the reader's URL), ``check_inbox`` (which bytes of the inbox changed, and whether the
  guards held), ``drop`` (deregister ``pattern``), ``quit``;
* ``client``: commands ``connect`` (the owner's URL), ``read`` / ``write`` (a buffer of the
  owner's, a size; a write sends the pattern), ``quit``.  Each answer says what was raised
  (type and text) or, for a read, whether the bytes were the pattern.
"""

from __future__ import annotations

import json
import pickle
import sys
from typing import Any

import torch

from torchcomms._transport import RdmaMemory, RdmaRemoteBuffer, RdmaTransport

OWNER_BYTES = 256 << 20
GUARD = 4096


def pattern(nbytes: int) -> torch.Tensor:
    """Bytes that differ from zero everywhere and from the same bytes shifted."""
    period = torch.arange(1, 252, dtype=torch.uint8)  # 251 is prime: no power-of-two period
    return period.repeat(nbytes // 251 + 1)[:nbytes].clone()


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _outcome(call: Any, *args: Any) -> dict[str, Any]:
    try:
        return {"ok": call(*args)}
    except Exception as exc:
        return {"error": type(exc).__name__, "text": str(exc)}


def owner() -> None:
    transport = RdmaTransport(torch.device("cpu"))
    data = pattern(OWNER_BYTES)
    space = torch.zeros(OWNER_BYTES + 2 * GUARD, dtype=torch.uint8)
    space[:GUARD] = 7
    space[-GUARD:] = 7
    inbox = space[GUARD:-GUARD]
    memories = {"pattern": RdmaMemory(data), "inbox": RdmaMemory(inbox)}
    buffers = {k: pickle.dumps(m.to_remote_buffer()).hex() for k, m in memories.items()}
    _say({"url": transport.bind().decode(), "buffers": buffers})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "connect":
            _say(_outcome(transport.connect, cmd["url"].encode()))
        elif cmd["op"] == "check_inbox":
            changed = (inbox != 0).nonzero()
            _say(
                {
                    "changed": int(changed.numel()),
                    "first": int(changed[0]) if changed.numel() else -1,
                    "last": int(changed[-1]) if changed.numel() else -1,
                    "as_sent": bool(torch.equal(inbox[: changed.numel()], data[: changed.numel()])),
                    "guards_held": bool((space[:GUARD] == 7).all() and (space[-GUARD:] == 7).all()),
                }
            )
        elif cmd["op"] == "drop":
            memories.pop("pattern")
            _say({"ok": 0})
        elif cmd["op"] == "quit":
            transport.close()
            return


def client() -> None:
    transport = RdmaTransport(torch.device("cpu"))
    _say({"url": transport.bind().decode(), "buffers": {}})
    src = pattern(OWNER_BYTES)
    mine = RdmaMemory(src)
    dst = torch.zeros(OWNER_BYTES, dtype=torch.uint8)
    into = RdmaMemory(dst)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "connect":
            res = _outcome(transport.connect, cmd["url"].encode())
            _say({**res, "path": transport.path})
        elif cmd["op"] in ("read", "write"):
            remote: RdmaRemoteBuffer = pickle.loads(bytes.fromhex(cmd["buffer"]))
            n = cmd["nbytes"]
            dst.zero_()
            if cmd["op"] == "read":
                res = _outcome(transport.read, into.to_mutable_view(length=n), remote)
                res["as_pattern"] = bool(torch.equal(dst[:n], src[:n]))
            else:
                res = _outcome(transport.write, mine.to_view(length=n), remote)
            _say(res)
        elif cmd["op"] == "quit":
            transport.close()
            return


if __name__ == "__main__":
    {"owner": owner, "client": client}[sys.argv[1]]()
