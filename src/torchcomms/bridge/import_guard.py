"""Keeps PyTorch's one look for torchcomms from failing silently, whatever is imported first.

``torch.distributed.distributed_c10d`` imports ``torchcomms._comms._BackendWrapper``,
``torchcomms.new_comm`` and ``torchcomms.hooks.FlightRecorderHook`` (2.14+ also
``is_backend_built`` and ``_comms._is_backend_registered``) once, at its own import,
and turns the ``TORCH_DISTRIBUTED_USE_TORCHCOMMS`` bridge off for the life of the process if
any of them raises ``ImportError``.  ``torchcomms/__init__`` serves those names before anything
imports torch; this module covers the two cases that ordering cannot:

* the package fails to import while PyTorch is looking (a broken install): stand-ins take
  every name the release imports from us, so the bridge stays on and the first ``init_process_group`` under the switch
  raises ``RuntimeError`` naming the cause instead of running plain gloo;
* PyTorch looked before torchcomms could be found (``sys.path`` changed after
  ``import torch.distributed``): the look is redone once torchcomms is whole, if no default
  group exists yet.

Imports only the standard library: it runs inside that half-initialised import.  What each
release imports from us is read from its own ``distributed_c10d`` (``torch_import_block``), so
no list of names here can fall behind a release.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import logging
import sys
import types
from typing import Any, NoReturn

_LOG = logging.getLogger("torchcomms.import")
_C10D = "torch.distributed.distributed_c10d"

failure: str | None = None
"""Why the package failed to import inside PyTorch's look, or None."""


def torch_is_looking() -> bool:
    """True while ``distributed_c10d`` is importing us (it defines its switch check after)."""
    c10d = sys.modules.get(_C10D)
    return c10d is not None and not hasattr(c10d, "_use_torchcomms_enabled")


def _raise_failure(*_args: Any, **_kwargs: Any) -> NoReturn:
    raise RuntimeError(failure)


def _claims_backends(*_args: Any, **_kwargs: Any) -> bool:
    return True  # so PyTorch routes the group to new_comm, which says why it cannot run


def stand_in(package: dict[str, Any], exc: ImportError) -> None:
    """Give PyTorch's look names that raise ``exc``'s story when the bridge is used: every
    name this release imports from us (its predicates claim the backend, so the first
    ``init_process_group`` under the switch reaches the stand-in ``new_comm``)."""
    global failure
    failure = (
        "torchcomms failed to import, so TORCH_DISTRIBUTED_USE_TORCHCOMMS cannot create "
        f"process groups over it: {type(exc).__name__}: {exc}"
    )
    _LOG.error("%s", failure)

    class _Unavailable:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            _raise_failure()

    wanted = torch_import_block(sys.modules[_C10D])
    for module_name, name, _ in wanted:
        if module_name == "torchcomms":
            namespace = package
        else:
            module = sys.modules.get(module_name)
            if module is None:
                module = types.ModuleType(module_name, f"stand-in: {failure}")
                sys.modules[module_name] = module
            namespace = module.__dict__
        if name in namespace and module_name != "torchcomms":
            continue  # the submodule imported whole: PyTorch may use it as it is
        if name.startswith(("is_", "_is_")):
            namespace[name] = _claims_backends
        elif name.lstrip("_")[:1].isupper():
            namespace[name] = _Unavailable
        else:
            namespace[name] = _raise_failure


def torch_import_block(c10d: types.ModuleType) -> list[tuple[str, str, str]]:
    """What this release's ``distributed_c10d`` imports from us, read from its own source:
    ``(our module, our name, the name it binds)`` for each ``from torchcomms... import``.

    Read rather than listed, so a redone look binds exactly what the installed release binds,
    under its names (2.15 binds our hook as ``_TorchCommsFlightRecorderHook``, beside its own
    ``FlightRecorderHook``, which must stay PyTorch's)."""
    source = inspect.getsource(c10d)
    found: list[tuple[str, str, str]] = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").partition(".")[0] == "torchcomms"
        ):
            assert node.module is not None
            found += [(node.module, a.name, a.asname or a.name) for a in node.names]
    return found


def redo_torch_look() -> None:
    """Switch PyTorch's bridge on if its look for us failed before we were importable."""
    c10d = sys.modules.get(_C10D)
    if c10d is None or torch_is_looking() or getattr(c10d, "_TORCHCOMM_AVAILABLE", True):
        return
    world = getattr(getattr(c10d, "GroupMember", None), "WORLD", None)
    if world is not None:
        _LOG.warning(
            "torch.distributed was imported before torchcomms could be found and its default "
            "group already exists, so that group does not run on torchcomms"
        )
        return
    bound: dict[str, Any] = {}
    for module, name, as_name in torch_import_block(c10d):
        # the fallbacks (``_backend_wrapper._BackendWrapper``) bind what the first choice does
        bound.setdefault(as_name, getattr(importlib.import_module(module), name))
    for as_name, value in bound.items():
        setattr(c10d, as_name, value)
    c10d._TORCHCOMM_AVAILABLE = True  # type: ignore[attr-defined]
    _LOG.info(
        "torch.distributed's bridge to torchcomms switched on after a failed first look (bound %s)",
        ", ".join(sorted(bound)),
    )
