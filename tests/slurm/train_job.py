"""A tiny DDP training run that srun starts once per rank, with no launcher in between.

Each rank trains the same seeded model on its own batches with ``tandem.DDP`` and prints one
line: ``RANK r world W master HOST:PORT params SHA256 sum S``, where SHA256 hashes the
parameters' float64 bytes (equal on every rank only if every step was the same) and S is their
sum, which tests compare with one process trained on all ranks' batches.

    srun --ntasks=2 python tests/slurm/train_job.py
"""

from __future__ import annotations

import hashlib
import os

import torch

import tandem

STEPS = 5
BATCH = 16


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    ).double()


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s batches: different on every rank, so unsynchronised replicas would part."""
    generator = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(STEPS):
        x = torch.randn(BATCH, 8, generator=generator, dtype=torch.float64)
        out.append((x, x.sum(dim=1, keepdim=True).sin()))
    return out


def train(model: torch.nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in data:
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def flat_parameters(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()


def main() -> None:
    w = tandem.init(timeout=60.0)
    try:
        model = make_model()
        train(tandem.DDP(model), batches(w.rank))
        flat = flat_parameters(model)
        digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
        master = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        print(
            f"RANK {w.rank} world {w.world_size} master {master} params {digest} "
            f"sum {flat.sum().item()!r}",
            flush=True,
        )
    finally:
        tandem.shutdown()


if __name__ == "__main__":
    main()
