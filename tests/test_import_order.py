"""Import order never matters (issue 37, item 1).

PyTorch looks for torchcomms once, at ``import torch.distributed``, and turns its
``TORCH_DISTRIBUTED_USE_TORCHCOMMS`` bridge off for good if that look raises ``ImportError``.
Each case is a fresh interpreter (the look happens once per process) that imports one module
first, then creates the default group with explicit ranks (world 1, a ``HashStore``), runs an
all_reduce and reports the group type that carried it and whether the op went through a
communicator (a post-hook on ``get_comm()`` counts it):

* every first import (``torchcomms``, ``torchcomms.distwrap``, ``torchcomms.functional``,
  ``torchcomms.objcol``, ``torch.distributed``) with the switch on in the environment gives
  ``_BackendWrapper``, and with ``torch.distributed.config.use_torchcomms`` then set off, plain
  ``ProcessGroup`` (gloo); with the variable unset, the reverse (two first imports in the
  default run, the other three with ``-m slow``);
* a broken install (``torchcomms.objcol`` failing to import) seen by PyTorch first: the first
  ``init_process_group`` under the switch raises ``RuntimeError`` naming the cause, never a
  silent gloo group; a name of torchcomms that never got bound raises ``ImportError`` with it;
* PyTorch imported while torchcomms could not be found, torchcomms imported later: the bridge
  is switched on then (``_import_guard.redo_torch_look``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.harness import REPO_ROOT, timeout_scale

FIRST_IMPORTS = (
    "torchcomms",
    "torchcomms.distwrap",
    "torchcomms.functional",
    "torchcomms.objcol",
    "torch.distributed",
)

CASE = textwrap.dedent(
    """
    import sys
    FIRST = sys.argv[1]
    __import__(FIRST)
    import torch
    import torch.distributed as dist

    def run(use_torchcomms):
        dist.config.use_torchcomms = use_torchcomms
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
        world = dist.group.WORLD
        seen = []
        if type(world).__name__ == "_BackendWrapper":
            world.get_comm().register_post_hook(lambda *a: seen.append(1))
        t = torch.ones(4)
        dist.all_reduce(t)
        assert t.tolist() == [1.0] * 4
        kind = type(world).__name__
        dist.destroy_process_group()
        return f"{kind}:{bool(seen)}"

    first = run(dist.config.use_torchcomms)
    second = run(not dist.config.use_torchcomms)
    sys.stdout.write(f"RESULT {first} {second}\\n")
    """
)

BROKEN = textwrap.dedent(
    """
    import sys
    import importlib.abc

    class Broken(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "torchcomms.objcol":
                raise ImportError("simulated broken install: torchcomms.objcol is missing")
            return None

    sys.meta_path.insert(0, Broken())
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    assert c10d._TORCHCOMM_AVAILABLE, "the bridge must stay on, to say why it cannot run"
    try:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    except RuntimeError as exc:
        sys.stdout.write(f"INIT {exc}\\n")
    else:
        sys.stdout.write(f"INIT ran on {type(dist.group.WORLD).__name__}\\n")
    try:
        from torchcomms import CommTimeoutError  # noqa: F401 - bound after objcol
    except ImportError as exc:
        sys.stdout.write(f"IMPORT {exc}\\n")
    """
)

LATE = textwrap.dedent(
    """
    import sys
    import importlib.abc

    class Hidden(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "torchcomms" or name.startswith("torchcomms."):
                raise ImportError("not on the path yet")
            return None

    hidden = Hidden()
    sys.meta_path.insert(0, hidden)
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    before = c10d._TORCHCOMM_AVAILABLE
    sys.meta_path.remove(hidden)
    import torchcomms  # noqa: F401
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    t = torch.ones(2)
    dist.all_reduce(t)
    sys.stdout.write(f"LATE {before} {type(dist.group.WORLD).__name__} {t.tolist()}\\n")
    dist.destroy_process_group()
    """
)


def _run(code: str, *args: str, switch: bool = True) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISTRIBUTED_USE_TORCHCOMMS"}
    if switch:
        env["TORCH_DISTRIBUTED_USE_TORCHCOMMS"] = "1"
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120 * timeout_scale(),
                          check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return proc.stdout


#: With the switch off, the default run takes the two first imports furthest apart (ours and
#: PyTorch's); the other three are the ``-m slow`` cell.  Every interpreter also flips
#: ``use_torchcomms`` and checks the other state, so each cell sees both group types.
OFF_FIRST = ("torchcomms", "torch.distributed")


@pytest.mark.parametrize(
    ("switch", "firsts"),
    [
        (True, FIRST_IMPORTS),
        (False, OFF_FIRST),
        pytest.param(
            False,
            tuple(f for f in FIRST_IMPORTS if f not in OFF_FIRST),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["switch_on", "switch_off", "switch_off_other_imports"],
)
def test_every_import_order_gives_the_group_the_switch_asks_for(
    switch: bool, firsts: tuple[str, ...]
) -> None:
    with ThreadPoolExecutor(max_workers=2) as pool:  # two interpreters at a time: 2 cores
        outputs = list(pool.map(lambda first: _run(CASE, first, switch=switch), firsts))
    ours, plain = "_BackendWrapper:True", "ProcessGroup:False"
    want = f"RESULT {ours} {plain}" if switch else f"RESULT {plain} {ours}"
    got = {first: out.strip().splitlines()[-1] for first, out in zip(firsts, outputs, strict=True)}
    assert got == dict.fromkeys(firsts, want), got


def test_a_broken_install_is_said_never_a_silent_fallback() -> None:
    lines = _run(BROKEN).splitlines()
    init = next(line for line in lines if line.startswith("INIT"))
    assert "torchcomms failed to import" in init, init
    assert "torchcomms.objcol is missing" in init, init
    assert "TORCH_DISTRIBUTED_USE_TORCHCOMMS" in init, init
    imported = next(line for line in lines if line.startswith("IMPORT"))
    assert "torchcomms.objcol is missing" in imported, imported


def test_torchcomms_found_after_torch_distributed_switches_the_bridge_on() -> None:
    line = next(line for line in _run(LATE).splitlines() if line.startswith("LATE"))
    assert line == "LATE False _BackendWrapper [1.0, 1.0]", line


def test_every_name_this_release_imports_from_us_is_served_mid_import() -> None:
    """The installed release's own import block (read from its source) against what the
    package serves before its ``__init__`` has bound anything, and what the submodules hold."""
    import importlib

    from torch.distributed import distributed_c10d as c10d

    import torchcomms
    from torchcomms.bridge import import_guard as _import_guard

    block = _import_guard.torch_import_block(c10d)
    assert ("torchcomms", "new_comm", "new_comm") in block, block
    for module, name, _ in block:
        if module == "torchcomms":
            assert name in torchcomms._TORCH_LOOKS_UP_HERE, (name, block)
            served = importlib.import_module(torchcomms._TORCH_LOOKS_UP_HERE[name])
            assert getattr(served, name) is getattr(torchcomms, name), name
        else:
            assert getattr(importlib.import_module(module), name) is not None, (module, name)
    # what the release bound at its look is ours, under its own names (never PyTorch's own)
    for module, name, as_name in block:
        if (module, name) != ("torchcomms._backend_wrapper", "_BackendWrapper"):
            assert getattr(c10d, as_name) is getattr(importlib.import_module(module), name), as_name


TIMEOUTS = textwrap.dedent(
    """
    import sys
    from datetime import timedelta
    import torchcomms  # noqa: F401
    import torch.distributed as dist

    seen = []
    for given in (None, timedelta(seconds=33)):
        kwargs = {} if given is None else {"timeout": given}
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore(), **kwargs)
        seen.append(dist.group.WORLD.get_comm().get_options().timeout.total_seconds())
        dist.destroy_process_group()
    sys.stdout.write(f"TIMEOUTS {seen[0]:g} {seen[1]:g}\\n")
    """
)


def test_the_groups_timeout_reaches_the_comm_and_c10ds_default_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``init_process_group(timeout=...)`` reaches the communicator (``c10d_caller``); without
    one, c10d's own default (30 min) is not taken for a choice: ``TORCHCOMM_TIMEOUT_SECONDS``
    applies."""
    monkeypatch.setenv("TORCHCOMM_TIMEOUT_SECONDS", "77")
    line = next(line for line in _run(TIMEOUTS).splitlines() if line.startswith("TIMEOUTS"))
    assert line == "TIMEOUTS 77 33", line
