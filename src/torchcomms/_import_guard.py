"""Keeps PyTorch's one look for torchcomms from failing silently, whatever is imported first.

``torch.distributed.distributed_c10d`` imports ``torchcomms._comms._BackendWrapper``,
``torchcomms.new_comm`` and ``torchcomms.hooks.FlightRecorderHook`` once, at its own import,
and turns the ``TORCH_DISTRIBUTED_USE_TORCHCOMMS`` bridge off for the life of the process if
any of them raises ``ImportError``.  ``torchcomms/__init__`` binds those names before anything
that imports ``torch.distributed``; this module covers the two cases that ordering cannot:

* the package fails to import while PyTorch is looking (a broken install): stand-ins take the
  three names, so the bridge stays on and the first ``init_process_group`` under the switch
  raises ``RuntimeError`` naming the cause instead of running plain gloo;
* PyTorch looked before torchcomms could be found (``sys.path`` changed after
  ``import torch.distributed``): the look is redone once torchcomms is whole, if no default
  group exists yet.

Imports only the standard library: it runs inside that half-initialised import.
"""

from __future__ import annotations

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


def stand_in(package: dict[str, Any], exc: ImportError) -> None:
    """Give PyTorch's look names that raise ``exc``'s story when the bridge is used."""
    global failure
    failure = (
        "torchcomms failed to import, so TORCH_DISTRIBUTED_USE_TORCHCOMMS cannot create "
        f"process groups over it: {type(exc).__name__}: {exc}"
    )
    _LOG.error("%s", failure)

    class _Unavailable:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            _raise_failure()

    for name, attr in (("torchcomms._comms", "_BackendWrapper"),
                       ("torchcomms.hooks", "FlightRecorderHook")):
        module = sys.modules.get(name)
        if module is None or not hasattr(module, attr):
            module = types.ModuleType(name, f"stand-in: {failure}")
            sys.modules[name] = module
        if not hasattr(module, attr):
            setattr(module, attr, _Unavailable)
    package["new_comm"] = _raise_failure


def redo_torch_look(new_comm: Any, backend_wrapper: type, recorder_hook: type) -> None:
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
    for name, value in (("_BackendWrapper", backend_wrapper), ("new_comm", new_comm),
                        ("FlightRecorderHook", recorder_hook), ("_TORCHCOMM_AVAILABLE", True)):
        setattr(c10d, name, value)
    _LOG.info("torch.distributed's bridge to torchcomms switched on after a failed first look")
