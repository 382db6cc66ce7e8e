"""``RdmaCheckpointTransport``: torchft's ``CheckpointTransport`` over ``torchcomms._transport``.

A healthy replica's ``send_checkpoint`` registers the state dict's tensors where they are
(``RdmaMemory``: no copy, no serialisation; a tensor that is not a contiguous CPU tensor is
copied to one first) and serves a manifest: the tree structure, each tensor's dtype, shape
and ``RdmaRemoteBuffer``, and the non-tensor leaves.  A recovering replica's
``recv_checkpoint`` asks for that manifest, connects an ``RdmaTransport`` to one the server
makes for it, and reads every tensor one-sidedly (``read_many``: one copy per byte on one
host, pipelined TCP between hosts), into fresh tensors or, given ``state_dict``, into the
replica's own tensors in place.

The manifest travels over a small control connection (a length-prefixed pickle each way,
the trust torchft's HTTP transport also gives a peer).  Like torchft's HTTP transport, a
request for a step that is not being served waits until ``send_checkpoint`` allows it, and
``disallow_checkpoint`` waits for readers in flight before the state dict may change.

Threads: the control server's thread accepts; each recovering replica gets a handler thread
for the length of its read.  ``_lock``/``_changed`` guard the served step and the readers.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import pickle
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, TypeVar

import torch
from torch.utils._pytree import tree_flatten, tree_flatten_with_path, tree_unflatten
from torchft.checkpointing.transport import CheckpointTransport

from torchcomms._transport import RdmaMemory, RdmaRemoteBuffer, RdmaTransport
from torchcomms.errors import CommTimeoutError, PeerFailureError
from torchcomms.transport import listen
from torchcomms.transport.rdma.transport import advertised_address
from torchcomms.transport.stream import recv_exact

logger = logging.getLogger("torchcomms.ft.checkpoint")

T = TypeVar("T")
_LEN = struct.Struct("<Q")
SCHEME = "torchcomms-rdma://"


@dataclass(frozen=True)
class _TensorLeaf:
    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool
    remote: RdmaRemoteBuffer | None  # None: an empty tensor


def _send(sock: socket.socket, obj: object) -> None:
    raw = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_LEN.pack(len(raw)) + raw)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    if not recv_exact(sock, memoryview(buf)):
        raise ConnectionResetError("connection closed")
    return bytes(buf)


def _recv(sock: socket.socket) -> Any:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    return pickle.loads(_recv_exact(sock, n))


def _populate(tensors: list[torch.Tensor]) -> None:
    """Fault in the pages of each tensor, in order, without changing a byte
    (``MADV_POPULATE_WRITE``, Linux 5.14+; elsewhere nothing happens): safe to run while
    another thread fills the same tensors."""
    if _MADVISE is None:
        return
    for t in tensors:
        start = (t.data_ptr() + _PAGE - 1) & ~(_PAGE - 1)
        end = (t.data_ptr() + t.nbytes) & ~(_PAGE - 1)
        if end > start and _MADVISE(start, end - start, _MADV_POPULATE_WRITE) != 0:
            return  # not supported by this kernel


def _libc_madvise() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_PAGE = 4096
_MADV_POPULATE_WRITE = 23
_MADVISE = _libc_madvise()


def _servable(value: torch.Tensor) -> torch.Tensor:
    """The tensor to register for ``value``: itself when it is a contiguous CPU tensor."""
    if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
        raise RuntimeError(
            f"RdmaCheckpointTransport: a {type(value).__name__} leaf cannot be served (it "
            "moves plain tensors; use torchft's PGTransport for DTensor state dicts)"
        )
    out = value.detach()
    if out.device.type != "cpu":
        out = out.cpu()
    return out.contiguous()


class RdmaCheckpointTransport(CheckpointTransport[T], Generic[T]):
    """torchft's ``CheckpointTransport`` over one-sided reads (module docstring).

    ``timeout``: bounds every wait (a request for a step not served yet, the reads, the
    wait of ``disallow_checkpoint`` for readers).  ``state_dict``: optional, as torchft's
    ``PGTransport``: a callable returning this replica's state dict, whose tensors of the same
    dtype and shape are filled in place when it recovers."""

    def __init__(self, timeout: timedelta, state_dict: Callable[[], object] | None = None) -> None:
        self._timeout = timeout
        self._state_dict_fn = state_dict
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._step = -1
        self._allowed = False
        self._manifest: dict[str, Any] | None = None
        self._memories: list[RdmaMemory] = []
        self._readers = 0
        self._handlers: set[threading.Thread] = set()
        self._closed = False
        address = advertised_address()
        self._listener = listen.listen_socket(address, 0)
        self._address = f"{SCHEME}{address}:{self._listener.getsockname()[1]}"
        self._thread = threading.Thread(
            target=self._accept, name="torchcomms-ckpt-server", daemon=True
        )
        self._thread.start()

    # ----------------------------------------------------------------- the healthy side
    def metadata(self) -> str:
        return self._address

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta
    ) -> None:
        values, spec = tree_flatten(state_dict)
        memories: list[RdmaMemory] = []
        leaves: list[object] = []
        for value in values:
            if isinstance(value, torch.Tensor):
                tensor = _servable(value)
                remote = None
                if tensor.nbytes:
                    memories.append(RdmaMemory(tensor))
                    remote = memories[-1].to_remote_buffer()
                leaves.append(
                    _TensorLeaf(tensor.dtype, tuple(tensor.shape), value.requires_grad, remote)
                )
            else:
                leaves.append(value)
        with self._lock:
            self._memories = memories
            # The tree itself with placeholders for its tensors: it pickles, unlike a spec.
            self._manifest = {"step": step, "tree": tree_unflatten(leaves, spec)}
            self._step, self._allowed = step, True
            self._changed.notify_all()

    def disallow_checkpoint(self) -> None:
        """Stop serving; returns once no reader is in flight (or ``timeout`` passed: then the
        memories are still deregistered, and a late reader's next piece is refused)."""
        deadline = time.monotonic() + self._timeout.total_seconds()
        with self._lock:
            self._allowed = False
            while self._readers and time.monotonic() < deadline:
                self._changed.wait(deadline - time.monotonic())
            if self._readers:
                logger.warning(
                    "disallow_checkpoint: %d reader(s) still in flight after %s; their next "
                    "reads will be refused",
                    self._readers,
                    self._timeout,
                )
            memories, self._memories = self._memories, []
            self._manifest = None
        del memories  # deregisters (each waits for its accessors: transport.rdma.registry)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            handler = threading.Thread(
                target=self._serve, args=(conn,), name="torchcomms-ckpt-reader", daemon=True
            )
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._handlers.add(handler)
            handler.start()

    def _serve(self, conn: socket.socket) -> None:
        """One recovering replica: wait for its step, hand it the manifest and a transport,
        hold the state dict until it says it is done."""
        transport: RdmaTransport | None = None
        counted = False
        try:
            conn.settimeout(self._timeout.total_seconds())
            request = _recv(conn)
            step, url = request["step"], request["url"]
            deadline = time.monotonic() + self._timeout.total_seconds()
            with self._lock:
                while not self._allowed and not self._closed and time.monotonic() < deadline:
                    self._changed.wait(deadline - time.monotonic())
                if not self._allowed or self._manifest is None:
                    why = (
                        "shut down" if self._closed else f"no checkpoint served in {self._timeout}"
                    )
                    _send(conn, {"error": why})
                    return
                if step != self._step:
                    _send(conn, {"error": f"serving step {self._step}, asked for step {step}"})
                    return
                manifest = self._manifest
                self._readers += 1
                counted = True
            transport = RdmaTransport("cpu", timeout=self._timeout)
            transport.connect(url)
            _send(conn, {"url": transport.bind(), "manifest": manifest})
            _recv(conn)  # "done" (or the connection ends: the reader is gone)
        except (OSError, EOFError, pickle.PickleError, RuntimeError) as exc:
            logger.info("checkpoint reader ended: %s", exc)
        finally:
            if transport is not None:
                transport.close()
            conn.close()
            with self._lock:
                if counted:
                    self._readers -= 1
                self._handlers.discard(threading.current_thread())
                self._changed.notify_all()

    # ------------------------------------------------------------------- the recovering side
    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> T:
        if not metadata.startswith(SCHEME):
            raise RuntimeError(
                f"RdmaCheckpointTransport.recv_checkpoint: {metadata!r} is not the metadata of "
                "an RdmaCheckpointTransport (every replica must use the same transport)"
            )
        host, _, port = metadata[len(SCHEME) :].rpartition(":")
        source = f"replica rank {src_rank} ({host}:{port})"
        deadline = time.monotonic() + timeout.total_seconds()
        transport = RdmaTransport("cpu", timeout=timeout)
        try:
            with socket.create_connection(
                (host.strip("[]"), int(port)), timeout.total_seconds()
            ) as conn:
                conn.settimeout(timeout.total_seconds())
                _send(conn, {"step": step, "url": transport.bind()})
                reply = _recv(conn)
                if "error" in reply:
                    raise RuntimeError(
                        f"RdmaCheckpointTransport.recv_checkpoint: {source} refused step {step}: "
                        f"{reply['error']}"
                    )
                transport.connect(reply["url"])
                values = self._read(transport, reply["manifest"], deadline)
                _send(conn, "done")
        except TimeoutError:
            raise CommTimeoutError(
                f"RdmaCheckpointTransport.recv_checkpoint: {source} did not serve step {step} "
                f"within {timeout}"
            ) from None
        except (ConnectionError, EOFError) as exc:
            raise PeerFailureError(
                f"RdmaCheckpointTransport.recv_checkpoint: the connection to {source} broke "
                f"({exc}): it died or shut down"
            ) from None
        finally:
            transport.close()
        logger.info("healed step %d from %s through %s", step, source, transport.path)
        return tree_unflatten(values, tree_flatten(reply["manifest"]["tree"])[1])

    def _targets(self) -> dict[str, torch.Tensor]:
        """This replica's tensors by tree path, filled in place when they match."""
        if self._state_dict_fn is None:
            return {}
        leaves, _ = tree_flatten_with_path(self._state_dict_fn())
        return {str(path): v for path, v in leaves if isinstance(v, torch.Tensor)}

    def _read(
        self, transport: RdmaTransport, manifest: dict[str, Any], deadline: float
    ) -> list[Any]:
        targets = self._targets()
        with_paths, _ = tree_flatten_with_path(manifest["tree"])
        values: list[Any] = []
        pairs = []
        memories = []
        for path, leaf in with_paths:
            if not isinstance(leaf, _TensorLeaf):
                values.append(leaf)
                continue
            mine = targets.get(str(path))
            if not (
                mine is not None
                and mine.dtype == leaf.dtype
                and tuple(mine.shape) == leaf.shape
                and mine.device.type == "cpu"
                and mine.is_contiguous()
            ):
                mine = torch.empty(leaf.shape, dtype=leaf.dtype)
            if leaf.requires_grad and not mine.requires_grad and mine.is_leaf:
                mine.requires_grad_(True)
            values.append(mine)
            if leaf.remote is not None:
                memories.append(RdmaMemory(mine.detach()))
                pairs.append((memories[-1].to_mutable_view(), leaf.remote))
        if time.monotonic() >= deadline:
            raise TimeoutError
        fresh_bytes = [t for t in values if isinstance(t, torch.Tensor) and t.nbytes]
        toucher = None
        if transport.path == "tcp" and fresh_bytes and not targets:
            # The socket path fills one tensor after another on one thread; new pages fault on
            # that thread.  Fault them in ahead of it on another (the kernel zeroes each page
            # either way), so page provisioning overlaps the network instead of adding to it.
            toucher = threading.Thread(
                target=_populate, args=(fresh_bytes,), name="torchcomms-ckpt-pages", daemon=True
            )
            toucher.start()
        try:
            transport.read_many(pairs)
        finally:
            if toucher is not None:
                toucher.join()
        return values

    def shutdown(self, wait: bool = True) -> None:
        with self._lock:
            self._closed = True
            self._allowed = False
            handlers = list(self._handlers)
            self._changed.notify_all()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        if wait:
            self._thread.join(self._timeout.total_seconds())
            for handler in handlers:
                handler.join(self._timeout.total_seconds())
        with self._lock:
            self._memories = []
            self._manifest = None
