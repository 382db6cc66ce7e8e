"""Shared pieces of the training examples: a tiny model, deterministic data, a reference.

The distributed examples and the parity tests use the same model, data and optimiser, so
a single-process run over the concatenated global batch (``reference``) must reproduce the
distributed losses and parameters up to floating-point summation order.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

IN, HIDDEN, OUT = 16, 32, 8
PER_RANK_BATCH = 8
LR = 0.1


class TinyMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def build_model() -> TinyMLP:
    torch.manual_seed(0)
    return TinyMLP()


def batch(step: int, shard: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch data-parallel shard ``shard`` trains on at ``step``."""
    g = torch.Generator().manual_seed(1000 * step + shard)
    x = torch.randn(PER_RANK_BATCH, IN, generator=g)
    y = torch.randn(PER_RANK_BATCH, OUT, generator=g)
    return x, y


def reference(steps: int, shards: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training on every shard's batch at once: losses and final parameters."""
    model = build_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        xs, ys = zip(*(batch(step, s) for s in range(shards)), strict=True)
        loss = nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def write_result(path: str, losses: list[float], params: dict[str, torch.Tensor]) -> None:
    Path(path).write_text(
        json.dumps(
            {"losses": losses, "params": {k: v.flatten().tolist() for k, v in params.items()}}
        )
    )


def read_result(path: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    data = json.loads(Path(path).read_text())
    return data["losses"], {k: torch.tensor(v) for k, v in data["params"].items()}
