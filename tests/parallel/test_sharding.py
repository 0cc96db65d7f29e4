"""The sharding rule (assign_owners, flat_shard), no processes, against independent oracles.

assign_owners, over random sizes and world sizes 1..8:

- every parameter has exactly one owner in [0, world_size);
- each choice satisfies the documented rule, checked on the output (replaying the owners in the
  documented order, every parameter went to a least-loaded rank, the lowest on a tie) rather
  than by computing the owners a second way;
- balance: the loads differ by at most the largest size (the documented bound), and the
  heaviest rank is within the largest-first greedy's guarantee, 4/3 - 1/(3 world_size), of the
  optimum found by brute force over every assignment (small cases), which in turn is at least
  the independent lower bound max(largest, ceil(total / world_size));
- metamorphic: scaling every size by the same factor (bytes of float32 versus float64) changes
  no owner; with distinct sizes, reordering the parameters moves each owner with its size;
- a hand-written table of small cases.

flat_shard, on real tensors: the slices of all ranks, concatenated, give back the padded
buffer, whose first ``numel`` elements are the tensor exactly; each slice equals
``torch.tensor_split`` of the padded buffer into world_size pieces; slices are equal in size
(the documented rule, so reduce-scatter/all-gather apply); the padding, fewer than world_size
elements, is at the end, in the last ranks' slices only; plus a hand-written table. Invalid
arguments raise ValueError naming the value.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tandem.parallel.sharding import assign_owners, flat_shard, owned_indices, padded_numel

sizes_st = st.lists(st.integers(0, 10_000), max_size=40)
world_st = st.integers(1, 8)


def _loads(sizes: list[int], owners: list[int], world_size: int) -> list[int]:
    loads = [0] * world_size
    for size, owner in zip(sizes, owners, strict=True):
        loads[owner] += size
    return loads


def _optimum(sizes: list[int], world_size: int) -> int:
    """The smallest possible heaviest load, by trying every assignment (small cases only)."""
    return min(
        max(_loads(sizes, list(owners), world_size))
        for owners in itertools.product(range(world_size), repeat=len(sizes))
    )


@given(sizes_st, world_st)
def test_each_parameter_has_one_owner_and_loads_are_balanced(sizes, world_size):
    owners = assign_owners(sizes, world_size)
    assert len(owners) == len(sizes)
    assert all(0 <= r < world_size for r in owners)
    shards = [owned_indices(owners, r) for r in range(world_size)]
    assert sorted(i for s in shards for i in s) == list(range(len(sizes)))
    for r, shard in enumerate(shards):
        assert shard == sorted(shard) and all(owners[i] == r for i in shard)
    loads = [sum(sizes[i] for i in s) for s in shards]
    assert sum(loads) == sum(sizes)
    assert max(loads) - min(loads) <= max(sizes, default=0)


@given(sizes_st, world_st)
def test_every_choice_follows_the_documented_rule(sizes, world_size):
    """Largest first (ties by registration order), to the least-loaded rank (ties: lowest)."""
    owners = assign_owners(sizes, world_size)
    loads = [0] * world_size
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    for i in order:
        least = min(loads)
        assert loads[owners[i]] == least, (i, owners, loads)
        assert owners[i] == loads.index(least), (i, owners, loads)
        loads[owners[i]] += sizes[i]


@settings(deadline=None)  # brute force: up to 3**7 assignments
@given(st.lists(st.integers(0, 50), max_size=7), st.integers(1, 3))
def test_heaviest_rank_within_the_greedy_guarantee_of_the_optimum(sizes, world_size):
    heaviest = max(_loads(sizes, assign_owners(sizes, world_size), world_size), default=0)
    best = _optimum(sizes, world_size)
    lower = max(max(sizes, default=0), math.ceil(sum(sizes) / world_size))
    assert best >= lower
    # Graham's bound for largest-first list scheduling, in integers: 3m * heaviest <= (4m-1) * best
    assert 3 * world_size * heaviest <= (4 * world_size - 1) * best, (sizes, heaviest, best)


@given(sizes_st, world_st, st.integers(1, 8))
def test_scaling_every_size_changes_no_owner(sizes, world_size, factor):
    # Bytes of the same parameters in float64 instead of float32 are all doubled.
    assert assign_owners([s * factor for s in sizes], world_size) == assign_owners(
        sizes, world_size
    )


@given(st.lists(st.integers(0, 10_000), unique=True, max_size=30), world_st, st.randoms())
def test_owner_follows_the_size_not_the_position(sizes, world_size, rnd):
    perm = list(range(len(sizes)))
    rnd.shuffle(perm)
    owners = assign_owners(sizes, world_size)
    shuffled = assign_owners([sizes[j] for j in perm], world_size)
    assert [owners[j] for j in perm] == shuffled


@pytest.mark.parametrize(
    ("sizes", "world_size", "expected"),
    [
        ([10, 40, 30, 20], 2, [0, 0, 1, 1]),  # the docstring's example
        ([5, 5, 5, 5, 5], 3, [0, 1, 2, 0, 1]),  # equal sizes: round robin, registration order
        ([3, 7], 4, [1, 0]),  # more ranks than parameters: the last ranks own nothing
        ([], 3, []),
        ([1, 2, 3], 1, [0, 0, 0]),
        ([0, 0, 0], 2, [0, 0, 0]),  # empty parameters: no load ever grows, rank 0 owns all
        ([8, 1, 1, 1, 1, 1, 1, 1, 1], 2, [0, 1, 1, 1, 1, 1, 1, 1, 1]),
        ([6, 6, 4, 4, 4], 2, [0, 1, 0, 1, 0]),
        ([100, 1, 50, 50], 3, [0, 1, 1, 2]),  # 100 | 50 | 50, then 1 to the lowest lightest
    ],
)
def test_hand_written_owners(sizes, world_size, expected):
    assert assign_owners(sizes, world_size) == expected


def _padded_by_hand(numel: int, world_size: int) -> int:
    return math.ceil(numel / world_size) * world_size


@settings(deadline=None)  # torch's first calls are slow
@given(st.integers(0, 2_000), world_st)
@example(1, 3)  # the last two ranks hold padding only
@example(0, 4)
def test_flat_shards_give_back_the_tensor_exactly(numel, world_size):
    whole = torch.randn(numel, dtype=torch.float64)
    padded = padded_numel(numel, world_size)
    assert padded == _padded_by_hand(numel, world_size)
    buffer = torch.cat([whole, torch.full((padded - numel,), float("nan"), dtype=whole.dtype)])
    slices = [flat_shard(numel, world_size, r) for r in range(world_size)]
    shards = [buffer[start:end] for start, end in slices]

    # Concatenated in rank order, the shards are the padded buffer and begin with the tensor.
    assert torch.equal(torch.cat(shards)[:numel], whole)
    assert sum(s.numel() for s in shards) == padded
    # The same cut as torch's own: world_size pieces of the padded buffer.
    for mine, theirs in zip(shards, torch.tensor_split(buffer, world_size), strict=True):
        assert torch.equal(mine.nan_to_num(7.0), theirs.nan_to_num(7.0))
    # Equal sizes (what reduce-scatter and all-gather need).
    assert {end - start for start, end in slices} == {padded // world_size}
    # Padding: fewer than world_size elements, at the end, so only in the last ranks' slices.
    assert 0 <= padded - numel < world_size
    real = [max(0, min(end, numel) - start) for start, end in slices]
    assert sum(real) == numel
    assert real == sorted(real, reverse=True)
    full = padded // world_size
    for r, (start, end) in enumerate(slices):
        has_padding = bool(shards[r].isnan().any())
        assert has_padding == (end > numel)
        if has_padding:  # everything after the first padded element is padding
            first = int(shards[r].isnan().nonzero()[0])
            assert shards[r][first:].isnan().all() and start + first == max(start, numel)
        if r + 1 < world_size and real[r + 1] > 0:
            assert real[r] == full  # a rank before one holding data is full


@pytest.mark.parametrize(
    ("numel", "world_size", "expected"),
    [
        (10, 4, [(0, 3), (3, 6), (6, 9), (9, 12)]),  # the docstring's example
        (8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),  # divides: no padding
        (1, 3, [(0, 1), (1, 2), (2, 3)]),  # the last two ranks hold padding only
        (0, 3, [(0, 0), (0, 0), (0, 0)]),
        (5, 1, [(0, 5)]),
        (7, 2, [(0, 4), (4, 8)]),
        (9, 5, [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]),
    ],
)
def test_hand_written_flat_shards(numel, world_size, expected):
    assert [flat_shard(numel, world_size, r) for r in range(world_size)] == expected
    assert padded_numel(numel, world_size) == expected[-1][1]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: assign_owners([1], 0), "world_size=0"),
        (lambda: assign_owners([1, -2], 2), r"sizes\[1\]=-2"),
        (lambda: flat_shard(10, 4, 4), r"rank 4 not in \[0, 4\)"),
        (lambda: flat_shard(10, 4, -1), r"rank -1 not in \[0, 4\)"),
        (lambda: flat_shard(10, 0, 0), "world_size=0"),
        (lambda: padded_numel(-1, 2), "numel=-1"),
    ],
)
def test_invalid_arguments_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()
