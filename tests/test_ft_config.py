"""The fault-model switches and the mismatch text, without spawning ranks."""

from __future__ import annotations

import pytest
import torch

from torchcomms import ReduceOp, config
from torchcomms.runtime import fingerprint as F


def test_liveness_period_and_mismatch_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHCOMM_LIVENESS_PERIOD_MS", raising=False)
    assert config.liveness_period_s() == 0.05
    monkeypatch.setenv("TORCHCOMM_LIVENESS_PERIOD_MS", "200")
    assert config.liveness_period_s() == 0.2
    monkeypatch.setenv("TORCHCOMM_LIVENESS_PERIOD_MS", "0")
    with pytest.raises(ValueError, match="TORCHCOMM_LIVENESS_PERIOD_MS must be > 0, got 0"):
        config.liveness_period_s()
    monkeypatch.delenv("TORCHCOMM_MISMATCH_CHECK", raising=False)
    assert config.mismatch_check() is True
    monkeypatch.setenv("TORCHCOMM_MISMATCH_CHECK", "0")
    assert config.mismatch_check() is False


def test_mismatch_names_the_field_and_the_minority() -> None:
    same = F.make(F.BROADCAST, torch.int64, 4, root=0)
    odd = F.make(F.BROADCAST, torch.int64, 4, root=1)
    assert F.mismatch([(same, 3)] * 4) is None
    found = F.mismatch([(same, 3), (odd, 3), (same, 3), (same, 3)])
    assert found == ([1], "rank 1 passed root=1, ranks 0, 2, 3 root=0")
    ar = F.make(F.ALL_REDUCE, torch.float32, 8, redop=ReduceOp.SUM)
    mx = F.make(F.ALL_REDUCE, torch.float32, 8, redop=ReduceOp.MAX)
    assert F.mismatch([(ar, 1), (mx, 1)]) == (
        [1],
        "rank 1 passed reduce_op=MAX, rank 0 reduce_op=SUM",
    )
    assert F.mismatch([(ar, 1), (ar, 2)]) == ([1], "rank 1 passed seq=2, rank 0 seq=1")
