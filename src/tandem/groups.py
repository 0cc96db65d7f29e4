"""Process groups: split the job into contiguous or strided groups, and say which one is mine.

Two layouts of ``world_size`` ranks, both cut by ``group_size`` (the partition size):

- :func:`partition`: contiguous groups of ``group_size`` ranks, ``[0..g-1], [g..2g-1], ...``
  (e.g. the processes of one node);
- :func:`strided`: the transpose, ``group_size`` groups of ``world_size // group_size`` ranks,
  each taking the i-th rank of every partition (e.g. the same GPU index on every node).

The member lists are pure functions (:func:`partition_ranks`, :func:`strided_ranks`) and the
record of one rank's group is another (:func:`find_group`); only :func:`partition` and
:func:`strided` talk to ``torch.distributed``. ``torch.distributed.new_group`` is collective
over the whole job: every rank must create every group, members or not, in the same order, or
the ranks wait on each other forever. So both create every group of the layout, and check their
arguments before the first ``new_group`` so that a bad ``group_size`` fails on every rank alike.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.world import World


@dataclass(frozen=True)
class GroupInfo:
    """One rank's process group: its handle, its members and this rank's place among them.

    The names of the usual guides, for a :func:`partition` (where they are defined), map as
    ``group_size`` (the argument) = ``size``, ``group_ws`` (how many groups) =
    ``world_size // size``, ``group_rank`` (which group) = ``index``, ``local_group_rank``
    (rank inside the group) = ``rank`` and ``group_rank_base`` (global rank of the group's first
    member) = ``leader``. For :func:`strided` the same fields keep their meaning: ``size`` is
    ``world_size // group_size``, ``index`` runs over ``range(group_size)``.

    Attributes:
        group: the ``torch.distributed`` process group to pass as ``group=`` to collectives;
            None when the job has no process group (one process, where collectives are skipped).
        size: number of ranks in the group.
        rank: this process's rank inside the group, from 0 (its position in ``ranks``).
        leader: global rank of the group's rank 0 (``ranks[0]``), e.g. the ``src`` of a
            ``broadcast`` inside the group, which torch takes as a global rank.
        index: which group of the layout this is, from 0, in creation order.
        ranks: the global ranks of the members, in group-rank order.

    Example::

        g = tandem.groups.partition(group_size=4)
        dist.all_reduce(loss, group=g.group)  # sums over this rank's 4 processes only
        if g.is_leader:
            print(f"group {g.index}: ranks {g.ranks}")
    """

    group: Any
    size: int
    rank: int
    leader: int
    index: int
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        assert self.size == len(self.ranks) and 0 <= self.rank < self.size, self
        assert self.leader == self.ranks[0], self

    @property
    def is_leader(self) -> bool:
        """``rank == 0``: the group's one process that logs or writes for the group."""
        return self.rank == 0


def partition_ranks(world_size: int, group_size: int) -> list[list[int]]:
    """Contiguous groups of ``group_size`` ranks covering ``range(world_size)``.

    Args:
        world_size: number of processes in the job.
        group_size: ranks per group; must divide ``world_size``.

    Returns:
        ``world_size // group_size`` lists, group ``i`` holding ranks
        ``i * group_size ... (i + 1) * group_size - 1``.

    Raises:
        ValueError: ``group_size`` is not a positive divisor of ``world_size``.

    Example::

        >>> partition_ranks(8, 4)
        [[0, 1, 2, 3], [4, 5, 6, 7]]
    """
    _check_sizes(world_size, group_size)
    return [list(range(start, start + group_size)) for start in range(0, world_size, group_size)]


def strided_ranks(world_size: int, group_size: int) -> list[list[int]]:
    """Groups across the partitions: the transpose of :func:`partition_ranks`.

    ``group_size`` is the size of the *partitions* (as for :func:`partition_ranks`), not of the
    result: the ranks are cut into ``world_size // group_size`` partitions of ``group_size``, and
    strided group ``i`` takes the i-th rank of every partition. So there are ``group_size``
    groups of ``world_size // group_size`` ranks each, group ``i`` holding
    ``i, i + group_size, i + 2 * group_size, ...``.

    Args:
        world_size: number of processes in the job.
        group_size: size of the partitions the groups stride across; must divide
            ``world_size``.

    Returns:
        ``group_size`` lists of ``world_size // group_size`` ranks.

    Raises:
        ValueError: ``group_size`` is not a positive divisor of ``world_size``.

    Example::

        >>> strided_ranks(6, 3)  # partitions [0, 1, 2] and [3, 4, 5]
        [[0, 3], [1, 4], [2, 5]]
    """
    _check_sizes(world_size, group_size)
    return [list(range(first, world_size, group_size)) for first in range(group_size)]


def find_group(groups: list[list[int]], rank: int, group: Any = None) -> GroupInfo:
    """The record of the one group in ``groups`` that holds global rank ``rank``.

    Args:
        groups: member lists, as from :func:`partition_ranks` or :func:`strided_ranks`.
        rank: a global rank.
        group: the process-group handle to put in the record.

    Raises:
        ValueError: ``rank`` is in none of the groups, or in more than one.

    Example::

        >>> find_group(strided_ranks(6, 3), rank=4)
        GroupInfo(group=None, size=2, rank=1, leader=1, index=1, ranks=(1, 4))
    """
    holding = [index for index, members in enumerate(groups) if rank in members]
    if len(holding) != 1:
        raise ValueError(
            f"rank {rank} is in {len(holding)} of the groups {groups} (indices {holding}); "
            "it must be in exactly one"
        )
    members = tuple(groups[holding[0]])
    return GroupInfo(
        group=group,
        size=len(members),
        rank=members.index(rank),
        leader=members[0],
        index=holding[0],
        ranks=members,
    )


def partition(
    group_size: int, *, backend: str | None = None, world: World | None = None
) -> GroupInfo:
    """Split the job into contiguous groups of ``group_size`` ranks; return this rank's group.

    Collective: every rank must call it, with the same arguments. Every group is created on
    every rank, in order. With one process and no process group, no group is created and the
    record describes a group of one with ``group=None``.

    Args:
        group_size: ranks per group; must divide the world size.
        backend: the groups' backend; the default group's when None.
        world: the job; :func:`tandem.world` when None.

    Returns:
        This rank's :class:`GroupInfo`.

    Raises:
        ValueError: ``group_size`` is not a positive divisor of the world size (on every rank,
            before any group is created), or ``world`` disagrees with the process group.
        RuntimeError: several processes and no process group (``tandem.init()`` not called).

    Example::

        # 8 processes on 2 nodes of 4: one group per node
        g = tandem.groups.partition(group_size=4)
        # rank 5 -> g.ranks == (4, 5, 6, 7), g.rank == 1, g.leader == 4, g.index == 1
        dist.broadcast(batch_stats, src=g.leader, group=g.group)
    """
    w = _world(world)
    return _create(partition_ranks(w.world_size, group_size), w, backend)


def strided(
    group_size: int, *, backend: str | None = None, world: World | None = None
) -> GroupInfo:
    """Split the job into groups across the partitions of ``group_size``; return this rank's.

    ``group_size`` is the partition size, as for :func:`partition`; the strided groups take
    the i-th rank of each partition, so there are ``group_size`` of them, each of
    ``world_size // group_size`` ranks (see :func:`strided_ranks`). Collective like
    :func:`partition`, with the same one-process behaviour.

    Args:
        group_size: size of the partitions the groups stride across; must divide the world
            size.
        backend: the groups' backend; the default group's when None.
        world: the job; :func:`tandem.world` when None.

    Returns:
        This rank's :class:`GroupInfo`.

    Raises:
        ValueError: ``group_size`` is not a positive divisor of the world size (on every rank,
            before any group is created), or ``world`` disagrees with the process group.
        RuntimeError: several processes and no process group (``tandem.init()`` not called).

    Example::

        # 6 processes as 2 nodes of 3: link the same local rank across the nodes
        g = tandem.groups.strided(group_size=3)
        # groups [0, 3], [1, 4], [2, 5]; rank 4 -> g.ranks == (1, 4), g.rank == 1, g.leader == 1
        dist.all_reduce(grad, group=g.group)
    """
    w = _world(world)
    return _create(strided_ranks(w.world_size, group_size), w, backend)


def _check_sizes(world_size: int, group_size: int) -> None:
    """The one rule for a valid layout: ``group_size`` a positive divisor of ``world_size``."""
    for name, value in (("world_size", world_size), ("group_size", group_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}={value!r} is not an integer")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    if not 1 <= group_size <= world_size or world_size % group_size != 0:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"group_size={group_size} does not divide world_size={world_size}; "
            f"use one of {divisors}"
        )


def _world(world: World | None) -> World:
    from tandem.world import world as current_world

    return current_world() if world is None else world


def _create(groups: list[list[int]], w: World, backend: str | None) -> GroupInfo:
    """Create every group of the layout, in order, and return the record of ``w.rank``'s."""
    import torch.distributed as dist

    from tandem._dist import group_rank, group_size, initialized

    if not initialized():
        if w.world_size > 1:
            # group=None would silently mean "the whole job" to torch's collectives.
            raise RuntimeError(
                f"rank {w.rank} of {w.world_size} asked for process groups, but there is no "
                "process group to split; call tandem.init() first"
            )
        return find_group(groups, w.rank)
    if (w.rank, w.world_size) != (group_rank(), group_size()):
        raise ValueError(
            f"world says rank {w.rank} of {w.world_size}, but the process group says rank "
            f"{group_rank()} of {group_size()}; leave world out to use the group's"
        )
    # new_group is collective over the default group: a rank that skipped the groups it is not
    # in would leave the members waiting for it, so every rank creates all of them.
    handles = [dist.new_group(ranks=members, backend=backend) for members in groups]
    mine = find_group(groups, w.rank)
    return replace(mine, group=handles[mine.index])
