"""Exact evaluation over ranks: sums, count-weighted means, accuracy and an ordered gather.

Each rank evaluates its own shard (see :class:`tandem.data.EvalSampler`) and keeps *sums and
counts*, never per-rank means: shards differ in length, so the mean of the ranks' means weighs a
rank's samples by ``1 / shard_length`` and is not the data set's mean (10 samples on 4 ranks:
shards of 3, 3, 2, 2). Summing totals and counts over ranks, then dividing once, gives what one
process gives.

Arithmetic is float64 for sums and int64 for counts, so integer results (accuracy's correct and
count) are exactly the one-process ones and float sums differ only by the order of additions.

Every function takes ``group`` (default: the default group) and returns the same value on every
rank. With one process (no process group, or a group of one) the collectives are skipped and
the same arithmetic runs: a script evaluates the same way with one process and with many.

Example::

    sampler = tandem.data.EvalSampler(test_set)
    loss, acc, preds = tandem.metrics.Mean(), tandem.metrics.Accuracy(), []
    for x, y in DataLoader(test_set, batch_size=64, sampler=sampler):
        logits = model(x)
        loss.update(F.cross_entropy(logits, y, reduction="none"))
        acc.update(logits, y)
        preds.append(logits.argmax(-1))
    preds = torch.cat(preds) if preds else torch.empty(0, dtype=torch.long)
    print(loss.compute(), acc.compute(), tandem.metrics.gather_in_order(preds, sampler))
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tandem._dist import backend_device, gather_objects, group_size

Number = int | float | torch.Tensor

__all__ = ["Accuracy", "Mean", "accuracy", "gather_in_order", "reduce_mean", "reduce_sum"]


# ---------------------------------------------------------------------------------------------
# Collectives, skipped with one process


def _all_reduce_sum(values: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Element-wise sum over ranks of a small CPU tensor; the tensor itself with one process."""
    if group_size(group) == 1:
        return values
    moved = values.to(backend_device(group))
    dist.all_reduce(moved, group=group)
    return moved.cpu()


# ---------------------------------------------------------------------------------------------
# Sums, means and accuracy


def _is_integral(value: Number) -> bool:
    """Whether ``value`` is a count. An empty tensor is, whatever its dtype: an empty shard's
    ``torch.empty(0)`` must not make that one rank disagree with the others about the type."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 0 or not (value.is_floating_point() or value.is_complex())
    return isinstance(value, int)  # bool is an int


def _local_sum(value: Number, dtype: torch.dtype, name: str) -> torch.Tensor:
    """``value`` (a number, or a tensor whose elements are added) as a 0-d CPU tensor."""
    if dtype == torch.int64 and not _is_integral(value):
        kind = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{name} must be an int or an integer/bool tensor, got {kind}: {value}")
    if isinstance(value, torch.Tensor):
        # Convert before adding: a float32 tensor's elements are summed in float64.
        return value.detach().to("cpu", dtype).sum()
    return torch.tensor(value, dtype=dtype)


def reduce_sum(value: Number, group: ProcessGroup | None = None) -> int | float:
    """The sum of ``value`` over ranks (a tensor's elements are added first), in float64.

    Returned as an ``int`` when every rank passed integers (Python ints, integer or bool
    tensors, or an empty tensor), exact for sums below 2**53; otherwise as a ``float``.

    Args:
        value: this rank's number, or a tensor of this rank's values.
        group: the process group; default the default group.

    Example::

        n_seen = tandem.metrics.reduce_sum(len(sampler))  # len(test_set) on every rank
    """
    # One float64 collective carries the sum and how many ranks passed floats: each rank only
    # knows its own type, and the ranks must agree on the return type.
    local = torch.stack(
        [_local_sum(value, torch.float64, "value"), torch.tensor(float(not _is_integral(value)))]
    )
    total, floats = _all_reduce_sum(local, group).tolist()
    return float(total) if floats else int(total)


def reduce_mean(total: Number, count: Number, group: ProcessGroup | None = None) -> float:
    """Global ``sum(total) / sum(count)``: the count-weighted mean, not a mean of ranks' means.

    Args:
        total: this rank's sum of values (a tensor's elements are added: pass per-sample losses).
        count: how many values (or their total weight) went into ``total``; 0 on an empty shard.
        group: the process group; default the default group.

    Raises:
        ValueError: the global count is not positive (on every rank: it is the reduced value).

    Example::

        # losses: this rank's per-sample losses, possibly none
        mean_loss = tandem.metrics.reduce_mean(losses.sum(), losses.numel())
    """
    # One collective for both: float64 holds any count below 2**53 exactly.
    local = torch.stack(
        [_local_sum(total, torch.float64, "total"), _local_sum(count, torch.float64, "count")]
    )
    global_total, global_count = _all_reduce_sum(local, group).tolist()
    if global_count <= 0:
        raise ValueError(
            f"mean over no samples: global count {global_count} (total {global_total})"
        )
    return global_total / global_count


def accuracy(correct: Number, count: Number, group: ProcessGroup | None = None) -> float:
    """Global ``sum(correct) / sum(count)``, reduced in int64 so it equals one process exactly.

    Args:
        correct: this rank's number of correct predictions, or a bool tensor of them.
        count: this rank's number of predictions; 0 on an empty shard.
        group: the process group; default the default group.

    Raises:
        ValueError: a float argument; or globally ``count <= 0`` or ``correct`` not in
            ``[0, count]`` (raised on every rank).

    Example::

        hits = (model(x).argmax(-1) == y)
        acc = tandem.metrics.accuracy(hits, hits.numel())
    """
    local = torch.stack(
        [_local_sum(correct, torch.int64, "correct"), _local_sum(count, torch.int64, "count")]
    )
    global_correct, global_count = _all_reduce_sum(local, group).tolist()
    if global_count <= 0 or not 0 <= global_correct <= global_count:
        raise ValueError(
            f"accuracy needs 0 <= correct <= count and count > 0, "
            f"got correct {global_correct} of count {global_count} over all ranks"
        )
    return global_correct / global_count


class Mean:
    """Accumulate a weighted mean on this rank; ``compute()`` reduces it over ranks once.

    Example::

        mean = tandem.metrics.Mean()
        for x, y in loader:
            mean.update(F.cross_entropy(model(x), y, reduction="none"))  # per-sample losses
        test_loss = mean.compute()
    """

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0.0

    def update(self, value: Number, weight: int | float = 1) -> None:
        """Add ``value`` (a number, or a tensor of values), each element counted ``weight`` times.

        Args:
            value: a number or a tensor of per-sample values (a batch of losses).
            weight: weight of each element: pass the batch size with a batch's mean loss.
        """
        numel = value.numel() if isinstance(value, torch.Tensor) else 1
        self.total += float(_local_sum(value, torch.float64, "value")) * weight
        self.count += numel * weight

    def compute(self, group: ProcessGroup | None = None) -> float:
        """The mean over all ranks' updates (see :func:`reduce_mean`)."""
        return reduce_mean(self.total, self.count, group)

    def reset(self) -> None:
        """Forget every update."""
        self.total, self.count = 0.0, 0.0


class Accuracy:
    """Count correct predictions on this rank; ``compute()`` reduces them over ranks once.

    Example::

        acc = tandem.metrics.Accuracy()
        for x, y in loader:
            acc.update(model(x), y)  # logits: argmax over the last dimension
        test_accuracy = acc.compute()
    """

    def __init__(self) -> None:
        self.correct = 0
        self.count = 0

    def update(self, predictions: torch.Tensor, targets: torch.Tensor) -> None:
        """Add a batch.

        Args:
            predictions: class indices shaped like ``targets``, or scores with one more (last)
                dimension, reduced by argmax.
            targets: the true class indices.

        Raises:
            ValueError: the shapes do not match.
        """
        if predictions.dim() == targets.dim() + 1:
            predictions = predictions.argmax(-1)
        if predictions.shape != targets.shape:
            raise ValueError(
                f"predictions of shape {tuple(predictions.shape)} do not match targets of "
                f"shape {tuple(targets.shape)}"
            )
        self.correct += int((predictions == targets).sum())
        self.count += targets.numel()

    def compute(self, group: ProcessGroup | None = None) -> float:
        """The accuracy over all ranks' updates (see :func:`accuracy`)."""
        return accuracy(self.correct, self.count, group)

    def reset(self) -> None:
        """Forget every update."""
        self.correct, self.count = 0, 0


# ---------------------------------------------------------------------------------------------
# Per-sample results, gathered in data set order


def gather_in_order(
    values: torch.Tensor | Sequence[Any],
    indices: Iterable[int],
    group: ProcessGroup | None = None,
) -> torch.Tensor | list[Any]:
    """Every rank's per-sample results, placed by sample index: the data set's results in order.

    ``values[i]`` is the result for sample ``indices[i]`` (pass the sampler the loader used).
    Returned on *every* rank (an all-gather: each rank can then compute anything from the full
    results, with no rank-0 branch), ordered by sample index, each sample once.

    Steps:
        1. all-gather each rank's indices and value layout (for a list, the values themselves);
        2. check them, identically on every rank, so a mistake raises everywhere, never hangs;
        3. for tensors, all-gather the rows, padded to the longest shard, and trim the padding;
        4. put the rows in index order.

    Args:
        values: this rank's results, one per index: a tensor (one row per sample; an empty
            shard may pass any tensor with 0 rows, the others' dtype and shape are used) or a
            sequence of picklable objects.
        indices: the data set indices this rank evaluated, in the order of ``values``: the
            sampler itself. If it has a ``dataset`` (samplers do) every index of it must appear.
        group: the process group; default the default group.

    Returns:
        A tensor (on ``values``' device) or a list, in sample-index order.

    Raises:
        ValueError: a rank's number of values and indices differ, an index appears twice
            (torch's ``DistributedSampler`` pads by repeating samples: use ``EvalSampler``),
            an index of the data set is missing, or ranks mix tensors and lists or disagree on
            dtype or row shape.

    Example::

        preds = torch.cat(batch_preds) if batch_preds else torch.empty(0, dtype=torch.long)
        all_preds = tandem.metrics.gather_in_order(preds, sampler)  # len(test_set) rows
    """
    local_indices = [int(i) for i in indices]
    dataset = getattr(indices, "dataset", None)
    if isinstance(values, torch.Tensor):
        n_rows = values.shape[0] if values.dim() else None
        layout = (values.dtype, values.shape[1:]) if n_rows else None
        part = _Part(local_indices, n_rows, layout, None)
    else:
        part = _Part(local_indices, len(values), None, list(values))

    # Step 1
    parts = gather_objects(part, group)
    # Step 2
    layout = _check(parts, len(dataset) if dataset is not None else None)
    all_indices = [i for p in parts for i in p.indices]
    order = sorted(range(len(all_indices)), key=all_indices.__getitem__)
    if not isinstance(values, torch.Tensor):
        flat = [v for p in parts for v in p.objects]
        return [flat[k] for k in order]
    # Step 3
    rows = _all_gather_rows(values, [p.rows for p in parts], layout, group)
    # Step 4
    return rows[torch.tensor(order, dtype=torch.long, device=rows.device)]


@dataclass(frozen=True)
class _Part:
    """What one rank contributes to :func:`gather_in_order`'s first all-gather."""

    indices: list[int]
    rows: int | None  # None: a 0-d tensor, which has no rows
    layout: tuple[torch.dtype, torch.Size] | None  # a non-empty tensor's (dtype, row shape)
    objects: list[Any] | None  # None: the rank passed a tensor


def _check(parts: list[_Part], expected: int | None) -> tuple[torch.dtype, torch.Size] | None:
    """Validate the gathered parts; return the tensors' agreed (dtype, row shape), if any.

    Every rank runs this on the same gathered data, so every rank raises the same error.
    """
    lists = [r for r, p in enumerate(parts) if p.objects is not None]
    if lists and len(lists) < len(parts):
        raise ValueError(f"ranks {lists} passed lists and the others tensors; pass one kind")
    for rank, p in enumerate(parts):
        if p.rows is None:
            raise ValueError(f"rank {rank} passed a 0-d tensor; values need one row per sample")
        if p.rows != len(p.indices):
            raise ValueError(f"rank {rank} passed {p.rows} values for {len(p.indices)} indices")
    counts = Counter(i for p in parts for i in p.indices)
    repeated = sorted(i for i, n in counts.items() if n > 1)
    if repeated:
        raise ValueError(
            f"indices {repeated[:10]} were evaluated more than once over the ranks (torch's "
            "DistributedSampler pads shards by repeating samples; use tandem.data.EvalSampler)"
        )
    if expected is not None and counts.keys() != set(range(expected)):
        missing = sorted(set(range(expected)) - counts.keys())
        extra = sorted(counts.keys() - set(range(expected)))
        raise ValueError(
            f"the ranks' indices do not cover the data set of {expected} samples: "
            f"missing {missing[:10]}, out of range {extra[:10]}"
        )
    layouts = {p.layout for p in parts if p.layout is not None}
    if len(layouts) > 1:
        raise ValueError(f"ranks disagree on (dtype, row shape): {sorted(map(str, layouts))}")
    return layouts.pop() if layouts else None


def _all_gather_rows(
    values: torch.Tensor,
    counts: list[int],
    layout: tuple[torch.dtype, torch.Size] | None,
    group: ProcessGroup | None,
) -> torch.Tensor:
    """Concatenate every rank's rows in rank order, through one padded all_gather."""
    if layout is None or group_size(group) == 1:
        return values  # no rank has a row (nothing to send), or this rank's rows are all rows
    dtype, row_shape = layout
    longest = max(counts)
    device = backend_device(group)
    # Gloo has no bool all_gather: bools travel as bytes.
    wire = torch.uint8 if dtype == torch.bool else dtype
    padded = torch.zeros((longest, *row_shape), dtype=wire, device=device)
    if values.shape[0]:  # an empty shard's tensor may have any row shape: send zeros only
        padded[: values.shape[0]] = values.to(device, wire)
    gathered = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(gathered, padded, group=group)
    rows = torch.cat([part[:n] for part, n in zip(gathered, counts, strict=True)])
    return rows.to(values.device, dtype)
