"""A few training steps of an in-process DDP model (the unit tests' one-rank gloo group)."""

from __future__ import annotations

import torch
from torch import nn

STEPS = 5


def train(model: nn.Module, steps: int = STEPS) -> None:
    """``steps`` SGD steps of mean squared error on a fixed random stream (32 in, 8 out)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(
            model(torch.randn(16, 32, generator=g)), torch.randn(16, 8, generator=g)
        ).backward()
        opt.step()
