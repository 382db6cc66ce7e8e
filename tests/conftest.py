"""Pytest glue for the multi-process harness (see ``tests/harness.py``).

The package is normally installed with ``pip install -e .``, but a bare checkout must work
too, so the repository root (for ``tests.*``, which workers import functions from) and
``src/`` (for ``torchcomms``) are put on ``sys.path`` before anything imports them.
"""

from __future__ import annotations

import os
import sys

import pytest

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (os.path.join(_REPO_ROOT, "src"), _REPO_ROOT):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from tests import harness  # noqa: E402  (needs the sys.path set-up above)

# Tests catch timeouts and peer failures; with upstream's default (on) the library ends the
# process instead.  Set before any worker is spawned, so every rank and torchrun child
# inherits it; a test of the process-ending path passes TORCHCOMM_ABORT_ON_ERROR=1 itself.
os.environ["TORCHCOMM_ABORT_ON_ERROR"] = "0"
# c10d's TCPStore looks up the name of every address it connects to (a reverse query for the
# IPv4-mapped loopback address, which /etc/hosts does not answer).  The resolver of the
# sandboxes we run in drops one query in tens to hundreds, and glibc waits 5 s before its
# retry: a store-less communicator churn of 50 bootstraps spent 5-80 s in these stalls.
# What is tested is unchanged; a dropped query costs 1 s instead.  A job's own setting wins.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")


def pytest_configure(config: pytest.Config) -> None:
    """Fail at start-up, not in the middle of a run, on a malformed timeout scale."""
    try:
        harness.timeout_scale()
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_report_header(config: pytest.Config) -> str:
    return f"torchcomms harness: TORCHCOMM_TEST_TIMEOUT_SCALE={harness.timeout_scale():g}"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop pooled workers while pytest still owns the terminal (atexit is the fallback)."""
    harness.shutdown()


@pytest.fixture
def timeout_scale() -> float:
    """``TORCHCOMM_TEST_TIMEOUT_SCALE``, for tests that compute their own time limits."""
    return harness.timeout_scale()


#: Markers whose tests run only when ``-m`` names them, with the skip reason otherwise.
_OPT_IN = {
    "chaos": "the long fault matrix: run it with -m chaos",
    "compile_matrix": "the full torch.compile matrix (about 5.5 min): run it with -m compile_matrix",
    "slow": "a longer variant of a check the default run makes: run it with -m slow",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``chaos``, ``compile_matrix`` and ``slow`` tests run only when ``-m`` names them."""
    markexpr = config.option.markexpr or ""
    for marker, reason in _OPT_IN.items():
        if marker in markexpr:
            continue
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            if item.get_closest_marker(marker) is not None:
                item.add_marker(skip)
