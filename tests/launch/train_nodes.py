"""A tiny data-parallel job for the many-node tests: run by a launcher, it prints one line per rank.

Every rank builds the same seeded model, trains it for a few SGD steps with ``tandem.DDP`` on its
own slice of one seeded data set, then prints::

    RANK r LOCAL l WORLD w NODE n HASH <sha256 of the parameters as float64> MAXDIFF d

Identical hashes on every rank say the replicas stayed in step. ``MAXDIFF`` is the largest
difference from the same model trained by this process alone on the whole data set (all ranks'
slices as one batch): equal batch sizes make the mean of the ranks' mean gradients the gradient
of the whole batch's mean loss, so a small MAXDIFF says the gradients really were averaged over
all ``w`` ranks, not over a smaller group that happened to agree with itself.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

import tandem

SEED = 0
PER_RANK = 8
FEATURES = 6
STEPS = 5
LR = 0.1


def make_model() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))


def make_data(world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole data set; rank r trains on rows [r * PER_RANK, (r + 1) * PER_RANK)."""
    g = torch.Generator().manual_seed(SEED + 1)
    x = torch.randn(world_size * PER_RANK, FEATURES, generator=g)
    y = torch.randn(world_size * PER_RANK, 1, generator=g)
    return x, y


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(STEPS):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def params_hash(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().to(torch.float64).contiguous().numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    # Four ranks and two launchers share the test machine's cores: one thread each.
    torch.set_num_threads(1)
    w = tandem.init()
    x, y = make_data(w.world_size)
    rows = slice(w.rank * PER_RANK, (w.rank + 1) * PER_RANK)

    model = tandem.DDP(make_model())
    train(model, x[rows], y[rows])

    alone = make_model()
    train(alone, x, y)
    maxdiff = max(
        (p - q).abs().max().item()
        for p, q in zip(model.module.parameters(), alone.parameters(), strict=True)
    )
    print(
        f"RANK {w.rank} LOCAL {w.local_rank} WORLD {w.world_size} NODE {w.node_rank} "
        f"HASH {params_hash(model.module)} MAXDIFF {maxdiff:.3e}",
        flush=True,
    )
    tandem.shutdown()


if __name__ == "__main__":
    main()
