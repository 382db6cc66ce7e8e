"""Command-line tools: ``python -m torchcomms.tools.fr DIR`` (flight-recorder report)."""
