"""Uneven inputs: ranks that ran out of data shadow the collectives of those still training.

A rank with fewer batches leaves its loop early; the others would then wait forever in their
next gradient all-reduce. Inside ``tandem.join([model])`` (torch's ``Join`` context manager, to
which tandem.DDP is a ``Joinable``), a rank that has left its loop keeps answering, iteration by
iteration, every collective the others issue:

1. each forward of a training rank announces "not joined yet" (an all-reduce of 1) and the
   joined ranks learn how many are still training from the same all-reduce (they add 0);
2. the bucket rebuild's broadcast, the buffer broadcast (from the highest rank still training:
   rank 0 may have stopped with stale statistics) and "will this backward sync" are matched;
3. each gradient bucket is all-reduced with zeros (through the communication hook, if any), and
   so is tandem's end-of-backward check: the mean is the sum over the training ranks divided by
   the initial world size (or by the ranks still training, ``divide_by_initial_world_size=False``);
4. once every rank has joined, the parameters and buffers of the last rank to join (the highest
   such rank) are broadcast, so that every replica ends identical (the buffers only with
   ``forward_sync_buffers``, as in torch).

The order of these collectives is torch's DDP's, so a loop written for torch's ``Join`` works
unchanged, and both engines give the same bits (tests/parallel/ddp/test_ddp_join.py). Scripts
written for torch call ``model.join()``: the same context, for that model.

Example::

    with tandem.join([model]):
        for x, y in my_shard:            # ranks may hold different numbers of batches
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.distributed.algorithms.join import Join, Joinable

from tandem.doctor import records


def join(
    joinables: Joinable | Sequence[Joinable],
    *,
    enable: bool = True,
    throw_on_early_termination: bool = False,
    divide_by_initial_world_size: bool = True,
) -> Join:
    """A context manager in which ranks may run out of inputs at different steps.

    Args:
        joinables: tandem.DDP models (and any other torch ``Joinable``, such as
            ``ZeroRedundancyOptimizer``) used in the loop.
        enable: False makes the context a no-op (for code that only sometimes needs it).
        throw_on_early_termination: raise ``RuntimeError`` on every rank as soon as one rank
            runs out, instead of shadowing it.
        divide_by_initial_world_size: the mean divides by the world size even when some ranks
            have joined (their zeros count, torch's default), or else by the ranks still
            training.

    Example::

        with tandem.join([model], throw_on_early_termination=True):
            for batch in loader:
                ...
    """
    if isinstance(joinables, Joinable):
        joinables = [joinables]
    return Join(
        list(joinables),
        enable=enable,
        throw_on_early_termination=throw_on_early_termination,
        divide_by_initial_world_size=divide_by_initial_world_size,
    )


def training_ranks(work: Any) -> int:
    """Ranks still training, from the all-reduce that announced this one (Join's work handle)."""
    records.wait(work)
    return int(work.result()[0].item())
