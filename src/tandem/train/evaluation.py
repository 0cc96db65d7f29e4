"""Exact evaluation over ranks: each rank runs its own shard, sums and counts are reduced once.

With :class:`tandem.data.EvalSampler` every sample is evaluated on exactly one rank (no padding),
and :mod:`tandem.metrics` weighs by counts, so the result equals one process on the whole set.

Each batch goes through the run's step (:class:`tandem.train.step.BatchStep`): the default one,
``loss_fn(model(inputs), targets)``, or the user's ``eval_step(model, batch)``. A batch weighs
its count: the leading dimension of its first tensor, or the ``"count"`` the step returned (say
the number of tokens its loss is the mean over). The loss and every metric the step returns are
then averaged exactly: ``sum(value_b * count_b) / sum(count_b)`` over all ranks' batches.
"""

from __future__ import annotations

from collections.abc import Iterable, Sized
from typing import Any, cast

import torch
from torch import nn

from tandem._dist import gather_objects, global_ranks, group_size
from tandem.data.eval_sampler import shard_range
from tandem.metrics import Accuracy, Mean, reduce_sum
from tandem.parallel.adapters import model_state
from tandem.train.step import BatchStep


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[Any],
    step: BatchStep,
    *,
    forwards: int | None = None,
) -> dict[str, float | None]:
    """Mean loss, accuracy and the step's metrics over all ranks.

    Call on every rank. With the default step the accuracy is counted when outputs are class
    scores (one dimension more than the targets) for integer targets; a user's step returns it
    as a metric (``{"loss": ..., "accuracy": ...}``), averaged like any other. A metric missing
    from some batches is averaged over the batches that have it.

    Args:
        model: the model to run: the plain module for replicated engines (replicas are
            identical, and DDP's forward prepares a backward that evaluation never runs), the
            FSDP wrapper for a sharded one (it gathers each unit's parameters).
        batches: this rank's batches, e.g. a loader over an EvalSampler.
        step: the run's evaluation step (device, precision, step function).
        forwards: run the step at least this many times on every rank (a rank with fewer
            batches repeats its last one, the results unused): an FSDP model gathers
            parameters in every forward, a collective that all ranks must join, and a step
            runs as many forwards on every rank.

    Returns:
        ``{"eval_loss": mean loss, "eval_accuracy": accuracy or None, "eval_NAME": ...}`` for
        each metric ``NAME`` the step returned, the same on every rank.

    Example::

        step = BatchStep(None, F.cross_entropy, Precision("32-true", "cpu"),
                         torch.device("cpu"), role="eval_step")
        metrics = evaluate(model, DataLoader(test_set, 64, sampler=EvalSampler(test_set)), step)
    """
    was_training = model.training
    model.eval()
    loss, accuracy = Mean(), Accuracy()
    metrics: dict[str, Mean] = {}
    done, last = 0, None
    try:
        for batch in batches:
            out = step(model, batch)
            done, last = done + 1, batch
            # A batch's means, weighted by its count: the data set's means, whatever the
            # batches and shards.
            loss.update(out.loss, weight=out.count)
            for name, value in out.metrics.items():
                metrics.setdefault(name, Mean()).update(value, weight=out.count)
            if out.scores is not None:
                outputs, targets = out.scores
                if _class_scores(outputs, targets):
                    accuracy.update(outputs, targets)
        while forwards is not None and done < forwards:
            assert last is not None, "the Trainer refuses FSDP evaluation with empty shards"
            step(model, last)
            done += 1
    finally:
        model.train(was_training)
    # Every rank must join the same reductions, so whether there is an accuracy, and which
    # metrics there are, is decided from all ranks: a rank with an empty shard saw nothing.
    scored = reduce_sum(accuracy.count) > 0
    result = {"eval_loss": loss.compute(), "eval_accuracy": accuracy.compute() if scored else None}
    if step.fn is not None:  # the same on every rank: only a user's step has metrics
        names = sorted({name for names in gather_objects(sorted(metrics)) for name in names})
        for name in names:
            result[f"eval_{name}"] = metrics.get(name, Mean()).compute()
    return result


def _class_scores(outputs: Any, targets: Any) -> bool:
    return (
        isinstance(outputs, torch.Tensor)
        and isinstance(targets, torch.Tensor)
        and outputs.dim() == targets.dim() + 1
        and not targets.is_floating_point()
    )


def lockstep_forwards(model: nn.Module, eval_data: Any, batch_size: int) -> int | None:
    """The evaluation steps this rank must run for ``model``: None (no rule) unless it is a
    FullyShardedDataParallel model, whose forwards gather parameters within its shard group;
    then the largest batch count among that group's ranks.

    The evaluation set is dealt over every rank of the job (:class:`tandem.data.EvalSampler`
    at the world's size), not over the shard group: with hybrid sharding each replica
    evaluates its own part too. Only the ranks of one shard group meet in the forward's
    collectives (hybrid sharding's replicas never do before a backward), so they run as many
    forwards as the busiest of them, and another group may run one fewer.

    Raises:
        ValueError: an FSDP model and fewer samples than ranks (a rank without a batch could
            not join the forwards).

    Example::

        forwards = lockstep_forwards(fsdp_model, test_set, batch_size=64)
    """
    wrapper = model_state(model)
    if eval_data is None or not wrapper.forward_is_collective:
        return None
    # The EvalSampler's cut: over the world, by global rank (tandem.train.loaders).
    n, world = len(cast(Sized, eval_data)), group_size()
    if n < world:
        raise ValueError(
            f"eval_data has {n} samples for {world} ranks: with a FullyShardedDataParallel "
            "model every rank runs each evaluation forward, so every rank needs a sample; "
            "evaluate a larger set, or on fewer processes"
        )
    members = global_ranks(wrapper.process_group)
    return max(-(-len(shard_range(n, world, q)) // batch_size) for q in members)
