"""Command-line tools: ``python -m torchcomms.tools.fr DIR`` (flight-recorder report).

At the edge: a tool may import anything of ``torchcomms``; nothing imports it back.  ``fr``
reads dump files only, so it imports nothing of the library (a report needs no communicator).
"""
