"""Run a diagnostics script as a few local ranks that bootstrap through a FileStore."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile


def run_local_ranks(script: str, child_flag: str, size: int = 2) -> int:
    """Start ``size`` copies of ``script`` (same arguments) as ranks of one comm, with
    ``child_flag`` set in their environment; the worst exit status."""
    store = os.path.join(tempfile.mkdtemp(), "store")
    procs = [
        subprocess.Popen(
            [sys.executable, script, *sys.argv[1:]],
            env={
                **os.environ,
                child_flag: "1",
                "TORCHCOMM_RANK": str(rank),
                "TORCHCOMM_SIZE": str(size),
                "TORCHCOMM_STORE_PATH": store,
            },
        )
        for rank in range(size)
    ]
    return max(p.wait() for p in procs)
