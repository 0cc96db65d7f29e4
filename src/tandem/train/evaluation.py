"""Exact evaluation over ranks: each rank runs its own shard, sums and counts are reduced once.

With :class:`tandem.data.EvalSampler` every sample is evaluated on exactly one rank (no padding),
and :mod:`tandem.metrics` weighs by counts, so the result equals one process on the whole set.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from tandem.metrics import Accuracy, Mean, reduce_sum


@torch.no_grad()
def evaluate(
    module: nn.Module,
    batches: Iterable[Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    device: torch.device,
) -> dict[str, float | None]:
    """Mean loss and (for class scores and integer targets) accuracy over all ranks.

    Call on every rank. Outputs count as class scores when they have one dimension more than
    the targets and the targets are integers.

    Args:
        module: the plain model (not the DDP wrapper: replicas are identical, and DDP's forward
            prepares a backward that evaluation never runs).
        batches: this rank's ``(inputs, targets)`` batches, e.g. a loader over an EvalSampler.
        loss_fn: ``loss_fn(outputs, targets)``, the batch's mean loss.
        device: where the module is.

    Returns:
        ``{"eval_loss": mean loss, "eval_accuracy": accuracy or None}``, the same on every rank.

    Example::

        metrics = evaluate(model, DataLoader(test_set, 64, sampler=EvalSampler(test_set)),
                           F.cross_entropy, tandem.world().device)
    """
    was_training = module.training
    module.eval()
    loss, accuracy = Mean(), Accuracy()
    try:
        for inputs, targets in batches:
            inputs, targets = inputs.to(device), targets.to(device)
            outputs = module(inputs)
            # A batch's mean loss, weighted by its size: the data set's mean, whatever the
            # batches and shards.
            loss.update(loss_fn(outputs, targets), weight=len(targets))
            if outputs.dim() == targets.dim() + 1 and not targets.is_floating_point():
                accuracy.update(outputs, targets)
    finally:
        module.train(was_training)
    # Every rank must join the same reductions, so whether there is an accuracy is decided from
    # the global count: a rank with an empty shard has seen no outputs to judge by.
    scored = reduce_sum(accuracy.count) > 0
    return {"eval_loss": loss.compute(), "eval_accuracy": accuracy.compute() if scored else None}
