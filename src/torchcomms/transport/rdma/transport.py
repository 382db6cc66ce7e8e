"""``RdmaTransport``: one end of a one-sided link between two processes (upstream's names).

``bind()`` starts this end's serving thread (``tcp.Server``) and returns its URL; ``connect``
takes the peer's URL and picks the path: cross-memory attach (``cma``) when the peer is on
this host (same host identity as the CPU backend's locality) and the kernel permits it, else a
TCP connection to the peer's serving thread.  ``TORCHCOMM_RDMA_PATH`` (``auto|cma|tcp``)
overrides the choice.  ``write`` and ``read`` then move bytes between a local view and the
peer's ``RdmaRemoteBuffer`` without the peer's code taking part; both return 0 (upstream's
``commSuccess``) and raise the typed errors of ``torchcomms.errors`` when they fail.

Threads: the calling thread runs ``read``/``write`` (with helper threads for large copies);
the serving thread answers this end's TCP peers.  One transport may be used from several
threads; its TCP requests are serialised on the connection.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

from torchcomms import config
from torchcomms.transport.procs import host_identity
from torchcomms.transport.rdma.cma import CmaPeer
from torchcomms.transport.rdma.memory import (
    RdmaMemoryMutableView,
    RdmaMemoryView,
    RdmaRemoteBuffer,
)
from torchcomms.transport.rdma.registry import registry
from torchcomms.transport.rdma.tcp import TOKEN_BYTES, Server, TcpPeer, memory_at

URL_VERSION = 1


def advertised_address() -> str:
    """The address peers on other hosts dial: ``TORCHCOMM_GLOO_HOSTNAME`` (the setting the
    gloo backend reads), else what this host's name resolves to, else loopback."""
    explicit = config.gloo_hostname()
    if explicit:
        return explicit
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _device(device: Any) -> torch.device:
    try:
        return torch.device(device)
    except (TypeError, RuntimeError):
        raise TypeError(
            f"RdmaTransport(device): expected a torch.device or device string, got {device!r}"
        ) from None


class RdmaTransport:
    """One end of a one-sided point-to-point link (module docstring)."""

    def __init__(self, device: torch.device | str, *, timeout: timedelta | None = None) -> None:
        # Upstream binds a CUDA device for NIC discovery; here memory is CPU memory and the
        # device only records the caller's choice (``cuda:0`` code runs unchanged).
        self.device = _device(device)
        self.timeout = timeout if timeout is not None else config.default_timeout()
        if self.timeout.total_seconds() <= 0:
            raise ValueError(f"RdmaTransport: timeout must be positive, got {self.timeout}")
        self._token = secrets.token_bytes(TOKEN_BYTES)
        self._probe = ctypes.create_string_buffer(self._token, TOKEN_BYTES)
        self._lock = threading.Lock()
        self._server: Server | None = None
        self._url = b""
        self._peer_url = b""
        self._cma: CmaPeer | None = None
        self._tcp: TcpPeer | None = None
        #: How this end reaches its peer once connected: ``"cma"`` or ``"tcp"``.
        self.path = ""
        self.peer = ""

    @staticmethod
    def supported() -> bool:
        """True on Linux: cross-memory attach or TCP needs no RDMA hardware."""
        return sys.platform.startswith("linux")

    def bind(self) -> bytes:
        """This end's URL (starts its serving thread on the first call)."""
        with self._lock:
            if self._server is None:
                address = advertised_address()
                self._server = Server(address, self._token)
                url = {
                    "v": URL_VERSION,
                    "host": host_identity(),
                    "pid": os.getpid(),
                    "instance": registry().instance,
                    "table": registry().table(),
                    "probe": ctypes.addressof(self._probe),
                    "token": self._token.hex(),
                    "addr": address,
                    "port": self._server.port,
                }
                self._url = json.dumps(url, sort_keys=True).encode()
            return self._url

    def connect(self, peer_url: bytes) -> int:
        """Connect to the peer whose ``bind()`` gave ``peer_url``; 0 on success."""
        if not isinstance(peer_url, (bytes, bytearray)):
            raise TypeError(f"RdmaTransport.connect: peer_url must be bytes, got {peer_url!r}")
        try:
            peer = json.loads(bytes(peer_url))
            if peer.get("v") != URL_VERSION:
                raise ValueError(f"URL version {peer.get('v')!r}")
            token = bytes.fromhex(peer["token"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise RuntimeError(
                f"RdmaTransport.connect: not a URL of RdmaTransport.bind(): {exc}"
            ) from None
        self.bind()
        with self._lock:
            if self._peer_url:
                if self._peer_url == bytes(peer_url):
                    return 0
                raise RuntimeError(
                    f"RdmaTransport.connect: already connected to {self.peer}; a transport "
                    "links one pair of ends (make another RdmaTransport)"
                )
            owner = f"pid {peer['pid']} on {peer['host']} ({peer['addr']}:{peer['port']})"
            choice = config.rdma_path()
            why = "TORCHCOMM_RDMA_PATH=tcp"
            if choice != "tcp":
                why = f"the peer is on another host ({peer['host']})"
                if peer["host"] == host_identity():
                    cma = CmaPeer(peer["pid"], peer["table"], peer["instance"], owner)
                    refused = cma.probe(peer["probe"], token)
                    if refused is None:
                        self._cma, self.path = cma, "cma"
                    else:
                        cma.close()
                        why = refused
            if self._cma is None:
                if choice == "cma":
                    raise RuntimeError(
                        f"RdmaTransport.connect: TORCHCOMM_RDMA_PATH=cma, but cross-memory "
                        f"attach to {owner} is not possible: {why}"
                    )
                deadline = time.monotonic() + self.timeout.total_seconds()
                self._tcp = TcpPeer(peer["addr"], peer["port"], token, owner, deadline)
                self.path = "tcp"
            self.peer, self._peer_url = owner, bytes(peer_url)
        return 0

    def connected(self) -> bool:
        return bool(self._peer_url)

    def _deadline(self, what: str) -> float:
        if not self._peer_url:
            raise RuntimeError(f"RdmaTransport.{what}: not connected (call connect(peer_url))")
        return time.monotonic() + self.timeout.total_seconds()

    def write(self, local_buffer: RdmaMemoryView, remote_buffer: RdmaRemoteBuffer) -> int:
        """Copy ``local_buffer`` to the start of the peer's ``remote_buffer``; 0 on success."""
        _check("write", local_buffer, RdmaMemoryView, remote_buffer)
        deadline = self._deadline("write")
        n, key, remote = local_buffer.size(), remote_buffer.access_key, remote_buffer.ptr
        if self._cma is not None:
            self._cma.copy_many(True, [(local_buffer.ptr, key, remote, n)], deadline)
        else:
            assert self._tcp is not None
            self._tcp.write(memory_at(local_buffer.ptr, n), key, remote, deadline)
        return 0

    def read(self, local_buffer: RdmaMemoryMutableView, remote_buffer: RdmaRemoteBuffer) -> int:
        """Fill ``local_buffer`` from the start of the peer's ``remote_buffer``; 0 on success."""
        return self.read_many([(local_buffer, remote_buffer)])

    def read_many(self, pairs: Sequence[tuple[RdmaMemoryMutableView, RdmaRemoteBuffer]]) -> int:
        """``read`` of every pair at once (not upstream's): the copies of many tensors are
        shared out to threads (cma) or kept in flight together (tcp); 0 on success."""
        for local, remote in pairs:
            _check("read", local, RdmaMemoryMutableView, remote)
        deadline = self._deadline("read")
        if self._cma is not None:
            items = [(lo.ptr, re.access_key, re.ptr, lo.size()) for lo, re in pairs]
            self._cma.copy_many(False, items, deadline)
        else:
            assert self._tcp is not None
            views = [(memory_at(lo.ptr, lo.size()), re.access_key, re.ptr) for lo, re in pairs]
            self._tcp.read_many(views, deadline)
        return 0

    def close(self) -> None:
        """Stop the serving thread and drop the link (also when the transport is collected)."""
        with self._lock:
            server, self._server = self._server, None
            cma, self._cma = self._cma, None
            tcp, self._tcp = self._tcp, None
            self._peer_url = b""
        if server is not None:
            server.close()
        if cma is not None:
            cma.close()
        if tcp is not None:
            tcp.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit
            self.close()

    def __repr__(self) -> str:
        state = f"connected to {self.peer} by {self.path}" if self._peer_url else "not connected"
        return f"RdmaTransport(device={self.device}, {state})"


def _check(what: str, local: object, kind: type, remote: object) -> None:
    if not isinstance(local, kind):
        raise TypeError(
            f"RdmaTransport.{what}: local_buffer must be an {kind.__name__} "
            f"(RdmaMemory.to_{'mutable_' if kind is RdmaMemoryMutableView else ''}view()), "
            f"got {type(local).__name__}"
        )
    if not isinstance(remote, RdmaRemoteBuffer):
        raise TypeError(
            f"RdmaTransport.{what}: remote_buffer must be an RdmaRemoteBuffer, got "
            f"{type(remote).__name__}"
        )
    assert isinstance(local, RdmaMemoryView)
    if local.size() > remote.len:
        raise RuntimeError(
            f"RdmaTransport.{what}: the local buffer ({local.size()} bytes) is larger than the "
            f"remote buffer ({remote.len} bytes)"
        )
