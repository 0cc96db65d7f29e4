"""DistributedSampler resumed at another world size: the rest of the epoch, nothing else.

The oracle is the data set: ranks that together train each sample of an epoch once must, across
a stop at ``W`` ranks and a resume at ``W'``, still train every sample once.

Proves, for random data set lengths, world sizes 1..6 before and after, stops anywhere in the
epoch, shuffle and drop_last:

- the samples every rank trained before the stop plus those every new rank yields after it
  cover the data set; a sample comes twice only as padding (at most ``W - 1`` of the stopped
  dealing, when it had reached its padding, and at most ``W' - 1`` of the new one), and with
  drop_last none comes twice and fewer than ``W'`` are left out;
- the new ranks all yield the same number of samples, ``current_len()`` (less the position at
  the same world size), and after that epoch the next one is the ordinary epoch of ``W'``
  ranks;
- without padding (lengths the world sizes divide) a chain of resumes 2 -> 3 -> 4 trains every
  sample exactly once, the state carrying the places trained before as ``offset``;
- a position beyond what the saved world's epoch holds is refused with both numbers.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.data.sampler import DistributedSampler


def _samplers(n: int, world: int, **kwargs) -> list[DistributedSampler]:
    return [DistributedSampler(range(n), world, rank, **kwargs) for rank in range(world)]


def _take(sampler: DistributedSampler, k: int) -> list[int]:
    it = iter(sampler)
    return [next(it) for _ in range(k)]


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, 60),
    before=st.integers(1, 6),
    after=st.integers(1, 6),
    cut=st.floats(0, 1),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    epoch=st.integers(0, 3),
)
def test_rest_of_the_epoch_at_another_world_size(n, before, after, cut, shuffle, drop_last, epoch):
    if drop_last and n < max(before, after):
        return  # no sampler to build: a ValueError, tested with the sampler
    kwargs = {"shuffle": shuffle, "seed": 7, "drop_last": drop_last}
    old = _samplers(n, before, **kwargs)
    stop = round(cut * len(old[0]))
    trained = []
    for s in old:
        s.set_epoch(epoch)
        trained += _take(s, stop)
    state = old[0].state_dict()

    new = _samplers(n, after, **kwargs)
    rest = []
    for s in new:
        s.load_state_dict(state)
        s.set_epoch(epoch)  # the usual loop: keeps the pending resume
    assert len({s.current_len() for s in new}) == 1
    for s in new:
        left = s.current_len() - s.state_dict()["position"]  # position: 0 unless same world
        mine = list(s)
        assert len(mine) == left
        rest += mine
    counts = Counter(trained + rest)
    if drop_last:
        assert max(counts.values()) == 1
        assert n - len(counts) < after
    else:
        assert sorted(counts) == list(range(n))
        padding_before = max(0, stop * before - n)
        assert sum(counts.values()) - n <= padding_before + after - 1

    # The epoch after is the ordinary epoch of the new world.
    for s, fresh in zip(new, _samplers(n, after, **kwargs), strict=True):
        s.set_epoch(epoch + 1)
        fresh.set_epoch(epoch + 1)
        assert list(s) == list(fresh)


def test_chain_of_resumes_trains_every_sample_once():
    n = 72  # rests of 72, 54 and 24 samples: 2, 3 and 4 divide them, so no padding
    trained: list[int] = []
    state = None
    for world, per_rank in ((2, 9), (3, 10), (4, None)):
        samplers = _samplers(n, world, seed=11)
        for s in samplers:
            if state is not None:
                s.load_state_dict(state)
            s.set_epoch(2)
            trained += list(s) if per_rank is None else _take(s, per_rank)
        state = samplers[0].state_dict()
        if world == 3:
            assert (state["offset"], state["position"]) == (2 * 9, 10)
    assert sorted(trained) == list(range(n))


def test_position_beyond_the_saved_epoch_is_refused():
    state = _samplers(10, 2)[0].state_dict()  # 5 per rank at 2 ranks
    sampler = DistributedSampler(range(10), 3, 0)
    with pytest.raises(ValueError, match=r"position 6, outside \[0, 5\]"):
        sampler.load_state_dict({**state, "position": 6})
    with pytest.raises(ValueError, match=r"offset 11, outside \[0, 10\]"):
        sampler.load_state_dict({**state, "offset": 11})
