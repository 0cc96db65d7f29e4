"""Classify wines (13 features -> 64 hidden units -> 3 classes) with tandem.DDP.

The data is scikit-learn's bundled wine set (178 samples, no download), split 70/30 with a fixed
seed and standardized with the training split's statistics. The same script runs on one process
and on many: ``tandem.init()`` reads the launcher's environment (and makes no process group for
a lone process), the sampler gives each rank its own slice of the training data, and tandem.DDP
averages the gradients so that every replica takes the same step.

Run::

    python -m tandem.examples.wine                                   # one process
    tandem run --nproc-per-node 2 -m tandem.examples.wine            # two processes
    tandem run --nproc-per-node 2 -m tandem.examples.wine --epochs 50 --batch-size 8

Each epoch rank 0 prints the training loss averaged over all ranks and the test accuracy; the
last line is ``final test accuracy A``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_wine
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import tandem


def load_data() -> tuple[TensorDataset, torch.Tensor, torch.Tensor]:
    """The training set, and the test features and labels, standardized and as tensors."""
    x, y = load_wine(return_X_y=True)
    # Stratified with a fixed seed: every rank (and every run) gets the same split, and each
    # class keeps its share in both halves of a data set this small.
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.3, stratify=y, random_state=0
    )
    # Statistics of the training split only: using the test split's would leak it into training.
    mean, std = x_train.mean(axis=0), x_train.std(axis=0)
    x_train, x_test = (x_train - mean) / std, (x_test - mean) / std

    def tensors(features: np.ndarray, labels: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(features, dtype=torch.float32), torch.tensor(labels, dtype=torch.long)

    return TensorDataset(*tensors(x_train, y_train)), *tensors(x_test, y_test)


def make_model() -> nn.Module:
    """13 -> 64 -> 3 with ReLU: logits for the three wine cultivars."""
    return nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, 3))


def global_mean(total: float, count: int, world_size: int) -> float:
    """Sum ``total`` and ``count`` over all ranks and divide: the mean over every sample seen."""
    sums = torch.tensor([total, float(count)], dtype=torch.float64)
    if world_size > 1:
        dist.all_reduce(sums)
    return (sums[0] / sums[1]).item()


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of ``x`` classified as ``y``."""
    model.eval()
    correct = (model(x).argmax(dim=1) == y).sum().item()
    model.train()
    return correct / len(y)


def main(argv: Sequence[str] | None = None) -> float:
    """Train, print one line per epoch on rank 0, and return the final test accuracy."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=16, help="samples per process and step")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args(argv)

    # Several processes on a few cores: one intra-op thread each, or they fight over the cores.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    tandem.init()
    try:
        w = tandem.world()
        train_set, x_test, y_test = load_data()
        # tandem.DDP copies rank 0's initial weights to every rank; the seed makes runs repeat.
        torch.manual_seed(0)
        net = make_model().to(w.device)
        model = tandem.DDP(net)  # one process: no collectives, the same code path
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        # Each rank reads a disjoint slice; the seed makes every rank shuffle the same way, so
        # the slices stay disjoint.
        sampler = DistributedSampler(
            train_set, num_replicas=w.world_size, rank=w.rank, shuffle=True, seed=0
        )
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
        if w.is_main:
            print(
                f"wine: {len(train_set)} training samples on {w.world_size} process(es), "
                f"{len(sampler)} per process, batch size {args.batch_size} per process",
                flush=True,
            )

        for epoch in range(1, args.epochs + 1):
            # A new shuffle each epoch; without this every epoch repeats the same order.
            sampler.set_epoch(epoch)
            total, count = 0.0, 0
            for x, y in loader:
                x, y = x.to(w.device), y.to(w.device)
                loss = F.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()  # .grad is now the mean over ranks
                optimizer.step()
                total += loss.item() * len(y)
                count += len(y)
            # Every rank must join the all-reduce, so this comes before the rank-0 check. (The
            # sampler pads the ranks to equal length, so a few samples may count twice.)
            train_loss = global_mean(total, count, w.world_size)
            if w.is_main:
                # The replicas are identical after each step, so rank 0's copy is the model;
                # the other ranks need not evaluate it.
                test_acc = accuracy(net, x_test.to(w.device), y_test.to(w.device))
                print(
                    f"epoch {epoch:3d}  loss {train_loss:.4f}  test accuracy {test_acc:.3f}",
                    flush=True,
                )

        # Every rank returns the same value (the replicas are identical), cheap at this size.
        final = accuracy(net, x_test.to(w.device), y_test.to(w.device))
        if w.is_main:
            print(f"final test accuracy {final:.3f}", flush=True)
        return final
    finally:
        tandem.shutdown()


if __name__ == "__main__":
    main()
