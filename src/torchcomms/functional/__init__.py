"""torch.compile support: the switches upstream exposes, and the traceable communicator.

``TORCHCOMMS_PATCH_FOR_COMPILE=1`` (read when ``torchcomms`` is imported) makes
communicators created from then on traceable by ``torch.compile(fullgraph=True)``: their
ops become ``torch.library`` custom ops (``torchcomms.functional.ops``) on an opaque
communicator object (``torchcomms.functional.opaque``).  Unset, this module only defines
the version helpers below and nothing else is imported or changed.

``is_torch_compile_supported`` compares versions with a small PEP 440 subset (release,
``a``/``b``/``rc``, ``.post``, ``.dev``, a ``+local`` suffix ignored): enough for torch's
own version strings, without a dependency on ``packaging``.

Modules: ``table`` (the one table of traced ops), ``ops`` (the custom ops, from it, under
upstream's names), ``autograd`` (the formulas of the differentiable ones), ``traced`` (what a
call becomes while Dynamo traces it), ``opaque`` (the traceable communicator and its batch),
``async_tensor`` (``TorchCommsAsyncTensor``, upstream's waited-on-first-use result).  They may import ``comm`` and what it builds on; nothing below ``TorchComm``
imports this package's modules, and this ``__init__`` imports them only when enabled.
"""

from __future__ import annotations

import re

import torch

from torchcomms import config

__all__ = [
    "COMPILE_IGNORE_VERSION_ENV",
    "MIN_PYTORCH_VERSION_FOR_COMPILE",
    "PATCH_FOR_COMPILE_ENV",
    "is_torch_compile_supported",
    "is_torch_compile_supported_and_enabled",
]

#: The oldest torch whose opaque-object support the compile path relies on (upstream's value).
MIN_PYTORCH_VERSION_FOR_COMPILE = "2.12.0.dev0"
PATCH_FOR_COMPILE_ENV = "TORCHCOMMS_PATCH_FOR_COMPILE"
COMPILE_IGNORE_VERSION_ENV = "TORCHCOMMS_COMPILE_IGNORE_PYTORCH_VERSION_REQUIREMENT"

_VERSION = re.compile(
    r"^\s*v?(?P<release>\d+(?:\.\d+)*)"
    r"(?:[.-]?(?P<pre>a|b|rc|alpha|beta|c)(?P<pre_n>\d*))?"
    r"(?:[.-]?post(?P<post>\d*))?"
    r"(?:[.-]?dev(?P<dev>\d*))?"
    r"(?:\+[0-9a-zA-Z.]+)?\s*$",
    re.IGNORECASE,
)
_PRE_RANK = {"a": 0, "alpha": 0, "b": 1, "beta": 1, "c": 2, "rc": 2}
_FINAL = 3  # after every pre-release
_NO_DEV = 1 << 62  # a release without .dev sorts after all its dev releases


def _version_key(version: str) -> tuple[tuple[int, ...], tuple[int, int], int, int]:
    """A sort key ordering versions as PEP 440 does (for the forms torch uses)."""
    m = _VERSION.match(version)
    if m is None:
        raise ValueError(f"torchcomms.functional: not a version string: {version!r}")
    release = tuple(int(p) for p in m["release"].split("."))
    while len(release) > 1 and release[-1] == 0:
        release = release[:-1]  # 2.12 == 2.12.0
    pre, post, dev = m["pre"], m["post"], m["dev"]
    if pre is not None:
        pre_key = (_PRE_RANK[pre.lower()], int(m["pre_n"] or 0))
    elif dev is not None and post is None:
        pre_key = (-1, 0)  # 2.12.0.dev0 comes before 2.12.0a1
    else:
        pre_key = (_FINAL, 0)
    post_key = -1 if post is None else int(post or 0)
    dev_key = _NO_DEV if dev is None else int(dev or 0)
    return release, pre_key, post_key, dev_key


def is_torch_compile_supported(min_version: str, _current_version: str | None = None) -> bool:
    """True if torch (or ``_current_version``) is at least ``min_version``.

    ``TORCHCOMMS_COMPILE_IGNORE_PYTORCH_VERSION_REQUIREMENT=1`` makes it True regardless.
    """
    if config.compile_ignore_version():
        return True
    current = torch.__version__ if _current_version is None else _current_version
    return _version_key(str(current)) >= _version_key(min_version)


def is_torch_compile_supported_and_enabled(
    min_version: str = MIN_PYTORCH_VERSION_FOR_COMPILE, _current_version: str | None = None
) -> bool:
    """True if the version check passes and ``TORCHCOMMS_PATCH_FOR_COMPILE=1`` is set."""
    return config.compile_patch_enabled() and is_torch_compile_supported(
        min_version, _current_version
    )


def _install_if_enabled() -> bool:
    """Called once by ``torchcomms/__init__``: switch the compile path on if asked to."""
    if not is_torch_compile_supported_and_enabled():
        return False
    from torchcomms.functional import opaque

    opaque.install()
    return True
