"""Entry point: ``python -m torchcomms.bench`` (also under ``torchrun -m torchcomms.bench``)."""

from __future__ import annotations

import sys

from torchcomms.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
