"""Small models and deterministic data shared by the distributed tests."""

from __future__ import annotations

import torch
from torch import nn


def mlp(seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 3)
    ).to(dtype)


def wide(seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Module:
    """Large gradients (a 512 x 512 layer): the reducer copies these in one by one, fused."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(10, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 3)
    ).to(dtype)


class ConvBN(nn.Module):
    """A conv net with BatchNorm: buffers that must be synchronized."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


def conv_bn(seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(seed)
    return ConvBN().to(dtype)


class Branchy(nn.Module):
    """A trunk and two heads; ``use`` picks the heads, so some parameters sit out some steps."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(10, 16)
        self.left = nn.Linear(16, 3)
        self.right = nn.Linear(16, 3)
        self.never = nn.Linear(16, 3)  # registered, never called when use excludes it

    def forward(self, x: torch.Tensor, use: str = "both") -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        out = torch.zeros(x.shape[0], 3, dtype=x.dtype)
        if use in ("left", "both"):
            out = out + self.left(h)
        if use in ("right", "both"):
            out = out + self.right(h)
        return out


def branchy(seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(seed)
    return Branchy().to(dtype)


class ShuffledOrder(nn.Module):
    """Registered a, b, c but used c, a, b: gradients become ready in an order that differs
    from reverse registration, which the bucket rebuild must pick up."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 4)
        self.c = nn.Linear(10, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(torch.tanh(self.c(x)))))


def batch(step: int, rank: int, size: int, shape: tuple[int, ...], dtype=torch.float64):
    """The batch rank ``rank`` sees at ``step``: inputs and class targets, seeded by both."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(size, *shape, generator=g, dtype=dtype)
    y = torch.randint(0, 3, (size,), generator=g)
    return x, y


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01)
    raise ValueError(name)


def max_diff(a: nn.Module, b: nn.Module) -> float:
    """Largest absolute difference over parameters and buffers of two same-shaped modules."""
    sa = a.state_dict()
    sb = b.state_dict()
    assert sa.keys() == sb.keys()
    return max(((sa[k].double() - sb[k].double()).abs().max().item() for k in sa), default=0.0)


def copied(value):
    """``value`` with every tensor in it (nested dicts and lists) detached and cloned: a state
    to compare later, unaffected by training on."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: copied(v) for k, v in value.items()}
    if isinstance(value, list):
        return [copied(v) for v in value]
    return value
