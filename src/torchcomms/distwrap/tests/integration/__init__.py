"""Helpers for distwrap integration tests run under torchrun (upstream's module path).

Owns ``test_helpers``.  Imports only ``torch``, the standard library and
``torchcomms.distwrap``.
"""
