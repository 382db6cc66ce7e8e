"""c10d calls on our group made visible to PyTorch's dispatch modes (``CommDebugMode`` & co.).

On a C++ process group, ``pg.allreduce(...)`` goes through the dispatcher (``c10d::allreduce_``),
where a ``TorchDispatchMode`` such as ``torch.distributed.tensor.debug.CommDebugMode`` sees and
counts it.  Our ``_BackendWrapper`` is a Python ``ProcessGroup``: its methods run directly, so
a mode sees nothing.  While a dispatch mode is active (and only then: the dispatcher's round
trip is not free), each c10d call is therefore also issued through the dispatcher, on a
*twin*: a plain C++ ``ProcessGroup`` of the same rank and size.  Which twin depends on what
the release can do (``hosts_python_backends``):

* 2.14+: the twin's CPU backend is a Python ``Backend`` (``_Forwarder``) that hands the call,
  as the dispatcher's kernel makes it, back to the wrapper's own method: the mode sees the op
  on the real tensors, then our code runs it, exactly once;
* 2.13, whose ``Backend`` Python cannot subclass: the twin's backend is c10d's own
  ``FakeProcessGroup``, which moves nothing.  The call is shown to the mode there first, on
  scratch tensors of the same shapes and dtypes (so no fake result can touch the user's
  tensors), then runs on the communicator.  The mode counts the same ops; it does not see the
  real tensors' values.

Threads: the call and its re-entry run on the calling thread; a thread-local marks the
re-entry, so the wrapper's own nested calls (a staged all_gather) are never issued twice.
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
            for klass in group_type.__mro__  # the calls live in a base (``C10dCalls``)
            for name, value in vars(klass).items()
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


def shown_twin(group: Any) -> c10d.ProcessGroup:
    """2.13's twin: a plain ``ProcessGroup`` over c10d's ``FakeProcessGroup`` (moves nothing)."""
    rank, size = max(group.rank(), 0), max(group.size(), 1)
    plain = c10d.ProcessGroup(rank, size)  # type: ignore[call-arg]
    kind = c10d.ProcessGroup.BackendType.CUSTOM
    plain._register_backend(
        torch.device("cpu"), kind, c10d.FakeProcessGroup._create_internal(rank, size)
    )
    plain._set_default_backend(kind)
    plain._set_group_name(group.group_name)
    return plain


def _scratch(value: Any) -> Any:
    """``value`` with every tensor replaced by an uninitialised one of its shape and dtype."""
    from torch.utils import _pytree  # at call time: never while torch.distributed imports us

    return _pytree.tree_map(
        lambda x: torch.empty_like(x) if isinstance(x, torch.Tensor) else x, value
    )


def twin_of(group: Any) -> c10d.ProcessGroup:
    """``group``'s twin for this release, kept in ``group._twin`` and rebuilt when a
    reconfigure changed its rank or size."""
    key = (group.rank(), group.size())
    if group._twin is None or group._twin[0] != key:
        group._twin = (key, twin(group) if hosts_python_backends() else shown_twin(group))
    return group._twin[1]


def seen_by_dispatch_modes(method: _F) -> _F:
    """Issue ``method`` through a twin too while a dispatch mode is active (module docstring)."""
    name = method.__name__

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if torch._C._len_torch_dispatch_stack() == 0 or getattr(_reentry, "depth", 0) > 0:
            return method(self, *args, **kwargs)
        if hosts_python_backends():
            return getattr(twin_of(self), name)(*args, **kwargs)
        shown_args, shown_kwargs = _scratch((args, kwargs))
        _reentry.depth = getattr(_reentry, "depth", 0) + 1
        try:
            getattr(twin_of(self), name)(*shown_args, **shown_kwargs)
        finally:
            _reentry.depth -= 1
        return method(self, *args, **kwargs)

    run._seen_by_dispatch_modes = True  # type: ignore[attr-defined]
    return cast(_F, run)
