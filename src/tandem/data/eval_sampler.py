"""EvalSampler: every sample of the data set on exactly one rank, no padding, no dropping.

torch's ``DistributedSampler`` gives every rank ``ceil(n / world)`` samples by repeating the first
ones, which is right for training (equal steps, no rank waits) and wrong for evaluation: on 10
samples and 4 ranks, samples 0 and 1 are counted twice and a test set's accuracy is biased.
Evaluation does not need equal shards, because nothing is synchronized per batch: each rank runs
its own shard and the results are reduced once at the end (:mod:`tandem.metrics`).

Layout, contiguous shards: rank ``r`` gets ``range(start_r, end_r)`` with ``n // world`` samples,
plus one for the first ``n % world`` ranks. Contiguous (not strided, as torch's sampler is) so
that concatenating the ranks' results in rank order *is* data set order: gathering predictions in
order needs no interleaving. :func:`shard_range` is the one place that rule lives.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized

from torch.utils.data import Sampler

from tandem.data.ranks import replicas_and_rank


def shard_range(num_samples: int, num_replicas: int, rank: int) -> range:
    """The indices rank ``rank`` of ``num_replicas`` evaluates out of ``num_samples``.

    Shards are contiguous, in rank order, and their sizes differ by at most one: the first
    ``num_samples % num_replicas`` ranks get one more. A rank gets an empty range when
    ``num_samples < num_replicas``.

    Args:
        num_samples: length of the data set, ``>= 0``.
        num_replicas: number of ranks sharing it, ``>= 1``.
        rank: this rank, in ``[0, num_replicas)``.

    Raises:
        ValueError: any argument out of range.

    Example::

        >>> [list(shard_range(10, 4, r)) for r in range(4)]
        [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    """
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank {rank} not in [0, {num_replicas})")
    base, extra = divmod(num_samples, num_replicas)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


class EvalSampler(Sampler[int]):
    """Yield this rank's contiguous shard of ``dataset``, in order, each sample exactly once.

    Shards of unequal length (sizes differ by at most one) replace torch's padding, so that the
    union over ranks is exactly the data set. Reduce metrics with their counts
    (:func:`tandem.metrics.reduce_mean`, :func:`tandem.metrics.accuracy`) and gather per-sample
    outputs with :func:`tandem.metrics.gather_in_order`: the distributed result then equals the
    one-process result. With fewer samples than ranks some ranks get none; their loaders yield
    no batches, which the reductions handle (a count of 0 adds nothing).

    Not for training: unequal shards mean unequal numbers of steps, and DDP's gradient
    all-reduce would wait forever for the rank that has finished.

    Args:
        dataset: anything with ``len()``; only its length is used.
        num_replicas: number of ranks; default ``tandem.world().world_size``.
        rank: this rank; default ``tandem.world().rank``.

    Raises:
        ValueError: ``num_replicas < 1`` or ``rank`` not in ``[0, num_replicas)``.

    Example::

        sampler = tandem.data.EvalSampler(test_set)
        loader = DataLoader(test_set, batch_size=256, sampler=sampler)
        mean = tandem.metrics.Mean()
        for x, y in loader:
            mean.update(loss_fn(model(x), y, reduction="none"))
        test_loss = mean.compute()  # same value on every rank, as on one process
    """

    def __init__(
        self, dataset: Sized, num_replicas: int | None = None, rank: int | None = None
    ) -> None:
        num_replicas, rank = replicas_and_rank(num_replicas, rank)
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.total_size = len(dataset)
        self.indices = shard_range(self.total_size, num_replicas, rank)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)

    def set_epoch(self, epoch: int) -> None:
        """Accepted and ignored: evaluation order never changes.

        Loops call ``set_epoch`` on every sampler (training samplers need it); this one should
        not have to be special-cased.
        """
