"""Classify wines (13 features -> 64 hidden units -> 3 classes) with the tandem Trainer.

The data is scikit-learn's bundled wine set (178 samples, no download), split 70/30 with a fixed
seed and standardized with the training split's statistics. The same script runs on one process
and on many: the Trainer wraps the model in tandem.DDP when there is more than one rank, gives
each rank its own slice of the training data (a new shuffle every epoch), and evaluates the
test split exactly (every sample once over all ranks).

Run::

    python -m tandem.examples.wine                                   # one process
    tandem run --nproc-per-node 2 -m tandem.examples.wine            # two processes
    tandem run --nproc-per-node 2 -m tandem.examples.wine --epochs 50 --batch-size 8
    tandem run --nproc-per-node 2 -m tandem.examples.wine --resume latest   # continue a run

Each epoch rank 0 prints the training loss averaged over all ranks and the test accuracy; the
last line is ``final test accuracy A``. Checkpoints (every ``--save-every`` epochs, and on
SIGTERM or SIGUSR1), ``metrics.jsonl`` and ``metrics.png`` go to ``--run-dir``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_wine
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import TensorDataset

from tandem.examples.common import run_example
from tandem.train.trainer import Trainer


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


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of ``x`` classified as ``y`` (one process, the whole set)."""
    model.eval()
    correct = (model(x).argmax(dim=1) == y).sum().item()
    model.train()
    return correct / len(y)


def build(args: argparse.Namespace) -> tuple[Trainer, TensorDataset]:
    """The Trainer for these arguments, and the training set it shards."""
    train_set, x_test, y_test = load_data()
    # The same initial weights on every rank and in every run (tandem.DDP would copy rank
    # 0's anyway); a resumed run replaces them with the checkpoint's.
    torch.manual_seed(0)
    model = make_model()
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
        train_set,
        loss_fn=F.cross_entropy,
        eval_data=TensorDataset(x_test, y_test),
        max_epochs=args.epochs,
        save_every=args.save_every,
        batch_size=args.batch_size,
        run_dir=args.run_dir,
        resume=args.resume,
    )
    return trainer, train_set


def main(argv: Sequence[str] | None = None) -> float | None:
    """Train, print one line per epoch on rank 0, and return the final test accuracy."""
    return run_example("wine", build, argv, epochs=30, batch_size=16, lr=0.05)


if __name__ == "__main__":
    main()
