"""The Trainer's loaders pass a ``collate_fn`` through, so any batch type reaches a step.

Proven (one process): with a ``collate_fn`` that builds a dataclass, every training and
evaluation batch of :func:`tandem.train.loaders.make_loaders` is that dataclass, holding the
samples the samplers deal, in their order; without one, torch's default collation stacks them
as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.train.loaders import make_loaders
from tandem.world import World

ONE = World(0, 0, 1, 1, 0, None, torch.device("cpu"), True)


@dataclass
class Batch:
    ids: torch.Tensor
    text: list[str]


def _collate(samples: list[tuple[int, str]]) -> Batch:
    return Batch(torch.tensor([i for i, _ in samples]), [t for _, t in samples])


def _loaders(**kwargs):
    data = [(i, f"sample {i}") for i in range(10)]
    return make_loaders(
        ONE, data, data[:5], batch_size=4, eval_batch_size=3, seed=0, drop_last=False,
        num_workers=0, **kwargs,
    )  # fmt: skip


def test_collate_fn_builds_every_batch():
    loaders = _loaders(collate_fn=_collate)
    train = list(loaders.epoch(0))
    assert all(isinstance(b, Batch) for b in train)
    ids = [i for b in train for i in b.ids.tolist()]
    assert ids == list(iter(loaders.sampler))  # the epoch's order (the sampler is exhausted)
    assert sorted(ids) == list(range(10))
    assert [t for b in train for t in b.text] == [f"sample {i}" for i in ids]
    evaluated = list(loaders.eval_batches(0))
    assert all(isinstance(b, Batch) for b in evaluated)
    assert [i for b in evaluated for i in b.ids.tolist()] == list(range(5))


def test_default_collation_is_unchanged():
    ids, text = next(iter(_loaders().epoch(0)))
    assert isinstance(ids, torch.Tensor) and ids.shape == (4,)
    assert list(text) == [f"sample {i}" for i in ids.tolist()]
