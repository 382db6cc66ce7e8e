"""``torchcomms.hooks.nan_check``: ``NanCheckHook``, laid out as upstream ships it.

The hook lives in ``nan_check.nan_check`` (upstream's module path); this package re-exports
it.  Imports only its own module.
"""

from torchcomms.hooks.nan_check.nan_check import NanCheckHook

__all__ = ["NanCheckHook"]
