"""Backends: the objects that move bytes for a ``TorchComm``."""
