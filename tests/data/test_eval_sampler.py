"""EvalSampler and shard_range, no processes.

Proves: for every data set length 0..500 and 1..9 replicas, the ranks' shards concatenated in
rank order are exactly ``range(n)`` (so every sample is on exactly one rank, none is padded or
dropped, and rank order is data set order, which the ordered gather relies on), shard sizes
differ by at most one with the longer shards first, and the sampler yields its shard with a
matching ``len``. The docstring's worked example (10 samples on 4 ranks: 3, 3, 2, 2) and the
empty shards of a data set smaller than the world hold; torch's DistributedSampler, on the same
example, repeats samples (the bias EvalSampler removes). Defaults come from ``tandem.world()``
(one process: rank 0 of 1); bad replicas or rank raise ValueError naming the values.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler

from tandem.data import EvalSampler
from tandem.data.eval_sampler import shard_range


@given(n=st.integers(0, 500), replicas=st.integers(1, 9))
def test_every_sample_exactly_once_in_rank_order(n: int, replicas: int) -> None:
    data = range(n)
    samplers = [EvalSampler(data, num_replicas=replicas, rank=r) for r in range(replicas)]
    shards = [list(s) for s in samplers]
    assert [i for shard in shards for i in shard] == list(range(n))
    sizes = [len(shard) for shard in shards]
    assert sizes == [len(s) for s in samplers]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the extra samples go to the first ranks
    assert all(s.total_size == n for s in samplers)


def test_worked_example_ten_samples_on_four_ranks() -> None:
    shards = [list(EvalSampler(range(10), num_replicas=4, rank=r)) for r in range(4)]
    assert shards == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    # torch pads to ceil(10 / 4) * 4 = 12 by repeating samples 0 and 1.
    torch_shards = [
        list(DistributedSampler(range(10), num_replicas=4, rank=r, shuffle=False)) for r in range(4)
    ]
    assert sorted(i for shard in torch_shards for i in shard) == [0, 0, 1, 1, *range(2, 10)]


def test_fewer_samples_than_ranks_leaves_ranks_empty() -> None:
    shards = [list(shard_range(3, 5, r)) for r in range(5)]
    assert shards == [[0], [1], [2], [], []]
    assert len(EvalSampler([], num_replicas=3, rank=2)) == 0


def test_defaults_from_world_of_one_process() -> None:
    sampler = EvalSampler(range(7))
    assert (sampler.num_replicas, sampler.rank, list(sampler)) == (1, 0, list(range(7)))
    sampler.set_epoch(3)  # accepted, changes nothing
    assert list(sampler) == list(range(7))


@pytest.mark.parametrize(
    ("replicas", "rank", "message"),
    [
        (0, 0, "num_replicas must be >= 1, got 0"),
        (-2, 0, "num_replicas must be >= 1, got -2"),
        (4, 4, r"rank 4 not in \[0, 4\)"),
        (4, -1, r"rank -1 not in \[0, 4\)"),
    ],
)
def test_bad_input_names_the_values(replicas: int, rank: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EvalSampler(range(10), num_replicas=replicas, rank=rank)


def test_negative_length_names_it() -> None:
    with pytest.raises(ValueError, match="num_samples must be >= 0, got -1"):
        shard_range(-1, 2, 0)
