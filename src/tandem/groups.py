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

A *grid* (:class:`Grid`) is the two-dimensional layout of hybrid parallelism, shared by
``tandem.FullyShardedDataParallel``, ``tandem.DDP`` and ``tandem.ShardedOptimizer``: each *row*
is a shard group (the ranks of one node, say) and each *column* a replicate group (the ranks at
the same place of every row). :func:`resolve_grid` turns an engine's arguments (``hybrid=True``,
``shard_group=`` / ``replicate_group=``, a 1-D or 2-D ``DeviceMesh``) into one, checked on
every rank (:func:`check_grid`) or made from the launcher's node layout (:func:`grid_by_node`).
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


# -- grids: rows that shard, columns that replicate ---------------------------------------------


@dataclass(frozen=True)
class GridNames:
    """The descriptions (``dist.new_group(group_desc=...)``) of the groups an engine makes for
    its grid: tandem.doctor's records, the trace and the exit summary name the groups by them.

    Example::

        GridNames(shard="ddp shard", replicate="ddp replicate", everyone="ddp")
    """

    shard: str
    replicate: str
    everyone: str


@dataclass(frozen=True)
class Grid:
    """The groups of one hybrid-parallel engine, as this rank sees them.

    Attributes:
        shard: the row: what is sharded is cut into ``shard.size`` slices over it;
            ``shard.rank`` is this rank's slice.
        replicate: the column: the ranks holding the same slice in the other rows (one rank,
            itself, when nothing is replicated; ``replicate.group`` is then None).
        everyone: every rank of the grid as one group (the world, ``group=None``, when the grid
            spans it): the construction's checks and broadcasts run over it.

    Example::

        grid = resolve_grid(hybrid=True, names=names, wrapper="tandem.DDP")
        grid.shard.ranks, grid.replicate.ranks      # (2, 3), (1, 3) on rank 3 of 2 nodes x 2
    """

    shard: GroupInfo
    replicate: GroupInfo
    everyone: GroupInfo

    @property
    def hybrid(self) -> bool:
        """Whether the shards are replicated across more than one row."""
        return self.replicate.size > 1

    @property
    def size(self) -> int:
        """Every rank of the grid: rows times columns."""
        return self.shard.size * self.replicate.size

    def describe(self) -> str:
        """``"4 ranks"`` (flat) or ``"2 x 2 ranks (replicate x shard)"``: for messages."""
        if not self.hybrid:
            return f"{self.shard.size} rank{'s' if self.shard.size != 1 else ''}"
        return f"{self.replicate.size} x {self.shard.size} ranks (replicate x shard)"


def group_info(group: Any, index: int = 0) -> GroupInfo:
    """``group``'s record on this rank (None: the world, or one process).

    Example::

        group_info(None).ranks      # (0, 1, 2, 3) in a job of 4
    """
    from tandem._dist import global_ranks, group_rank, initialized

    if not initialized():
        return GroupInfo(group=None, size=1, rank=0, leader=0, index=0, ranks=(0,))
    ranks = tuple(global_ranks(group))
    return GroupInfo(group, len(ranks), group_rank(group), ranks[0], index, ranks)


def _alone() -> GroupInfo:
    """A group of this rank only, with no handle: nothing is sent to it."""
    from tandem._dist import group_rank

    rank = group_rank()
    return GroupInfo(group=None, size=1, rank=0, leader=rank, index=0, ranks=(rank,))


def flat_grid(group: Any) -> Grid:
    """One row: everything cut over ``group`` (None: the world), nothing replicated.

    Example::

        flat_grid(None).hybrid      # False
    """
    shard = group_info(group)
    return Grid(shard=shard, replicate=_alone(), everyone=shard)


def resolve_grid(
    *,
    process_group: Any = None,
    shard_group: Any = None,
    replicate_group: Any = None,
    hybrid: Any = False,
    device_mesh: Any = None,
    names: GridNames,
    wrapper: str,
) -> Grid:
    """The grid an engine's arguments describe; ValueError naming them when they conflict.

    - ``process_group=`` (or ``shard_group=`` alone, or a 1-D ``device_mesh``): flat, one row;
    - ``shard_group=`` with ``replicate_group=``, or a 2-D ``device_mesh`` (replicate, shard): a
      grid the ranks check together (:func:`check_grid`), so that a wrong pair of groups is a
      ValueError on every rank, never a sum of two different slices;
    - ``hybrid=True``: rows from the launcher's node layout (:func:`grid_by_node`).

    A collective over the grid's ranks when it is hybrid (the groups are checked, or made from
    the node layout); no communication when it is flat.

    Example::

        grid = resolve_grid(shard_group=rows.group, replicate_group=columns.group,
                            names=names, wrapper="tandem.DDP")
    """
    if not isinstance(hybrid, bool):
        raise ValueError(f"{wrapper}: hybrid={hybrid!r}: give True or False")
    given = [
        name
        for name, value in (
            ("process_group", process_group),
            ("shard_group", shard_group),
            ("replicate_group", replicate_group),
            ("device_mesh", device_mesh),
            ("hybrid=True", hybrid or None),
        )
        if value is not None
    ]
    allowed = (["shard_group"], ["shard_group", "replicate_group"])
    if len(given) > 1 and given not in allowed:
        raise ValueError(
            f"{wrapper}: {' and '.join(given)} {'both' if len(given) == 2 else 'all'} say which "
            "ranks the model is split or averaged over: "
            "pass one of process_group= (flat), shard_group= with replicate_group= (hybrid), "
            "hybrid=True (hybrid by node) or device_mesh= (1-D: flat, 2-D: hybrid)"
        )
    if replicate_group is not None and shard_group is None:
        raise ValueError(
            f"{wrapper}: replicate_group= without shard_group=: the shards are replicated "
            "across replicate_group, and cut within shard_group; pass both (or hybrid=True)"
        )
    if hybrid:
        return grid_by_node(names, wrapper)
    if device_mesh is not None:
        return grid_of_mesh(device_mesh, names, wrapper)
    if replicate_group is not None:
        rows = _process_group(shard_group, "shard_group", wrapper)
        columns = _process_group(replicate_group, "replicate_group", wrapper)
        return check_grid(rows, columns, names, wrapper)
    if shard_group is not None:
        return flat_grid(_process_group(shard_group, "shard_group", wrapper))
    return flat_grid(process_group)


def _process_group(group: Any, name: str, wrapper: str) -> Any:
    """``group`` if it is a process group this rank belongs to; else ValueError (this rank's)."""
    import torch.distributed as dist

    from tandem._dist import group_rank

    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(
            f"{wrapper}: {name}={group!r} on rank {group_rank()} is not a process group this "
            "rank belongs to: pass each rank the group torch.distributed.new_group gave it (a "
            "rank outside the group gets a placeholder)"
        )
    return group


def grid_of_mesh(mesh: Any, names: GridNames, wrapper: str) -> Grid:
    """Flat over a 1-D ``DeviceMesh``; a grid over a 2-D one, its dimensions (replicate, shard).

    Example::

        grid_of_mesh(init_device_mesh("cpu", (2, 2)), names, "tandem.DDP").hybrid   # True
    """
    from torch.distributed.device_mesh import DeviceMesh

    from tandem._dist import group_rank

    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"{wrapper}: device_mesh={mesh!r} is not a torch DeviceMesh")
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"{wrapper}: device_mesh has {mesh.ndim} dimensions {tuple(mesh.shape)}: give one "
            "(shard: flat sharding) or two (replicate, shard: hybrid), as torch's fully_shard "
            "takes; slice the data-parallel dimensions out of a larger mesh first"
        )
    if mesh.get_coordinate() is None:
        raise ValueError(
            f"{wrapper}: rank {group_rank()} is not in device_mesh {mesh.mesh.tolist()}"
        )
    if mesh.ndim == 1:
        return flat_grid(mesh.get_group(0))
    return check_grid(mesh.get_group(1), mesh.get_group(0), names, wrapper)


def check_grid(shard: Any, replicate: Any, names: GridNames, wrapper: str) -> Grid:
    """The grid of rows ``shard`` and columns ``replicate``, checked on every rank.

    Round 1, within each column: its members hold the same place of different rows of one
    size. Round 2, within each row: every column passed round 1, and all are of one size.
    Every rank joins both rounds and raises what either found, so that a rank whose own
    column looks right still raises with the peers it would otherwise wait for.

    Example::

        grid = check_grid(partition(2).group, strided(2).group, names, "tandem.DDP")
    """
    import torch.distributed as dist

    from tandem._dist import gather_objects, group_rank, group_size

    row, column = group_info(shard), group_info(replicate)
    found = ""
    if set(row.ranks) & set(column.ranks) != {group_rank()}:
        found = (
            f"rank {group_rank()}'s shard group (ranks {list(row.ranks)}) and replicate group "
            f"(ranks {list(column.ranks)}) share more than this rank"
        )
    members = gather_objects((row.rank, row.size, row.ranks, found), replicate)  # round 1
    found = next((f for *_, f in members if f), "")
    if not found and len({(r, s) for r, s, _, _ in members}) > 1:
        shown = ", ".join(
            f"rank {g} holds slice {r} of {s}"
            for g, (r, s, _, _) in zip(column.ranks, members, strict=True)
        )
        found = (
            f"the replicate group of ranks {list(column.ranks)} holds different slices ({shown}):"
            " the all-reduce across it would add different parts of the model"
        )
    if not found and len({ranks for _, _, ranks, _ in members}) < len(members):
        found = f"two ranks of the replicate group {list(column.ranks)} share a shard group"
    rows = gather_objects((found, column.size, column.ranks), shard)  # round 2
    problems = [f for f, _, _ in rows if f]
    if not problems and len({size for _, size, _ in rows}) > 1:
        shown = ", ".join(f"rank {g}: {s}" for g, (_, s, _) in zip(row.ranks, rows, strict=True))
        problems = [f"the replicate groups of shard group {list(row.ranks)} differ ({shown})"]
    if problems:
        raise ValueError(
            f"{wrapper}: shard_group and replicate_group do not form a grid: {problems[0]}. "
            "Make the shard groups disjoint and of one size (the ranks of a node) and each "
            "replicate group the ranks at one place of every shard group "
            "(tandem.groups.partition(n) and tandem.groups.strided(n) do), or use hybrid=True"
        )
    if column.size == 1:
        return Grid(shard=row, replicate=_alone(), everyone=row)
    everyone = sorted({rank for _, _, ranks in rows for rank in ranks})
    if everyone == list(range(group_size())):
        return Grid(shard=row, replicate=column, everyone=group_info(None))
    # The grid is part of the world: a group of its ranks, made by them alone.
    group = dist.new_group(everyone, use_local_synchronization=True, group_desc=names.everyone)
    return Grid(shard=row, replicate=column, everyone=group_info(group))


def grid_by_node(names: GridNames, wrapper: str) -> Grid:
    """Rows from the launcher's nodes (each node's ranks by local rank), columns across them;
    every row and column made on every rank (a collective over the world). One node, or one
    process: a flat grid over the world.

    Example::

        grid = grid_by_node(names, "tandem.DDP")    # 2 nodes of 2: rows [0, 1], [2, 3]
    """
    import torch.distributed as dist

    from tandem._dist import gather_objects, initialized
    from tandem.world import world

    w = world()
    if not initialized():
        return flat_grid(None)
    everyone = gather_objects((w.node_rank, w.local_rank, w.local_world_size))
    sizes = {lws for _, _, lws in everyone}
    if len(sizes) > 1:
        shown = ", ".join(f"rank {r}: {lws}" for r, (_, _, lws) in enumerate(everyone))
        raise ValueError(
            f"{wrapper}: hybrid=True needs the same number of ranks on every node, and "
            f"LOCAL_WORLD_SIZE differs ({shown}); pass shard_group= and replicate_group="
        )
    per_node = sizes.pop()
    if len(everyone) % per_node:
        raise ValueError(
            f"{wrapper}: hybrid=True: LOCAL_WORLD_SIZE={per_node} ranks per node does not "
            f"divide the world size {len(everyone)}, so the nodes cannot hold shard groups of "
            "one size; launch the same number of ranks on every node, or pass shard_group= "
            "and replicate_group="
        )
    nodes: dict[int, list[tuple[int, int]]] = {}
    for rank, (node, local, _) in enumerate(everyone):
        nodes.setdefault(node, []).append((local, rank))
    local_ranks = {n: sorted(loc for loc, _ in members) for n, members in nodes.items()}
    wrong = [n for n in sorted(nodes) if local_ranks[n] != list(range(per_node))]
    if wrong:
        shown = "; ".join(f"node {n}: local ranks {local_ranks[n]}" for n in wrong)
        raise ValueError(
            f"{wrapper}: hybrid=True: the launcher's layout is not LOCAL_WORLD_SIZE={per_node} "
            f"ranks on every node, numbered 0 to {per_node - 1} ({shown}; read from "
            "GROUP_RANK or NODE_RANK and LOCAL_RANK); pass shard_group= and replicate_group="
        )
    rows = [[rank for _, rank in sorted(nodes[n])] for n in sorted(nodes)]
    if len(rows) == 1:
        return flat_grid(None)  # one node: every rank in one row
    columns = [list(c) for c in zip(*rows, strict=True)]
    # new_group is collective over the world: every rank makes every row and column, in order.
    row_groups = [dist.new_group(r, group_desc=names.shard) for r in rows]
    column_groups = [dist.new_group(c, group_desc=names.replicate) for c in columns]
    row, column = find_group(rows, w.rank), find_group(columns, w.rank)
    return Grid(
        shard=replace(row, group=row_groups[row.index]),
        replicate=replace(column, group=column_groups[column.index]),
        everyone=group_info(None),
    )
