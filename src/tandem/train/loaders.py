"""The Trainer's data loaders: each rank's training shard, exact evaluation, reproducible seeds.

Training data goes through :class:`tandem.data.DistributedSampler` (torch's order, resumable
mid-epoch), evaluation through :class:`tandem.data.EvalSampler` (every sample once, no padding).

Both loaders own a generator. A DataLoader draws a seed for its workers each time an iterator
is made, from the global torch generator unless it has its own; the global generator is the one
dropout draws from, so a resumed run, which makes its first iterator at a different point than
the uninterrupted run did, would draw different masks from then on. The generators are
reseeded each epoch from (seed, epoch, rank), so worker seeds are the same in a run and in its
resumption.

Worker processes (``num_workers > 0``): torch seeds each worker's torch, ``random`` and NumPy
generators from that base seed and the worker's id, so they are deterministic. A worker's
random transforms still repeat after a *mid-epoch* resume only if they are seeded per sample
(say from ``(seed, epoch, index)``): the resumed workers start the epoch's seeds afresh, where
the uninterrupted run's workers had already drawn for the batches before the checkpoint.
"""

from __future__ import annotations

import hashlib
import signal
from collections.abc import Callable, Iterator, Sized
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.utils.data import DataLoader, Dataset

from tandem._profile import span
from tandem.data.eval_sampler import EvalSampler
from tandem.data.sampler import DistributedSampler
from tandem.world import World


def loader_seed(seed: int, epoch: int, rank: int, kind: str = "train") -> int:
    """A loader's generator seed in ``epoch`` on ``rank``: a function of these only."""
    digest = hashlib.sha256(f"tandem-loader/{kind}/{seed}/{epoch}/{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # non-negative int64


def _quiet_worker(worker_id: int) -> None:
    # A launcher signals whole process groups: SIGUSR1's default action would kill the loader
    # workers, and SIGTERM is the main process's to act on (it stops its workers itself).
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


@dataclass
class Loaders:
    """A rank's training and evaluation loaders (see :func:`make_loaders`)."""

    sampler: DistributedSampler
    train: DataLoader
    eval_sampler: EvalSampler | None
    eval: DataLoader | None
    seed: int
    rank: int

    def epoch(self, epoch: int) -> Iterator[Any]:
        """The training batches of ``epoch`` still to come (all of them unless resuming)."""
        # A new shuffle each epoch; a position loaded from a checkpoint survives this call.
        self.sampler.set_epoch(epoch)
        return self._iter(self.train, loader_seed(self.seed, epoch, self.rank), "train")

    def eval_batches(self, epoch: int) -> Iterator[Any]:
        """This rank's evaluation batches, after ``epoch`` epochs of training."""
        assert self.eval is not None, "no evaluation data"
        return self._iter(self.eval, loader_seed(self.seed, epoch, self.rank, "eval"), "eval")

    @staticmethod
    def _iter(loader: DataLoader, seed: int, kind: str) -> Iterator[Any]:
        assert loader.generator is not None  # make_loaders gives each loader its own
        loader.generator.manual_seed(seed)
        return _loading(iter(loader), kind)


_END = object()


def _loading(batches: Iterator[Any], kind: str) -> Iterator[Any]:
    """``batches``, each one's loading a ``tandem.train.data`` span (profiler, trace)."""
    while True:
        with span("tandem.train.data", kind):
            batch = next(batches, _END)
        if batch is _END:
            return
        yield batch


def make_loaders(
    world: World,
    train_data: Dataset,
    eval_data: Dataset | None,
    *,
    batch_size: int,
    eval_batch_size: int,
    seed: int,
    drop_last: bool,
    num_workers: int,
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> Loaders:
    """Build this rank's loaders.

    Args:
        world: this process's place (rank and world size shard the data).
        train_data: the training set.
        eval_data: the evaluation set, or None.
        batch_size: training samples per rank per batch.
        eval_batch_size: evaluation samples per rank per batch.
        seed: the sampler's shuffle seed and the base of the loader seeds.
        drop_last: cut the training set's tail instead of padding the ranks' shares.
        num_workers: worker processes per loader (0: load in this process).
        collate_fn: makes a batch of a list of samples, for both loaders (torch's default
            stacks tensors): a tokenizer's padding, a dataclass or any object a
            ``training_step`` takes. It runs in the worker processes when there are any.

    Example::

        loaders = make_loaders(tandem.world(), train_set, test_set, batch_size=32,
                               eval_batch_size=256, seed=0, drop_last=False, num_workers=0)
        for x, y in loaders.epoch(0):
            ...
    """
    workers: dict[str, Any] = {"num_workers": num_workers, "collate_fn": collate_fn}
    if num_workers:
        workers["worker_init_fn"] = _quiet_worker
    sampler = DistributedSampler(
        cast(Sized, train_data),
        world.world_size,
        world.rank,
        shuffle=True,
        seed=seed,
        drop_last=drop_last,
    )
    train = DataLoader(
        train_data, batch_size, sampler=sampler, generator=torch.Generator(), **workers
    )
    eval_sampler = eval_loader = None
    if eval_data is not None:
        eval_sampler = EvalSampler(cast(Sized, eval_data), world.world_size, world.rank)
        eval_loader = DataLoader(
            eval_data,
            eval_batch_size,
            sampler=eval_sampler,
            generator=torch.Generator(),
            **workers,
        )
    return Loaders(sampler, train, eval_sampler, eval_loader, seed, world.rank)
