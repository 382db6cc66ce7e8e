"""c10d calls on our group made visible to PyTorch's dispatch modes (``CommDebugMode`` & co.).

On a C++ process group, ``pg.allreduce(...)`` goes through the dispatcher (``c10d::allreduce_``),
where a ``TorchDispatchMode`` such as ``torch.distributed.tensor.debug.CommDebugMode`` sees and
counts it.  Our ``_BackendWrapper`` is a Python ``ProcessGroup``: its methods run directly, so
a mode sees nothing.  While a dispatch mode is active (and only then: the dispatcher's round
trip is not free), each c10d call is therefore re-issued on a *twin*: a plain C++
``ProcessGroup`` whose CPU backend is a Python ``Backend`` (``_Forwarder``) that hands the call,
as the dispatcher's kernel makes it, back to the wrapper's own method.  The mode sees the op,
then our code runs it, exactly once.

Needs a release whose ``c10d.Backend`` can be subclassed from Python (2.14+); on 2.13 the calls
run directly, as before, and only functional collectives are seen (``hosts_python_backends``).

Threads: the call and its re-entry run on the calling thread; a thread-local marks the
re-entry, so the wrapper's own nested calls (a staged all_gather) are never re-issued.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
from torch._C import _distributed_c10d as c10d

_F = TypeVar("_F", bound=Callable[..., Any])

_reentry = threading.local()
_hosts: bool | None = None


def hosts_python_backends() -> bool:
    """Whether this release lets a Python class be a c10d ``Backend`` (2.14+: yes)."""
    global _hosts
    if _hosts is None:

        class _Probe(c10d.Backend):
            pass

        try:
            _Probe(0, 1)
            _hosts = True
        except TypeError:  # 2.13: "No constructor defined!"
            _hosts = False
    return _hosts


def _forwarding(name: str) -> Callable[..., Any]:
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        _reentry.depth = getattr(_reentry, "depth", 0) + 1
        try:
            return getattr(self._group, name)(*args, **kwargs)
        finally:
            _reentry.depth -= 1

    forward.__name__ = name
    return forward


_forwarders: dict[type, type] = {}


def _forwarder_class(group_type: type) -> type:
    """A ``c10d.Backend`` subclass forwarding every method of ``group_type`` marked by
    ``seen_by_dispatch_modes`` (aliases included: the kernels call the binding's names, e.g.
    ``all_to_all_single``).  Built on first use: only 2.14+ lets Python subclass ``Backend``."""
    if group_type not in _forwarders:
        members: dict[str, Any] = {
            name: _forwarding(name)
            for name, value in vars(group_type).items()
            if getattr(value, "_seen_by_dispatch_modes", False)
        }

        def __init__(self: Any, group: Any) -> None:
            c10d.Backend.__init__(self, max(group.rank(), 0), max(group.size(), 1))
            self._group = group

        members["__init__"] = __init__
        # what c10d's kernels print in their messages (never "gloo": no gloo-only path applies)
        members["name"] = lambda self: "torchcomms"
        members["__doc__"] = "A Python c10d ``Backend`` handing each call back to ``_group``."
        _forwarders[group_type] = type("_Forwarder", (c10d.Backend,), members)
    return _forwarders[group_type]


def twin(group: Any) -> c10d.ProcessGroup:
    """The plain ``ProcessGroup`` whose calls reach ``group`` through the dispatcher."""
    plain = c10d.ProcessGroup(max(group.rank(), 0), max(group.size(), 1))  # type: ignore[call-arg]
    kind = c10d.ProcessGroup.BackendType.CUSTOM
    plain._register_backend(torch.device("cpu"), kind, _forwarder_class(type(group))(group))
    plain._set_default_backend(kind)
    plain._set_group_name(group.group_name)
    return plain


def seen_by_dispatch_modes(method: _F) -> _F:
    """Re-issue ``method`` through a twin while a dispatch mode is active (module docstring)."""
    name = method.__name__

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if (
            torch._C._len_torch_dispatch_stack() == 0
            or getattr(_reentry, "depth", 0) > 0
            or not hosts_python_backends()
        ):
            return method(self, *args, **kwargs)
        return getattr(self._dispatch_twin(), name)(*args, **kwargs)

    run._seen_by_dispatch_modes = True  # type: ignore[attr-defined]
    return cast(_F, run)
