"""Launched jobs that several tests share: one launch, many checks (see ``torchrun_suite``).

``torchrun_scripts_4()`` runs, in one 4-rank torchrun job, ``examples/quickstart.py``,
``STORELESS_SCRIPT`` below, ``examples/window_weight_sync.py`` and the benchmark's entry
point (``BENCH_ARGS``, as ``torchrun -m torchcomms.bench`` runs it).  The first test that
asks pays for the launch, the others read the same result.  A failure shows the whole job's
output in every test that shares it.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import subprocess
import tempfile
import textwrap
from pathlib import Path

from tests.harness import REPO_ROOT, run_torchrun

EXAMPLES = Path(REPO_ROOT) / "examples"
SUITE = Path(REPO_ROOT) / "tests" / "torchrun_suite.py"
NPROC = 4


#: Store-less comms under torchrun: two comms at once, a split, a finalized name created
#: again (``test_bootstrap.test_storeless_comms_and_split_under_torchrun`` checks its files).
STORELESS_SCRIPT = """
import json
import os
import sys

import torch

from torchcomms import ReduceOp, new_comm

env = {k: os.environ.get(k) for k in ("TORCHELASTIC_USE_AGENT_STORE", "MASTER_PORT", "RANK")}
first = new_comm("gloo", torch.device("cpu"), name="first")
second = new_comm("gloo", torch.device("cpu"), name="second")
rank, size = first.get_rank(), first.get_size()
a = torch.full((4,), rank + 1, dtype=torch.int64)
first.all_reduce(a, ReduceOp.SUM, False)
b = torch.full((4,), 10 * (rank + 1), dtype=torch.int64)
second.all_reduce(b, ReduceOp.SUM, False)
evens = second.split([r for r in range(size) if r % 2 == 0] if rank % 2 == 0 else [], "evens")
even_sum = None
if evens is not None:
    e = torch.tensor([rank], dtype=torch.int64)
    evens.all_reduce(e, ReduceOp.SUM, False)
    even_sum = int(e.item())
    evens.finalize()
first.finalize()
again = new_comm("gloo", torch.device("cpu"), name="first")  # a finalized name, recreated
c = torch.tensor([rank], dtype=torch.int64)
again.all_reduce(c, ReduceOp.MAX, False)
result = {
    "rank": rank, "size": size, "env": env, "first": a.tolist(), "second": b.tolist(),
    "even_sum": even_sum, "again_max": int(c.item()),
}
# One file per rank: lines printed by several ranks into one pipe can interleave.
with open(os.path.join(sys.argv[1], f"result{rank}.json"), "w") as f:
    json.dump(result, f)
again.finalize()
second.finalize()
"""


#: The benchmark's arguments in the shared job; its JSON goes to ``<out_dir>/bench.json``.
BENCH_ARGS = ("--quick", "--op", "all_reduce,sendrecv", "-e", "256", "--vs", "gloo")


@functools.cache
def torchrun_scripts_4() -> tuple[subprocess.CompletedProcess[str], Path]:
    """The shared 4-rank job: its output, and the directory the scripts wrote to."""
    work = Path(tempfile.mkdtemp(prefix="torchcomms-shared-job-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    script = work / "storeless_torchrun.py"
    script.write_text(textwrap.dedent(STORELESS_SCRIPT))
    out_dir = work / "results"
    out_dir.mkdir()
    args = [
        str(SUITE),
        str(EXAMPLES / "quickstart.py"),
        "---",
        str(script),
        str(out_dir),
        "---",
        str(EXAMPLES / "window_weight_sync.py"),
        "---",
        str(Path(REPO_ROOT) / "src" / "torchcomms" / "bench" / "__main__.py"),
        *BENCH_ARGS,
        "--json",
        str(out_dir / "bench.json"),
    ]
    return run_torchrun(args, nproc=NPROC, timeout=240.0), out_dir
