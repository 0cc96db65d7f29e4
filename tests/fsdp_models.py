"""Small models shared by the FullyShardedDataParallel tests (one process and several ranks)."""

from __future__ import annotations

import itertools

import torch
from torch import nn


def seeded(cls, *args, seed: int = 0) -> nn.Module:
    """``cls(*args)`` built right after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return cls(*args)


class Net(nn.Module):
    """A root parameter, a Linear, a nested bias-free Linear and a buffer (state_dict order:
    offset, shift, inp.weight, inp.bias, block.0.weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.offset = nn.Parameter(0.1 * torch.randn(3))
        self.inp = nn.Linear(6, 5)
        self.block = nn.Sequential(nn.Linear(5, 3, bias=False), nn.Tanh())
        self.register_buffer("shift", torch.arange(3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(torch.tanh(self.inp(x))) + self.offset + self.shift


class MLP(nn.Module):
    """Linears of the given widths (bias or not) nested in a Sequential, and a root scale."""

    def __init__(self, widths: list[int], biases: list[bool]) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for (a, b), bias in zip(itertools.pairwise(widths), biases, strict=False):
            layers += [nn.Linear(a, b, bias=bias), nn.Tanh()]
        self.body = nn.Sequential(*layers)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, widths[-1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale
