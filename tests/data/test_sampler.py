"""tandem.data.DistributedSampler against torch's sampler and against an uninterrupted run.

Proves: for random data set lengths (0..300 and a few large ones), 1..8 replicas, every rank,
seeds, epochs 0..5, shuffle and drop_last, the sampler yields exactly the list that
``torch.utils.data.distributed.DistributedSampler`` yields and has its ``len`` (where torch would
give every rank nothing, an empty data set or drop_last with fewer samples than replicas, it
raises a ValueError instead). ``len`` is the same on every rank and is what each rank yields; the
ranks together cover every sample (padding) or never repeat one (drop_last). Resuming: for random
stops inside random epochs, the indices before a ``state_dict`` followed by those a fresh sampler
yields after ``load_state_dict`` (then later epochs after ``set_epoch``) equal the uninterrupted
run; the position counts yielded indices and is 0 after an epoch is exhausted. Bad arguments and
mismatched states raise a ValueError carrying the values; unset num_replicas/rank come from
``tandem.world()``.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.utils.data.distributed import DistributedSampler as TorchSampler

from tandem.data.sampler import DistributedSampler
from tandem.world import World

LENGTHS = st.one_of(st.integers(0, 300), st.sampled_from([1000, 4099, 10_007]))


def _valid(n: int, replicas: int, drop_last: bool) -> bool:
    return n > 0 and not (drop_last and n < replicas)


@settings(max_examples=200, deadline=None)
@given(
    n=LENGTHS,
    replicas=st.integers(1, 8),
    seed=st.integers(0, 2**32),
    epoch=st.integers(0, 5),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
)
@example(n=3, replicas=8, seed=0, epoch=0, shuffle=True, drop_last=False)  # pad > data set
@example(n=7, replicas=8, seed=0, epoch=1, shuffle=False, drop_last=True)  # every rank: 0
@example(n=0, replicas=1, seed=0, epoch=0, shuffle=True, drop_last=False)
def test_same_indices_as_torch(
    n: int, replicas: int, seed: int, epoch: int, shuffle: bool, drop_last: bool
) -> None:
    data = range(n)
    for rank in range(replicas):
        theirs = TorchSampler(data, replicas, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        theirs.set_epoch(epoch)
        if not _valid(n, replicas, drop_last):
            assert list(theirs) == []  # torch's silent answer that ours turns into an error
            with pytest.raises(ValueError, match=str(n) if n else "empty"):
                DistributedSampler(data, replicas, rank, shuffle, seed, drop_last)
            continue
        ours = DistributedSampler(
            data, replicas, rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        ours.set_epoch(epoch)
        assert list(ours) == list(theirs)
        assert len(ours) == len(theirs)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 300),
    replicas=st.integers(1, 8),
    seed=st.integers(0, 1000),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
)
def test_every_rank_runs_the_same_number_of_steps(
    n: int, replicas: int, seed: int, shuffle: bool, drop_last: bool
) -> None:
    if not _valid(n, replicas, drop_last):
        n = replicas
    shares = []
    for rank in range(replicas):
        sampler = DistributedSampler(range(n), replicas, rank, shuffle, seed, drop_last)
        shares.append(list(sampler))
        assert len(sampler) == len(shares[-1]) == len(shares[0])
    seen = [i for share in shares for i in share]
    if drop_last:
        assert len(set(seen)) == len(seen) == n - n % replicas
    else:
        assert set(seen) == set(range(n))
        assert len(seen) == n + (-n) % replicas


def test_padding_repeats_from_the_start() -> None:
    """The docstring's example: 3 samples on 8 ranks read 0 1 2 0 1 2 0 1."""
    got = [list(DistributedSampler(range(3), 8, r, shuffle=False)) for r in range(8)]
    assert got == [[0], [1], [2], [0], [1], [2], [0], [1]]


@st.composite
def interruptions(draw: st.DrawFn) -> tuple[dict, int, int, int, int, bool]:
    replicas = draw(st.integers(1, 8))
    drop_last = draw(st.booleans())
    n = draw(st.one_of(st.integers(replicas if drop_last else 1, 300), st.just(10_007)))
    args = {
        "dataset": range(n),
        "num_replicas": replicas,
        "rank": draw(st.integers(0, replicas - 1)),
        "shuffle": draw(st.booleans()),
        "seed": draw(st.integers(0, 1000)),
        "drop_last": drop_last,
    }
    last_epoch = draw(st.integers(0, 5))
    stop_epoch = draw(st.integers(0, last_epoch))
    per_rank = n // replicas if drop_last else -(-n // replicas)
    stop = draw(st.integers(0, per_rank))
    set_epoch_again = draw(st.booleans())  # the usual loop calls set_epoch(epoch) on resume
    return args, last_epoch, stop_epoch, stop, per_rank, set_epoch_again


@settings(max_examples=200, deadline=None)
@given(interruptions())
@example(({"dataset": range(5), "num_replicas": 2, "rank": 1}, 2, 1, 3, 3, False))  # at the end
def test_resume_matches_the_uninterrupted_run(
    case: tuple[dict, int, int, int, int, bool],
) -> None:
    args, last_epoch, stop_epoch, stop, per_rank, set_epoch_again = case
    whole = DistributedSampler(**args)
    expected = []
    for epoch in range(last_epoch + 1):
        whole.set_epoch(epoch)
        expected += list(whole)

    before = DistributedSampler(**args)
    got = []
    for epoch in range(stop_epoch):
        before.set_epoch(epoch)
        got += list(before)
    before.set_epoch(stop_epoch)
    it = iter(before)
    for k in range(stop):
        got.append(next(it))
        assert before.state_dict()["position"] == k + 1
    state = before.state_dict()
    assert (state["epoch"], state["position"]) == (stop_epoch, stop)

    after = DistributedSampler(**args)
    after.load_state_dict(state)
    assert after.state_dict() == state
    if set_epoch_again:
        after.set_epoch(stop_epoch)
    rest = list(after)
    assert len(rest) == per_rank - stop
    assert after.state_dict()["position"] == 0
    got += rest
    for epoch in range(stop_epoch + 1, last_epoch + 1):
        after.set_epoch(epoch)
        got += list(after)
    assert got == expected


def test_position_after_exhaustion_and_restart() -> None:
    sampler = DistributedSampler(range(10), 2, 0, seed=3)
    assert sampler.state_dict()["position"] == 0
    first = list(sampler)
    assert sampler.state_dict()["position"] == 0
    # Breaking off and calling iter() again starts the epoch afresh (torch does the same), and
    # the abandoned iterator no longer moves the position.
    old = iter(sampler)
    next(old)
    new = iter(sampler)
    next(old)
    assert sampler.state_dict()["position"] == 0
    assert list(new) == first


def test_set_epoch_to_another_epoch_drops_the_pending_resume() -> None:
    sampler = DistributedSampler(range(20), 3, 2, seed=1)
    sampler.set_epoch(4)
    it = iter(sampler)
    next(it), next(it)
    state = sampler.state_dict()
    fresh = DistributedSampler(range(20), 3, 2, seed=1)
    fresh.load_state_dict(state)
    fresh.set_epoch(5)
    assert fresh.state_dict()["position"] == 0
    whole = DistributedSampler(range(20), 3, 2, seed=1)
    whole.set_epoch(5)
    assert list(fresh) == list(whole)


@pytest.mark.parametrize(
    ("args", "values"),
    [
        ({"num_replicas": 0, "rank": 0}, ["0"]),
        ({"num_replicas": -2, "rank": 0}, ["-2"]),
        ({"num_replicas": 4, "rank": 4}, ["4"]),
        ({"num_replicas": 4, "rank": -1}, ["-1", "4"]),
        ({"num_replicas": 2, "rank": 0, "seed": -7}, ["-7"]),
        ({"num_replicas": 8, "rank": 0, "drop_last": True, "dataset": range(5)}, ["5", "8"]),
        ({"num_replicas": 2, "rank": 0, "dataset": []}, ["empty", "0"]),
    ],
)
def test_bad_arguments_name_their_values(args: dict, values: list[str]) -> None:
    args = {"dataset": range(10), **args}
    with pytest.raises(ValueError) as err:
        DistributedSampler(**args)
    for value in values:
        assert value in str(err.value)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("dataset_len", 11),
        ("seed", 99),
        ("shuffle", False),
        ("drop_last", True),
    ],
)
def test_mismatched_state_names_field_and_both_values(field: str, value: object) -> None:
    sampler = DistributedSampler(range(10), 2, 1, seed=5)
    state = {**sampler.state_dict(), field: value}
    mine = sampler.state_dict()[field]
    with pytest.raises(ValueError) as err:
        sampler.load_state_dict(state)
    assert field in str(err.value)
    assert repr(value) in str(err.value)
    assert repr(mine) in str(err.value)


@pytest.mark.parametrize("position", [-1, 6])
def test_state_position_out_of_range(position: int) -> None:
    sampler = DistributedSampler(range(10), 2, 1)
    with pytest.raises(ValueError, match=rf"position {position}, outside \[0, 5\]"):
        sampler.load_state_dict({**sampler.state_dict(), "position": position})


def test_state_missing_fields() -> None:
    sampler = DistributedSampler(range(10), 2, 1)
    state = sampler.state_dict()
    del state["seed"], state["epoch"]
    with pytest.raises(ValueError, match=r"lacks \['epoch', 'seed'\]"):
        sampler.load_state_dict(state)


def test_dataset_length_change_is_caught() -> None:
    data = list(range(10))
    sampler = DistributedSampler(data, 2, 0)
    data.append(10)
    with pytest.raises(ValueError, match="from 10 to 11"):
        iter(sampler)


def test_defaults_come_from_tandem_world(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = World(
        rank=2,
        local_rank=0,
        world_size=4,
        local_world_size=1,
        node_rank=2,
        backend="gloo",
        device=torch.device("cpu"),
        is_main=False,
    )
    # The module, not the package attribute of the same name (which is the function).
    monkeypatch.setattr(importlib.import_module("tandem.world"), "world", lambda: fake)
    sampler = DistributedSampler(range(10))
    assert (sampler.num_replicas, sampler.rank) == (4, 2)
    assert list(sampler) == list(TorchSampler(range(10), 4, 2))
    assert DistributedSampler(range(10), rank=1).num_replicas == 4
    assert DistributedSampler(range(10), num_replicas=8).rank == 2
