"""tandem.groups.partition / strided create working process groups in real processes.

Proves, with 4 Gloo ranks: partition(2) gives the groups [0, 1], [2, 3] and strided(2) the groups
[0, 2], [1, 3]; an all_reduce of the global rank restricted to a rank's group sums exactly the
group's members (so the handle is the group the record describes, and every rank created every
group: otherwise new_group would hang); a broadcast from ``leader`` reaches the group only; each
rank's record has the right size, group rank, leader and index. A group_size of 3 with 4 ranks
raises ValueError naming both values on every rank, within seconds (no rank waits in new_group).
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from tandem.groups import GroupInfo, partition, strided
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed


def _use(info: GroupInfo) -> tuple[GroupInfo, float, float]:
    """all_reduce the global ranks and broadcast the leader's rank, both inside the group."""
    rank = dist.get_rank()
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=info.group)
    # torch takes a global rank as src, even inside a group: the leader field is that rank.
    leader = torch.tensor([float(rank)])
    dist.broadcast(leader, src=info.leader, group=info.group)
    # The handle is not picklable; the test checks the rest of the record.
    return replace(info, group=None), total.item(), leader.item()


def _both_layouts() -> list[tuple[GroupInfo, float, float]]:
    # Both layouts in one job: the second's groups are created after the first's, on every rank.
    return [_use(partition(2)), _use(strided(2))]


def _bad_size() -> str:
    start = time.monotonic()
    try:
        partition(3)
    except ValueError as exc:
        return f"{exc} after {time.monotonic() - start:.1f} s"
    return "no error"


def test_partition_and_strided_on_four_ranks() -> None:
    results = run_ranks(_both_layouts, world_size=4, timeout=30)
    expected_partition = [(0, 1), (0, 1), (2, 3), (2, 3)]
    expected_strided = [(0, 2), (1, 3), (0, 2), (1, 3)]
    for rank, (by_partition, by_strided) in enumerate(results):
        for (info, total, leader), members, index in (
            (by_partition, expected_partition[rank], rank // 2),
            (by_strided, expected_strided[rank], rank % 2),
        ):
            assert info == GroupInfo(
                group=None,
                size=2,
                rank=members.index(rank),
                leader=members[0],
                index=index,
                ranks=members,
            ), (rank, info)
            assert total == sum(members), (rank, info, total)
            assert leader == members[0], (rank, info, leader)


def test_group_size_not_dividing_world_fails_on_every_rank() -> None:
    messages = run_ranks(_bad_size, world_size=4, timeout=20)
    for message in messages:
        assert "group_size=3 does not divide world_size=4" in message, messages
        seconds = float(message.rsplit(" after ", 1)[1].removesuffix(" s"))
        assert seconds < 5.0, messages
