"""Which rank of how many: the one rule every sampler uses for its defaults and checks."""

from __future__ import annotations


def replicas_and_rank(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """``(num_replicas, rank)``, defaults taken from ``tandem.world()``, both checked.

    Raises:
        ValueError: ``num_replicas < 1`` or ``rank`` outside ``[0, num_replicas)``.

    Example::

        >>> replicas_and_rank(4, 3)
        (4, 3)
    """
    if num_replicas is None or rank is None:
        # Imported here: tandem.data must not pull in the process-group code until asked.
        from tandem.world import world

        w = world()
        num_replicas = w.world_size if num_replicas is None else num_replicas
        rank = w.rank if rank is None else rank
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank {rank} not in [0, {num_replicas})")
    return num_replicas, rank
