"""Compatibility module ``torchcomms._comms_gloo``: importing it registers the ``gloo`` backend."""

from __future__ import annotations

from torchcomms.backends.cpu.backend import TorchCommGloo
from torchcomms.registry import register_backend

register_backend("gloo", TorchCommGloo)

__all__ = ["TorchCommGloo"]
