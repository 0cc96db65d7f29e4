"""Which ranks FSDP shards over and which it replicates across: the mesh of one wrapped model.

Flat sharding cuts every unit over one group. Hybrid sharding (torch's HSDP, DeepSpeed's MiCS)
arranges the ranks as a grid: each *row* is a shard group (the ranks of one node, say), which
cuts the units as flat sharding does; each *column* is a replicate group, the ranks of every row
that hold the same slice. A gradient is reduce-scattered within the row, then its slice is
all-reduced across the column: the only collective that leaves the row.

:func:`resolve` turns the wrapper's arguments into one :class:`FsdpMesh`:

- ``process_group=`` (or ``shard_group=`` alone, or a 1-D ``device_mesh``): flat, one row;
- ``shard_group=`` with ``replicate_group=``, or a 2-D ``device_mesh`` (replicate, shard): a
  grid the ranks check together (:func:`check_grid`: each column's members at the same place
  of rows of one size), so that a wrong pair of groups is a ValueError on every rank, never a
  sum of two different slices;
- ``hybrid=True``: rows from the launcher's node layout (:func:`by_node`: ranks grouped by
  node, ordered by local rank), columns their transpose.

:func:`post_forward_group` cuts a row further for ``reshard_after_forward=<int>`` (ZeRO++'s hpZ):
groups of that many consecutive ranks of the row, as torch's ``fully_shard`` cuts its mesh.

Example::

    mesh = resolve(hybrid=True, wrapper="tandem.FSDP")   # 2 nodes of 2: rows [0,1], [2,3]
    mesh.shard.ranks, mesh.replicate.ranks               # (2, 3), (1, 3) on rank 3
    post = post_forward_group(mesh, 2)                   # None: 2 is the whole row
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch.distributed as dist

from tandem._dist import gather_objects, group_rank, group_size, initialized
from tandem.groups import GroupInfo, find_group, partition_ranks

# How the doctor's records, the trace and the exit summary name the groups made here.
SHARD, REPLICATE, POST_FORWARD, EVERYONE = (
    "fsdp shard",
    "fsdp replicate",
    "fsdp post-forward",
    "fsdp",
)


@dataclass(frozen=True)
class FsdpMesh:
    """The groups of one FSDP model, as this rank sees them.

    Attributes:
        shard: the row: the units are cut into ``shard.size`` slices over it; ``shard.rank`` is
            this rank's slice.
        replicate: the column: the ranks holding the same slice in the other rows (one rank,
            itself, when nothing is replicated; ``replicate.group`` is then None).
        everyone: every rank of the grid as one group (the world, ``group=None``, when the grid
            spans it): the construction's checks and broadcasts run over it.
    """

    shard: GroupInfo
    replicate: GroupInfo
    everyone: GroupInfo

    @property
    def hybrid(self) -> bool:
        """Whether the shards are replicated across more than one row."""
        return self.replicate.size > 1

    def describe(self) -> str:
        """``"4 ranks"`` (flat) or ``"2 x 2 ranks (replicate x shard)"``: for messages."""
        if not self.hybrid:
            return f"{self.shard.size} rank{'s' if self.shard.size != 1 else ''}"
        return f"{self.replicate.size} x {self.shard.size} ranks (replicate x shard)"


def _info(group: Any, index: int = 0) -> GroupInfo:
    """``group``'s record on this rank (None: the world, or one process)."""
    if not initialized():
        return GroupInfo(group=None, size=1, rank=0, leader=0, index=0, ranks=(0,))
    if group is None:
        ranks = tuple(range(dist.get_world_size()))
    else:
        ranks = tuple(dist.get_process_group_ranks(group))
    return GroupInfo(group, len(ranks), group_rank(group), ranks[0], index, ranks)


def _alone() -> GroupInfo:
    """A group of this rank only, with no handle: nothing is sent to it."""
    rank = group_rank()
    return GroupInfo(group=None, size=1, rank=0, leader=rank, index=0, ranks=(rank,))


def flat(group: Any) -> FsdpMesh:
    """One row: every unit cut over ``group`` (None: the world), nothing replicated."""
    shard = _info(group)
    return FsdpMesh(shard=shard, replicate=_alone(), everyone=shard)


def resolve(
    *,
    process_group: Any = None,
    shard_group: Any = None,
    replicate_group: Any = None,
    hybrid: Any = False,
    device_mesh: Any = None,
    wrapper: str = "tandem.FullyShardedDataParallel",
) -> FsdpMesh:
    """The mesh the wrapper's arguments describe; ValueError naming them when they conflict.

    A collective over the grid's ranks when it is hybrid (the groups are checked, or made
    from the node layout); no communication for flat sharding.
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
            "ranks the model is sharded over: "
            "pass one of process_group= (flat), shard_group= with replicate_group= (hybrid), "
            "hybrid=True (hybrid by node) or device_mesh= (1-D: flat, 2-D: hybrid)"
        )
    if replicate_group is not None and shard_group is None:
        raise ValueError(
            f"{wrapper}: replicate_group= without shard_group=: the shards are replicated "
            "across replicate_group, and cut within shard_group; pass both (or hybrid=True)"
        )
    if hybrid:
        return by_node(wrapper)
    if device_mesh is not None:
        return _from_device_mesh(device_mesh, wrapper)
    if replicate_group is not None:
        rows = _group(shard_group, "shard_group", wrapper)
        return check_grid(rows, _group(replicate_group, "replicate_group", wrapper), wrapper)
    if shard_group is not None:
        return flat(_group(shard_group, "shard_group", wrapper))
    return flat(process_group)


def _group(group: Any, name: str, wrapper: str) -> Any:
    """``group`` if it is a process group this rank belongs to; else ValueError (this rank's)."""
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(
            f"{wrapper}: {name}={group!r} on rank {group_rank()} is not a process group this "
            "rank belongs to: pass each rank the group torch.distributed.new_group gave it (a "
            "rank outside the group gets a placeholder)"
        )
    return group


def _from_device_mesh(mesh: Any, wrapper: str) -> FsdpMesh:
    """Flat over a 1-D mesh; a grid over a 2-D one, its dimensions (replicate, shard)."""
    from torch.distributed.device_mesh import DeviceMesh

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
        return flat(mesh.get_group(0))
    return check_grid(mesh.get_group(1), mesh.get_group(0), wrapper)


def check_grid(shard: Any, replicate: Any, wrapper: str) -> FsdpMesh:
    """The mesh of rows ``shard`` and columns ``replicate``, checked on every rank.

    Round 1, within each column: its members hold the same place of different rows of one
    size. Round 2, within each row: every column passed round 1, and all are of one size.
    Every rank joins both rounds and raises what either found, so that a rank whose own
    column looks right still raises with the peers it would otherwise wait for.
    """
    row, column = _info(shard), _info(replicate)
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
        return FsdpMesh(shard=row, replicate=_alone(), everyone=row)
    everyone = sorted({rank for _, _, ranks in rows for rank in ranks})
    if everyone == list(range(group_size())):
        return FsdpMesh(shard=row, replicate=column, everyone=_info(None))
    # The grid is part of the world: a group of its ranks, made by them alone.
    group = dist.new_group(everyone, use_local_synchronization=True, group_desc=EVERYONE)
    return FsdpMesh(shard=row, replicate=column, everyone=_info(group))


def by_node(wrapper: str) -> FsdpMesh:
    """Rows from the launcher's nodes (each node's ranks by local rank), columns across them;
    every row and column made on every rank (a collective over the world)."""
    from tandem.world import world

    w = world()
    if not initialized():
        return flat(None)
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
        return flat(None)  # one node: every rank in one row
    columns = [list(c) for c in zip(*rows, strict=True)]
    # new_group is collective over the world: every rank makes every row and column, in order.
    row_groups = [dist.new_group(r, group_desc=SHARD) for r in rows]
    column_groups = [dist.new_group(c, group_desc=REPLICATE) for c in columns]
    row, column = find_group(rows, w.rank), find_group(columns, w.rank)
    return FsdpMesh(
        shard=replace(row, group=row_groups[row.index]),
        replicate=replace(column, group=column_groups[column.index]),
        everyone=_info(None),
    )


def post_forward_group(mesh: FsdpMesh, size: int) -> GroupInfo | None:
    """The group of ``size`` consecutive ranks of this rank's row that share a unit between its
    forward and its backward (``reshard_after_forward=size``); None when ``size`` is the row.

    Made by its members only; every rank of the row calls this at the same point.
    """
    row = mesh.shard
    if size == row.size:
        return None
    chunks = partition_ranks(row.size, size)
    place = find_group(chunks, row.rank)
    ranks = [row.ranks[i] for i in place.ranks]
    group = dist.new_group(ranks, use_local_synchronization=True, group_desc=POST_FORWARD)
    return GroupInfo(group, size, place.rank, ranks[0], place.index, tuple(ranks))
