"""The backend registry: a dict of name → backend class, filled by entry points or ``register_backend``."""

from __future__ import annotations

import importlib
import importlib.metadata
import threading
from typing import Any

ENTRY_POINT_GROUP = "torchcomms.backends"

# Backends this package ships, usable even when the distribution's metadata is missing
# (e.g. running from a source tree on sys.path).
_BUILTIN_MODULES = {"fake": "torchcomms._comms", "gloo": "torchcomms._comms_gloo"}

_registry: dict[str, type[Any]] = {}
_lock = threading.Lock()


def register_backend(name: str, backend_class: type[Any]) -> None:
    """Register a backend class, instantiated with no arguments for every ``new_comm(name, ...)``.

    Registering the same class twice is a no-op; a different class under a taken name is refused.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_backend: name must be a non-empty str, got {name!r}")
    if not isinstance(backend_class, type):
        raise TypeError(
            f"register_backend: backend_class must be a class, got {type(backend_class).__name__}"
        )
    with _lock:
        existing = _registry.get(name)
        if existing is not None and existing is not backend_class:
            raise RuntimeError(
                f"register_backend: backend {name!r} is already registered "
                f"({existing.__module__}.{existing.__qualname__})"
            )
        _registry[name] = backend_class


def _is_backend_registered(name: str) -> bool:
    with _lock:
        return name in _registry


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _load_backend(name: str) -> None:
    """Import the module that registers backend ``name`` (entry point, else a built-in)."""
    if _is_backend_registered(name):
        return
    ep = _entry_points().get(name)
    if ep is not None:
        ep.load()
    elif name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])
    if not _is_backend_registered(name):
        raise ModuleNotFoundError(
            f"failed to find backend {name}, is it registered via entry_points.txt?"
        )


def get_backend_class(name: str) -> type[Any]:
    _load_backend(name)
    with _lock:
        return _registry[name]


def built_backends() -> list[str]:
    """Names of the backends installed (entry points) plus this package's built-ins."""
    names = set(_entry_points()) | set(_BUILTIN_MODULES)
    return sorted(names)


def is_backend_built(name: str) -> bool:
    return name in built_backends()
