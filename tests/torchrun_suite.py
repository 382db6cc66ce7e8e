"""Several scripts in one torchrun job: each rank runs them in order, in one process.

A torchrun job on a 2-core box spends most of its time starting interpreters (importing
torch takes about 2 s per process).  Scripts that can share a world run as one job
(``tests/shared_jobs.py``) and each test checks its own script's part of the output.

    python tests/torchrun_suite.py SCRIPT [ARG ...] [--- SCRIPT [ARG ...]] ...

Each script runs as ``__main__`` with its own ``sys.argv`` and its directory first on
``sys.path``, between ``[suite] start NAME`` and ``[suite] done NAME`` lines; a script that
raises or exits non-zero ends the job with that error, so the remaining scripts do not run.
An entry ``@use_torchcomms=0`` (or ``=1``) sets ``torch.distributed.config.use_torchcomms``
for the scripts after it: what ``TORCH_DISTRIBUTED_USE_TORCHCOMMS`` sets at import.
"""

from __future__ import annotations

import os
import runpy
import sys

SEPARATOR = "---"
MARK = "[suite]"


def jobs(argv: list[str]) -> list[list[str]]:
    """``a x --- b`` -> ``[["a", "x"], ["b"]]``."""
    out: list[list[str]] = [[]]
    for arg in argv:
        if arg == SEPARATOR:
            out.append([])
        else:
            out[-1].append(arg)
    return [job for job in out if job]


def main(argv: list[str]) -> None:
    rank = os.environ.get("RANK", "?")
    for script, *args in jobs(argv):
        if script.startswith("@use_torchcomms="):
            import torch.distributed

            torch.distributed.config.use_torchcomms = script.endswith("=1")
            continue
        name = os.path.basename(script)
        print(f"{MARK} start {name} rank {rank}", flush=True)
        sys.argv = [script, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            if exc.code not in (None, 0):
                print(f"{MARK} failed {name} rank {rank}: exit {exc.code}", flush=True)
                raise
        finally:
            sys.path.pop(0)
        print(f"{MARK} done {name} rank {rank}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
