"""Tests shipped inside distwrap, at the dotted paths upstream's distwrap tests use.

Owns ``integration`` (``test_helpers`` and our ``ImportOrderTest``).  Imports only ``torch``,
the standard library and ``torchcomms``; nothing in torchcomms imports it.
"""
