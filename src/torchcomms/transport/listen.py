"""Where a server listens: where its clients dial, not on every interface.

On the loopback address when the dialled address is loopback (``127.0.0.1``,
``localhost``); on the dialled IP when it is a literal address of this host; on all
interfaces (dual-stack where the kernel has IPv6) only for a host name (other hosts may
resolve it to any of this host's addresses) or an address this host does not have (NAT).
``listen_socket`` binds with ``SO_REUSEADDR``, so "port taken" is known from ``bind``
(``EADDRINUSE``), never guessed from a failed server start; ``accepts`` tells a port taken
by a server from one held by a connection's local end.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import random
import socket
import time
from collections.abc import Collection

from torchcomms.runtime.deadline import Deadline

logger = logging.getLogger("torchcomms.transport.listen")

_IP = ipaddress.IPv4Address | ipaddress.IPv6Address
#: The longest pause between two connects to a server that is not up yet.
_POLL_MAX_S = 0.02


def _literal_ip(text: str) -> _IP | None:
    try:
        return ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None


def _wildcard() -> tuple[socket.AddressFamily, str]:
    return (socket.AF_INET6, "::") if socket.has_ipv6 else (socket.AF_INET, "0.0.0.0")


def listen_target(dial: str) -> tuple[socket.AddressFamily, str]:
    """The (family, address) a server binds for clients that dial ``dial`` (module docstring)."""
    ip = _literal_ip(dial)
    if ip is None:
        try:
            infos = socket.getaddrinfo(dial, None, type=socket.SOCK_STREAM)
        except OSError:
            return _wildcard()
        resolved = [a for a in (_literal_ip(str(i[4][0])) for i in infos) if a is not None]
        if not resolved or not all(a.is_loopback for a in resolved):
            return _wildcard()
        # "localhost": every name of it is loopback; clients fall back to IPv4 (c10d tries
        # each resolved address), so the IPv4 one serves them all.
        ip = next((a for a in resolved if a.version == 4), resolved[0])
    family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
    return family, str(ip)


def _bound_socket(family: socket.AddressFamily, host: str, port: int) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # A previous server's connections in TIME_WAIT must not keep the port from us.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and host == "::":
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # IPv4 clients too
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock


def listen_socket(dial: str, port: int) -> socket.socket:
    """A listening socket for clients of ``dial:port``; ``OSError(EADDRINUSE)`` if it is taken."""
    family, host = listen_target(dial)
    if host == "::":
        return _wildcard_socket(port)
    try:
        return _bound_socket(family, host, port)
    except OSError as exc:
        if exc.errno != errno.EADDRNOTAVAIL:
            raise
    # Not an address of this host (a NAT or floating address): the clients' packets arrive
    # on some other local address.
    logger.debug("%s is not an address of this host; listening on all interfaces", host)
    return _wildcard_socket(port)


def _wildcard_socket(port: int) -> socket.socket:
    """All interfaces: dual-stack IPv6 where the kernel has it, else IPv4."""
    if socket.has_ipv6:
        try:
            return _bound_socket(socket.AF_INET6, "::", port)
        except OSError as exc:
            if exc.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL, errno.EPROTONOSUPPORT):
                raise
    return _bound_socket(socket.AF_INET, "0.0.0.0", port)


def _connect_error(addr: str, port: int, timeout_s: float) -> OSError | None:
    """The error of one connect to ``addr:port`` (None: something accepted it)."""
    try:
        with socket.create_connection((addr, port), timeout=max(timeout_s, 0.001)):
            return None
    except OSError as exc:
        return exc


def accepts(addr: str, port: int, timeout_s: float) -> bool:
    """Whether something accepts connections on ``addr:port`` (refused: False).

    A port can be taken (``bind`` says ``EADDRINUSE``) with nothing listening on it: the
    local end of a connection of this host holds it, when the port is in the ephemeral
    range.  A connect that neither succeeds nor is refused in ``timeout_s`` counts as a
    listener (a busy one)."""
    return not isinstance(_connect_error(addr, port, timeout_s), ConnectionRefusedError)


def await_listener(addr: str, port: int, deadline: Deadline, min_wait_s: float) -> None:
    """Wait until something accepts connections on ``addr:port`` (bounded by ``deadline``).

    c10d's client retries a refused connect with a back-off that grows towards a second:
    the members of a job that creates communicators one after another would pay it at
    every bootstrap, since rank 0 serves ``MASTER_PORT`` only while it bootstraps.  A
    plain connect, retried every few milliseconds, costs the server nothing (it sees a
    client that leaves).  Gives up silently: the caller's client says what went wrong."""
    pause = 0.001
    while deadline.left_s() > min_wait_s:
        if _connect_error(addr, port, min(deadline.left_s(), 1.0)) is None:
            return
        time.sleep(min(pause, max(deadline.left_s(), 0.0)))
        pause = min(pause * 2, _POLL_MAX_S)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_master_port(host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
    """A port free on ``host`` a moment ago, below the ephemeral range, for ``MASTER_PORT``.

    Rank 0 serves ``MASTER_PORT`` only while it bootstraps; a port of the ephemeral range
    could meanwhile become a connection's local end (and then sit in TIME_WAIT for a
    minute), which the next bootstrap would have to wait out.  Below the range the kernel
    never hands it out.  ``avoid``: ports already handed out by the caller."""
    high = _ephemeral_low()
    low = max(1024, high - 12000)
    for _ in range(200):
        port = random.randrange(low, high)
        if port in avoid:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port on {host} in {low}-{high - 1}")
