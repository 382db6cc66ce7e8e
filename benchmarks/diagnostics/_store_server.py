"""A TCPStore served by a forked process of its own, for diagnostics whose ranks may die.

``served_store()`` forks the server before the caller forks any rank (the parent starts
no thread), yields its port on 127.0.0.1, and stops it on exit.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist


def _serve(port: int, ready: Any, stop: Any) -> None:
    store = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)
    ready.put(1)
    stop.get()
    del store
    os._exit(0)


@contextlib.contextmanager
def served_store() -> Iterator[int]:
    ctx = mp.get_context("fork")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    ready, stop = ctx.SimpleQueue(), ctx.SimpleQueue()
    server = ctx.Process(target=_serve, args=(port, ready, stop))
    server.start()
    ready.get()
    try:
        yield port
    finally:
        stop.put(1)
        server.join(10)
