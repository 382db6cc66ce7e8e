"""Upstream's ``torchcomms.utils``: ``_store_manager`` (the stores a communicator bootstraps with).

Not imported by ``import torchcomms``; it may import ``backends.cpu.bootstrap`` (the stores'
bootstrap) and the core modules below ``TorchComm``, never the layers above it.
"""
