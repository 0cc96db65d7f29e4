"""Classify handwritten digits (8x8 images, 10 classes) with a small CNN and the tandem Trainer.

The data is scikit-learn's bundled digits set (1797 images, no download), split 70/30 with a
fixed seed, pixels scaled to [0, 1]. The network has two 3x3 convolutions, a pooling layer and
a dropout layer, so the run draws random numbers every step: a checkpoint carries every rank's
generator states, and a resumed run draws the same dropout masks as the uninterrupted one.

Run::

    python -m tandem.examples.digits                                 # one process
    tandem run --nproc-per-node 2 -m tandem.examples.digits          # two processes
    tandem run --nproc-per-node 2 -m tandem.examples.digits --resume latest

Each epoch rank 0 prints the training loss averaged over all ranks and the test accuracy; the
last line is ``final test accuracy A``. Checkpoints (every ``--save-every`` epochs, and on
SIGTERM or SIGUSR1), ``metrics.jsonl`` and ``metrics.png`` go to ``--run-dir``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence, Sized

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import TensorDataset

from tandem.examples.common import run_example
from tandem.train.trainer import Trainer


def load_data() -> tuple[TensorDataset, TensorDataset]:
    """Training and test sets of (1x8x8 image in [0, 1], label)."""
    x, y = load_digits(return_X_y=True)
    # Stratified with a fixed seed: every rank (and every run) gets the same split.
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.3, stratify=y, random_state=0
    )

    def dataset(features, labels) -> TensorDataset:
        # Pixels are 0..16 in this data set.
        images = torch.tensor(features, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16
        return TensorDataset(images, torch.tensor(labels, dtype=torch.long))

    return dataset(x_train, y_train), dataset(x_test, y_test)


def make_model() -> nn.Module:
    """conv 16 -> conv 32 -> pool -> 64 -> dropout -> 10 logits."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 8x8 -> 4x4
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Dropout(0.25),
        nn.Linear(64, 10),
    )


def build(args: argparse.Namespace) -> tuple[Trainer, Sized]:
    """The Trainer for these arguments, and the training set it shards."""
    train_set, test_set = load_data()
    torch.manual_seed(0)  # the same initial weights in every run
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    trainer = Trainer(
        model,
        optimizer,
        train_set,
        loss_fn=F.cross_entropy,
        eval_data=test_set,
        max_epochs=args.epochs,
        save_every=args.save_every,
        batch_size=args.batch_size,
        run_dir=args.run_dir,
        # The learning rate falls to 0 over the run (stepped each epoch, saved in checkpoints).
        scheduler=torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs),
        resume=args.resume,
    )
    return trainer, train_set


def main(argv: Sequence[str] | None = None) -> float | None:
    """Train, print one line per epoch on rank 0, and return the final test accuracy."""
    return run_example("digits", build, argv, epochs=15, batch_size=16, lr=3e-3)


if __name__ == "__main__":
    main()
