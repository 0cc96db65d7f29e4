"""The sharding rule (assign_owners, flat_shard), no processes.

Proves, over random sizes and world sizes 1..8: every parameter has exactly one owner in
[0, world_size); the loads of any two ranks differ by at most the largest size; the result is
the greedy rule itself (largest first, ties by registration order, to the least-loaded rank,
ties to the lowest rank), checked against an independent heap-based implementation, and so
deterministic. flat_shard's slices are equal, contiguous, disjoint, in rank order and cover
[0, padded) with padded the least multiple of world_size >= numel. Invalid arguments raise
ValueError naming the value.
"""

from __future__ import annotations

import heapq
import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tandem.parallel.sharding import assign_owners, flat_shard, owned_indices, padded_numel

sizes_st = st.lists(st.integers(0, 10_000), max_size=40)
world_st = st.integers(1, 8)


def _greedy_heap(sizes: list[int], world_size: int) -> list[int]:
    """The same rule, written differently: a heap of (load, rank)."""
    heap = [(0, r) for r in range(world_size)]
    owners = [-1] * len(sizes)
    for size, i in sorted(((-s, i) for i, s in enumerate(sizes))):
        load, r = heapq.heappop(heap)
        owners[i] = r
        heapq.heappush(heap, (load - size, r))
    return owners


@given(sizes_st, world_st)
def test_each_parameter_has_one_owner_and_loads_are_balanced(sizes, world_size):
    owners = assign_owners(sizes, world_size)
    assert len(owners) == len(sizes)
    assert all(0 <= r < world_size for r in owners)
    shards = [owned_indices(owners, r) for r in range(world_size)]
    assert sorted(i for s in shards for i in s) == list(range(len(sizes)))
    loads = [sum(sizes[i] for i in s) for s in shards]
    assert max(loads) - min(loads) <= max(sizes, default=0)


@given(sizes_st, world_st)
def test_owners_follow_the_greedy_rule_deterministically(sizes, world_size):
    owners = assign_owners(sizes, world_size)
    assert owners == _greedy_heap(sizes, world_size)
    assert owners == assign_owners(list(sizes), world_size)


def test_worked_examples():
    assert assign_owners([10, 40, 30, 20], 2) == [0, 0, 1, 1]
    # Equal sizes go round-robin in registration order.
    assert assign_owners([5, 5, 5, 5, 5], 3) == [0, 1, 2, 0, 1]
    # More ranks than parameters: the last ranks own nothing.
    assert assign_owners([3, 7], 4) == [1, 0]
    assert assign_owners([], 3) == []
    assert assign_owners([1, 2, 3], 1) == [0, 0, 0]


@given(st.integers(0, 10_000), world_st)
def test_flat_shards_tile_the_padded_buffer(numel, world_size):
    padded = padded_numel(numel, world_size)
    assert padded % world_size == 0 and numel <= padded < numel + world_size
    slices = [flat_shard(numel, world_size, r) for r in range(world_size)]
    assert slices[0][0] == 0 and slices[-1][1] == padded
    for (_, end), (start, _) in itertools.pairwise(slices):
        assert end == start  # contiguous and disjoint, in rank order
    assert {end - start for start, end in slices} == {padded // world_size}


def test_flat_shard_example():
    assert [flat_shard(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: assign_owners([1], 0), "world_size=0"),
        (lambda: assign_owners([1, -2], 2), r"sizes\[1\]=-2"),
        (lambda: flat_shard(10, 4, 4), r"rank 4 not in \[0, 4\)"),
        (lambda: flat_shard(10, 4, -1), r"rank -1 not in \[0, 4\)"),
        (lambda: padded_numel(-1, 2), "numel=-1"),
    ],
)
def test_invalid_arguments_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()
