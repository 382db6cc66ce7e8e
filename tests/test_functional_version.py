"""``torchcomms.functional``'s switches: the version check and the two environment variables.

Single process: the helpers read the environment when called, so ``monkeypatch`` suffices.
"""

from __future__ import annotations

import pytest
import torch

from torchcomms import functional
from torchcomms.functional import (
    MIN_PYTORCH_VERSION_FOR_COMPILE,
    is_torch_compile_supported,
    is_torch_compile_supported_and_enabled,
)

PATCH = "TORCHCOMMS_PATCH_FOR_COMPILE"
IGNORE = "TORCHCOMMS_COMPILE_IGNORE_PYTORCH_VERSION_REQUIREMENT"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PATCH, raising=False)
    monkeypatch.delenv(IGNORE, raising=False)


def test_public_names() -> None:
    assert MIN_PYTORCH_VERSION_FOR_COMPILE == "2.12.0.dev0"
    assert functional.PATCH_FOR_COMPILE_ENV == PATCH
    assert functional.COMPILE_IGNORE_VERSION_ENV == IGNORE


@pytest.mark.parametrize(
    ("current", "supported"),
    [
        ("2.13.0+cpu", True),
        ("2.13.0", True),
        ("2.12.0", True),
        ("2.12", True),
        ("2.12.0.dev0", True),
        ("2.12.0.dev20260115+cu128", True),
        ("2.12.0a0+git1234abc", True),
        ("2.12.0rc1", True),
        ("2.12.1", True),
        ("3.0.0", True),
        ("2.11.0", False),
        ("2.11.9.post3", False),
        ("2.11.0+cu126", False),
        ("2.8.0", False),
        ("1.13.1", False),
    ],
)
def test_version_against_the_minimum(current: str, supported: bool) -> None:
    assert is_torch_compile_supported(MIN_PYTORCH_VERSION_FOR_COMPILE, current) is supported


@pytest.mark.parametrize(
    ("lower", "higher"),
    [
        ("2.12.0.dev0", "2.12.0.dev1"),
        ("2.12.0.dev5", "2.12.0a1"),
        ("2.12.0a1", "2.12.0b1"),
        ("2.12.0b2", "2.12.0rc1"),
        ("2.12.0rc1", "2.12.0"),
        ("2.12.0", "2.12.0.post1"),
        ("2.12.0.post1", "2.12.1.dev0"),
        ("2.9.0", "2.10.0"),
    ],
)
def test_pep440_order(lower: str, higher: str) -> None:
    assert is_torch_compile_supported(lower, higher)
    assert not is_torch_compile_supported(higher, lower)


def test_default_is_the_installed_torch() -> None:
    expected = functional._version_key(torch.__version__) >= functional._version_key("2.12.0.dev0")
    assert is_torch_compile_supported(MIN_PYTORCH_VERSION_FOR_COMPILE) is expected


def test_not_a_version() -> None:
    with pytest.raises(ValueError, match="not a version string: 'nightly'"):
        is_torch_compile_supported("2.12.0", "nightly")


def test_ignore_the_version_requirement(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not is_torch_compile_supported("2.12.0", "2.8.0")
    monkeypatch.setenv(IGNORE, "1")
    assert is_torch_compile_supported("2.12.0", "2.8.0")
    monkeypatch.setenv(IGNORE, "0")
    assert not is_torch_compile_supported("2.12.0", "2.8.0")


@pytest.mark.parametrize(("value", "on"), [("1", True), ("true", True), ("0", False), ("", False)])
def test_enabled_needs_the_patch_flag(
    monkeypatch: pytest.MonkeyPatch, value: str, on: bool
) -> None:
    monkeypatch.setenv(PATCH, value)
    assert is_torch_compile_supported_and_enabled(_current_version="2.13.0") is on
    # an old torch is never enabled, unless the version requirement is ignored
    assert is_torch_compile_supported_and_enabled(_current_version="2.8.0") is False
    monkeypatch.setenv(IGNORE, "1")
    assert is_torch_compile_supported_and_enabled(_current_version="2.8.0") is on


def test_unset_in_this_process() -> None:
    """The pytest process imported torchcomms without the flag: nothing was installed."""
    from torchcomms.comm import communicator as comm

    assert comm._comm_class is comm.TorchComm
    assert not hasattr(torch.ops.torchcomms, "torchcomm_all_reduce_")
