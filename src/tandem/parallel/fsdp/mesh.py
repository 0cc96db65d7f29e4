"""Which ranks FSDP shards over and which it replicates across: the mesh of one wrapped model.

Flat sharding cuts every unit over one group. Hybrid sharding (torch's HSDP, DeepSpeed's MiCS)
arranges the ranks as a grid: each *row* is a shard group (the ranks of one node, say), which
cuts the units as flat sharding does; each *column* is a replicate group, the ranks of every row
that hold the same slice. A gradient is reduce-scattered within the row, then its slice is
all-reduced across the column: the only collective that leaves the row.

:func:`resolve` turns the wrapper's arguments into one :class:`FsdpMesh` (the grid of
:mod:`tandem.groups`, whose rules tandem.DDP and tandem.ShardedOptimizer share):

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

from typing import Any

import torch.distributed as dist

from tandem.groups import (
    Grid,
    GridNames,
    GroupInfo,
    find_group,
    flat_grid,
    grid_by_node,
    partition_ranks,
    resolve_grid,
)
from tandem.groups import check_grid as check_any_grid

# How the doctor's records, the trace and the exit summary name the groups made here.
SHARD, REPLICATE, POST_FORWARD, EVERYONE = (
    "fsdp shard",
    "fsdp replicate",
    "fsdp post-forward",
    "fsdp",
)
NAMES = GridNames(shard=SHARD, replicate=REPLICATE, everyone=EVERYONE)

# The grid logic is shared with tandem.DDP and tandem.ShardedOptimizer (tandem.groups); an
# FSDP model's mesh is such a grid.
FsdpMesh = Grid


def flat(group: Any) -> FsdpMesh:
    """One row: every unit cut over ``group`` (None: the world), nothing replicated."""
    return flat_grid(group)


def resolve(
    *,
    process_group: Any = None,
    shard_group: Any = None,
    replicate_group: Any = None,
    hybrid: Any = False,
    device_mesh: Any = None,
    wrapper: str = "tandem.FullyShardedDataParallel",
) -> FsdpMesh:
    """The mesh the wrapper's arguments describe (:func:`tandem.groups.resolve_grid`, its
    groups named ``fsdp shard`` / ``fsdp replicate``); ValueError naming them when they
    conflict."""
    return resolve_grid(
        process_group=process_group,
        shard_group=shard_group,
        replicate_group=replicate_group,
        hybrid=hybrid,
        device_mesh=device_mesh,
        names=NAMES,
        wrapper=wrapper,
    )


def check_grid(shard: Any, replicate: Any, wrapper: str) -> FsdpMesh:
    """The mesh of rows ``shard`` and columns ``replicate``, checked on every rank
    (:func:`tandem.groups.check_grid`)."""
    return check_any_grid(shard, replicate, NAMES, wrapper)


def by_node(wrapper: str) -> FsdpMesh:
    """Rows from the launcher's nodes, columns across them (:func:`tandem.groups.grid_by_node`)."""
    return grid_by_node(NAMES, wrapper)


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
