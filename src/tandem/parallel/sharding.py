"""Which rank owns what: the one sharding rule every sharded-data-parallel path asks.

Pure arithmetic, no communication, so every rank computes the same answer from the same inputs
and the rule can be tested without processes. Two granularities:

- **Whole parameters** (ZeRO stage 1, ``tandem.parallel.zero``): :func:`assign_owners` gives each
  parameter one owner, balancing the bytes per rank. A parameter is never split, so an owner can
  run any ``torch.optim`` optimizer on it unchanged (Adam's state, LAMB's per-tensor norms).
- **Flat slices** (stages 2 and 3, ``tandem.parallel.fsdp.flat``): a flat buffer of ``numel``
  elements is padded to a multiple of the world size and cut into equal contiguous slices,
  rank ``r`` owning :func:`flat_shard`\\ ``(numel, world_size, r)``. Equal slices are what
  reduce-scatter and all-gather require; the padding is the price of that.

Example::

    owners = assign_owners([p.numel() * p.element_size() for p in params], world_size=4)
    mine = owned_indices(owners, rank)            # indices into params, in their order
    start, end = flat_shard(total_numel, world_size=4, rank=rank)
"""

from __future__ import annotations

from collections.abc import Sequence


def _check_world(world_size: int, rank: int | None = None) -> None:
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    if rank is not None and not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} not in [0, {world_size})")


def assign_owners(sizes: Sequence[int], world_size: int) -> list[int]:
    """The owning rank of each parameter, balanced by size.

    Greedy, largest first: parameters sorted by decreasing size (ties by registration order) each
    go to the rank with the least total so far (ties to the lowest rank). Deterministic, so every
    rank derives the same owners without communicating. Balance: the most- and least-loaded
    ranks differ by at most the largest size (when a rank last received a parameter it was the
    least loaded).

    Args:
        sizes: one non-negative size per parameter, in registration order; bytes when
            parameters may differ in dtype (balances memory), elements otherwise.
        world_size: ranks to share the parameters among.

    Returns:
        ``owners[i]``, the rank that owns parameter ``i``.

    Example::

        >>> assign_owners([10, 40, 30, 20], world_size=2)
        [0, 0, 1, 1]
    """
    _check_world(world_size)
    for i, size in enumerate(sizes):
        if size < 0:
            raise ValueError(f"sizes[{i}]={size} must be non-negative")
    loads = [0] * world_size
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        # min over (load, rank) pairs: the least-loaded rank, the lowest on a tie.
        _, rank = min((load, r) for r, load in enumerate(loads))
        owners[i] = rank
        loads[rank] += sizes[i]
    return owners


def owned_indices(owners: Sequence[int], rank: int) -> list[int]:
    """The indices of the parameters ``rank`` owns, in registration order.

    Example::

        >>> owned_indices([0, 0, 1, 1], rank=1)
        [2, 3]
    """
    return [i for i, owner in enumerate(owners) if owner == rank]


def padded_numel(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``world_size``: the length every rank's slice sums to.

    Example::

        >>> padded_numel(10, world_size=4)
        12
    """
    _check_world(world_size)
    if numel < 0:
        raise ValueError(f"numel={numel} must be non-negative")
    return -(-numel // world_size) * world_size


def flat_shard(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """The ``[start, end)`` slice of a flat buffer of ``numel`` elements that ``rank`` owns.

    The buffer is padded to :func:`padded_numel` and cut into ``world_size`` equal contiguous
    slices in rank order; the slices of the last ranks may lie partly or wholly in the padding
    (``end > numel``), which the caller allocates and ignores.

    Args:
        numel: elements in the unpadded flat buffer.
        world_size: ranks sharing it.
        rank: the rank asking, in ``[0, world_size)``.

    Example::

        >>> [flat_shard(10, world_size=4, rank=r) for r in range(4)]
        [(0, 3), (3, 6), (6, 9), (9, 12)]
    """
    _check_world(world_size, rank)
    shard = padded_numel(numel, world_size) // world_size
    return rank * shard, (rank + 1) * shard
