"""Test support shipped inside distwrap, at the dotted paths upstream's distwrap tests import.

Owns ``integration.test_helpers``.  Imports only ``torch``, the standard library and
``torchcomms.distwrap``; nothing in torchcomms imports it.
"""
