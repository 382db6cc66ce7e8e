"""The gloo (TCP) transport: process-group construction, device choice, reduce-op mapping.

Everything that builds or talks to a torch ``ProcessGroupGloo`` directly goes through
here: the CPU backend's flat path, the hierarchical path's cross-host groups, and the
benchmark's raw-gloo baseline, so all three pick the same network device the same way.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch._C._distributed_c10d as c10d

from torchcomms import config
from torchcomms.runtime.deadline import Deadline
from torchcomms.transport.gloo.rendezvous import GatheredRendezvous
from torchcomms.types import RedOpType, ReduceOp

_C10D_OPS = {
    RedOpType.SUM: c10d.ReduceOp.SUM,
    RedOpType.PRODUCT: c10d.ReduceOp.PRODUCT,
    RedOpType.MIN: c10d.ReduceOp.MIN,
    RedOpType.MAX: c10d.ReduceOp.MAX,
    RedOpType.BAND: c10d.ReduceOp.BAND,
    RedOpType.BOR: c10d.ReduceOp.BOR,
    RedOpType.BXOR: c10d.ReduceOp.BXOR,
    # gloo has neither: the CPU backend pre-multiplies (PREMUL_SUM) or divides after (AVG).
    RedOpType.AVG: c10d.ReduceOp.SUM,
    RedOpType.PREMUL_SUM: c10d.ReduceOp.SUM,
}

# On bool data a sum or max is a logical or, a product or min a logical and.
_BOOL_OPS = {
    RedOpType.SUM: c10d.ReduceOp.MAX,
    RedOpType.MAX: c10d.ReduceOp.MAX,
    RedOpType.BOR: c10d.ReduceOp.MAX,
    RedOpType.PRODUCT: c10d.ReduceOp.MIN,
    RedOpType.MIN: c10d.ReduceOp.MIN,
    RedOpType.BAND: c10d.ReduceOp.MIN,
    RedOpType.BXOR: c10d.ReduceOp.BXOR,
}


def c10d_op(op: ReduceOp, dtype: torch.dtype) -> Any:
    """The gloo reduction that computes ``op`` on ``dtype`` (AVG and PREMUL_SUM as a sum)."""
    if dtype is torch.bool:
        return _BOOL_OPS[op.type]
    return _C10D_OPS[op.type]


def choose_device(
    hints: dict[str, str], hosts: Sequence[str], my_host: str, lazy: bool | None = None
) -> tuple[str, Any]:
    """``(description, gloo device)``: loopback when every member is on this host.

    ``hints`` (``hostname``, ``interface``) and ``TORCHCOMM_GLOO_HOSTNAME`` /
    ``TORCHCOMM_GLOO_INTERFACE`` override the choice; otherwise several hosts use gloo's
    default interface.
    """
    hostname = hints.get("hostname") or config.gloo_hostname()
    interface = hints.get("interface") or config.gloo_interface()
    if hostname or interface:
        return f"hostname={hostname!r} interface={interface!r}", (
            c10d.ProcessGroupGloo.create_device(
                hostname=hostname or "", interface=interface or "", lazy_init=lazy
            )
        )
    distinct = set(hosts)
    if distinct == {my_host}:
        return "loopback: all ranks on this host", c10d.ProcessGroupGloo.create_device(
            hostname="127.0.0.1", lazy_init=lazy
        )
    return f"default interface: {len(distinct)} hosts", (
        c10d.ProcessGroupGloo.create_default_device(lazy_init=lazy)
    )


def new_process_group(
    store: c10d.Store, rank: int, size: int, timeout: timedelta, device: Any
) -> Any:
    """A ``ProcessGroupGloo`` over ``store`` (collective over its ``size`` members)."""
    opts = c10d.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = timeout
    opts._devices = [device]
    return c10d.ProcessGroupGloo(store, rank, size, opts)


def connect_process_group(
    store: c10d.Store, rank: int, size: int, timeout: timedelta, device: Any, lazy: bool
) -> tuple[Any, c10d.Store]:
    """``new_process_group`` with an eager connect's rendezvous gathered
    (``transport.gloo.rendezvous``): O(1) store round trips per rank instead of 2N.

    Returns the group and the store it was given: keep both alive together (gloo calls
    back into the Python store).
    """
    sweep()  # groups retired by earlier communicators whose calls have ended since
    if not lazy and size > 1:
        store = GatheredRendezvous(store, rank, size, timeout)
    return new_process_group(store, rank, size, timeout, device), store


# -- releasing a process group ---------------------------------------------------------------------
# A ``ProcessGroupGloo`` holds native threads (its workers and its device's event loop), an
# epoll descriptor, pipes and a socket per peer, and releases them only when its last
# reference goes: ``shutdown()`` and ``abort()`` release none of them (measured on torch
# 2.13).  Its destructor joins its worker threads, so dropping a group while one of its calls
# still runs blocks the dropping thread until that call ends (up to gloo's timeout).  A group
# that may have a call running is therefore *retired*: kept here, and dropped by the first
# ``sweep`` (at the next release or connect of a communicator) that finds it idle.
_retired: list[tuple[tuple[Any, ...], Callable[[], bool]]] = []
_retired_lock = threading.Lock()


def release(held: tuple[Any, ...], busy: Callable[[], bool]) -> None:
    """Let go of ``held`` (a process group and what must outlive it: its store, its
    device) now if ``busy()`` is false, else once a later ``sweep`` finds it false."""
    if busy():
        with _retired_lock:
            _retired.append((held, busy))
    sweep()


def sweep() -> int:
    """Drop every retired group whose calls have ended; how many are still retired."""
    with _retired_lock:
        if not _retired:
            return 0
        ended = [not busy() for _, busy in _retired]
        idle = [entry for entry, done in zip(_retired, ended, strict=True) if done]
        _retired[:] = [entry for entry, done in zip(_retired, ended, strict=True) if not done]
        left = len(_retired)
    idle.clear()  # the groups' destructors run here, outside the lock
    return left


def arm(gloo_options: Any, deadline: Deadline) -> timedelta:
    """Give one gloo call what is left of the op's deadline; the same budget bounds its wait."""
    left = deadline.remaining()
    gloo_options.timeout = left
    return left


def underlying_tcp_host(store: c10d.Store) -> str | None:
    """The host of the TCPStore under a (chain of) PrefixStore(s), if any."""
    current: object = store
    for _ in range(16):
        if isinstance(current, c10d.TCPStore):
            return str(current.host)
        if isinstance(current, c10d.PrefixStore):
            current = current.underlying_store
            continue
        inner = getattr(current, "inner", None)  # a CountingStore (TORCHCOMM_STORE_COUNTS)
        if isinstance(inner, c10d.Store):
            current = inner
            continue
        return None
    return None


def reachable_address(store: c10d.Store, hostname: str | None = None) -> str:
    """Where peers on other hosts can reach this rank: ``hostname`` or the gloo hostname
    when set, else this host's address on the route to the store's host."""
    chosen = hostname or config.gloo_hostname()
    if chosen:
        return chosen
    target = underlying_tcp_host(store)
    if target:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((target, 9))  # no packet is sent: only the route is chosen
                return str(probe.getsockname()[0])
        except OSError:
            pass
    return "0.0.0.0"
