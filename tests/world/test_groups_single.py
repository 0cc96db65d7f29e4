"""Group layouts (partition_ranks, strided_ranks), group records (find_group), no processes.

Proves: for every world size 1..64 and each of its divisors, the partition covers every rank
exactly once with contiguous, ascending groups of group_size; strided groups are exactly the
transpose of the partition (group i = the i-th rank of every partition), so they too cover every
rank once, in group_size groups of world_size // group_size. find_group's record agrees with the
arithmetic of the guides (index = rank // g, rank in group = rank % g, leader = index * g for a
partition; the mirror for strided). The issue's examples hold literally. A group_size that is
not a positive divisor of the world size raises ValueError naming both values; a one-process job
with no process group gets a group of one without touching torch.distributed.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from tandem.groups import (
    GroupInfo,
    find_group,
    partition,
    partition_ranks,
    strided,
    strided_ranks,
)
from tandem.world import World


@st.composite
def sizes(draw: st.DrawFn) -> tuple[int, int]:
    world_size = draw(st.integers(1, 64))
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    return world_size, draw(st.sampled_from(divisors))


@given(sizes())
def test_partition_covers_every_rank_once_in_contiguous_groups(ws_gs: tuple[int, int]) -> None:
    world_size, group_size = ws_gs
    groups = partition_ranks(world_size, group_size)
    assert sorted(r for g in groups for r in g) == list(range(world_size))
    assert len(groups) == world_size // group_size
    for i, members in enumerate(groups):
        assert members == list(range(members[0], members[0] + group_size))
        assert members[0] == i * group_size


@given(sizes())
def test_strided_is_the_transpose_of_partition(ws_gs: tuple[int, int]) -> None:
    world_size, group_size = ws_gs
    parts = partition_ranks(world_size, group_size)
    groups = strided_ranks(world_size, group_size)
    assert groups == [list(column) for column in zip(*parts, strict=True)]
    assert sorted(r for g in groups for r in g) == list(range(world_size))
    assert len(groups) == group_size
    assert all(len(g) == world_size // group_size for g in groups)


@given(sizes(), st.data())
def test_records_follow_the_guides_arithmetic(ws_gs: tuple[int, int], data: st.DataObject) -> None:
    world_size, g = ws_gs
    rank = data.draw(st.integers(0, world_size - 1))
    p = find_group(partition_ranks(world_size, g), rank)
    # group_rank, local_group_rank, group_rank_base of the guides
    assert (p.index, p.rank, p.leader, p.size) == (rank // g, rank % g, rank // g * g, g)
    assert p.ranks[p.rank] == rank and p.group is None
    s = find_group(strided_ranks(world_size, g), rank)
    assert (s.index, s.rank, s.leader, s.size) == (rank % g, rank // g, rank % g, world_size // g)
    assert s.ranks[s.rank] == rank


def test_examples_of_the_issue() -> None:
    assert partition_ranks(8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert strided_ranks(6, 3) == [[0, 3], [1, 4], [2, 5]]
    assert strided_ranks(4, 2) == [[0, 2], [1, 3]]
    assert find_group(strided_ranks(6, 3), 4) == GroupInfo(
        group=None, size=2, rank=1, leader=1, index=1, ranks=(1, 4)
    )
    assert find_group(partition_ranks(8, 4), 5) == GroupInfo(
        group=None, size=4, rank=1, leader=4, index=1, ranks=(4, 5, 6, 7)
    )
    assert find_group(partition_ranks(8, 4), 4).is_leader


@pytest.mark.parametrize("layout", [partition_ranks, strided_ranks])
@pytest.mark.parametrize(
    ("world_size", "group_size"), [(4, 3), (6, 4), (4, 0), (4, -2), (4, 8), (1, 2)]
)
def test_group_size_not_a_divisor_names_both_values(layout, world_size, group_size) -> None:
    with pytest.raises(ValueError, match=rf"group_size={group_size}\b.*world_size={world_size}"):
        layout(world_size, group_size)


@pytest.mark.parametrize("bad", [2.0, "2", True, None])
def test_group_size_not_an_integer(bad: object) -> None:
    with pytest.raises(ValueError, match=r"group_size=.* is not an integer"):
        partition_ranks(4, bad)  # type: ignore[arg-type]


def test_world_size_below_one() -> None:
    with pytest.raises(ValueError, match=r"world_size=0 must be at least 1"):
        strided_ranks(0, 1)


def test_find_group_rank_in_no_group_or_two() -> None:
    with pytest.raises(ValueError, match=r"rank 5 is in 0 of the groups"):
        find_group(partition_ranks(4, 2), 5)
    with pytest.raises(ValueError, match=r"rank 1 is in 2 of the groups"):
        find_group([[0, 1], [1, 2]], 1)


def _lone_world(world_size: int = 1, rank: int = 0) -> World:
    import torch

    return World(rank, rank, world_size, world_size, 0, None, torch.device("cpu"), rank == 0)


@pytest.mark.parametrize("create", [partition, strided])
def test_one_process_without_group_gets_a_group_of_one(create, monkeypatch) -> None:
    assert not dist.is_initialized()

    def no_new_group(*args: object, **kwargs: object) -> None:
        raise AssertionError("new_group called with no process group")

    monkeypatch.setattr(dist, "new_group", no_new_group)
    expected = GroupInfo(group=None, size=1, rank=0, leader=0, index=0, ranks=(0,))
    assert create(1, world=_lone_world()) == expected
    assert create(1) == expected  # tandem.world() of a plain process
    with pytest.raises(ValueError, match=r"group_size=2 does not divide world_size=1"):
        create(2)


def test_several_processes_without_group_is_an_error() -> None:
    with pytest.raises(RuntimeError, match=r"rank 1 of 4 .* call tandem.init\(\) first"):
        partition(2, world=_lone_world(world_size=4, rank=1))
