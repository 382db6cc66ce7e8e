"""torchft integration that lives in this package: ``RdmaCheckpointTransport``, torchft's
``CheckpointTransport`` over ``torchcomms._transport`` (``checkpoint``).

Needs torchft (``pip install --no-deps torchft-nightly``); importing this package without it
raises an ``ImportError`` that says so.
"""

from __future__ import annotations

try:
    import torchft.checkpointing.transport  # noqa: F401  (the interface implemented here)
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "torchcomms.ft needs torchft: pip install --no-deps torchft-nightly (see the README)"
    ) from exc

from torchcomms.ft.checkpoint import RdmaCheckpointTransport

__all__ = ["RdmaCheckpointTransport"]
