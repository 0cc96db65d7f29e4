"""What every example shares: its command line, and running a Trainer with the printed report.

The report's lines are what the example tests parse: a header on rank 0, one line per epoch
(printed by the Trainer), and ``final test accuracy A``.

Example::

    def build(args):
        ...
        return Trainer(...), train_set

    def main(argv=None):
        return run_example("wine", build, argv, epochs=30, batch_size=16, lr=0.05)
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence, Sized
from typing import TYPE_CHECKING

import torch

import tandem

if TYPE_CHECKING:
    from tandem.train.trainer import Trainer


def parse_args(
    argv: Sequence[str] | None, name: str, *, epochs: int, batch_size: int, lr: float
) -> argparse.Namespace:
    """The examples' command line, with this example's defaults."""
    parser = argparse.ArgumentParser(description=f"Train the {name} example with tandem.")
    parser.add_argument("--epochs", type=int, default=epochs)
    parser.add_argument("--batch-size", type=int, default=batch_size, help="per process and step")
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--run-dir", default=f"runs/{name}", help="checkpoints and metrics")
    parser.add_argument("--save-every", type=int, default=10, help="checkpoint every N epochs")
    parser.add_argument(
        "--resume", default=None, help="'latest' (of --run-dir) or a checkpoint path"
    )
    return parser.parse_args(argv)


def run_example(
    name: str,
    build: Callable[[argparse.Namespace], tuple[Trainer, Sized]],
    argv: Sequence[str] | None,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
) -> float | None:
    """Parse the command line, build the Trainer, train, report; return the test accuracy."""
    args = parse_args(argv, name, epochs=epochs, batch_size=batch_size, lr=lr)
    # Several processes on a few cores: one intra-op thread each, or they fight over the cores.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    w = tandem.init()
    try:
        trainer, train_set = build(args)
        if w.is_main:
            print(
                f"{name}: {len(train_set)} training samples on {w.world_size} process(es), "
                f"{len(trainer.sampler)} per process, batch size {args.batch_size} per process",
                flush=True,
            )
        summary = trainer.train()
        if w.is_main and summary.stopped_by is None and summary.eval_accuracy is not None:
            print(f"final test accuracy {summary.eval_accuracy:.3f}", flush=True)
        return summary.eval_accuracy
    finally:
        tandem.shutdown()
