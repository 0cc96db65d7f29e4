"""tandem.data.StatefulLoader: a checkpointed position counts the samples trained on.

The oracle is the epoch itself: over ranks that together see every sample once per epoch, the
samples trained before a checkpoint plus those trained after resuming from it must be every
sample of the epoch exactly once.

Proves:

- with a DataLoader of 2 worker processes prefetching 2 batches each, stopping after 3
  batches, the bare sampler's ``state_dict()`` counts the indices the loader drew (28, not the
  12 trained on; or 0, as if the epoch were done, when the loader drew a rank's whole share of
  24) and warns, naming that position and StatefulLoader; the StatefulLoader's state counts
  12, and a fresh loader resumed from it trains exactly the rest: the union is the epoch once,
  on both ranks of a 2-rank sampler; no warning comes from the StatefulLoader itself;
- the same state resumes in a world of 3 ranks, with the rest dealt anew: again every sample
  of the epoch exactly once;
- a bare DataLoader without workers draws no further than it yields: no warning;
- after the epoch's last batch the state says the epoch is done, whether the last batch is full
  or partial: loading it, the same epoch yields nothing, the next one all of its samples;
- ``len`` is the DataLoader's; bad arguments raise ValueError naming what is wrong.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from tandem.data.sampler import DistributedSampler
from tandem.data.stateful_loader import StatefulLoader

N = 48
BATCH = 4


class _Ids(Dataset):
    """Item i is the tensor [i]: a batch carries the ids of its samples."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


def _ids(batch: torch.Tensor) -> list[int]:
    return batch.view(-1).tolist()


def _loader(sampler, **kwargs) -> StatefulLoader:
    return StatefulLoader(_Ids(), BATCH, sampler=sampler, **kwargs)


def _first_batches(loader, k: int) -> list[int]:
    seen: list[int] = []
    it = iter(loader)
    for _ in range(k):
        seen += _ids(next(it))
    return seen


@pytest.mark.parametrize("n", [96, 48])  # 48 per rank: 28 drawn; 24: all drawn, position 0
def test_workers_prefetching_resume_covers_the_epoch_once(n):
    workers = {"num_workers": 2, "prefetch_factor": 2}
    trained: list[int] = []
    states = []
    for rank in range(2):
        sampler = DistributedSampler(_Ids(n), num_replicas=2, rank=rank, seed=3)
        loader = StatefulLoader(_Ids(n), BATCH, sampler=sampler, **workers)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the loader's own snapshots must not warn
            trained += _first_batches(loader, 3)
            state = loader.state_dict()
        assert (state["sampler"]["position"], state["batches"]) == (3 * BATCH, 3)
        states.append(state)
        # The bare sampler counts what the workers were sent, 7 batches: ahead of the 3
        # trained on, or, with the whole share drawn, back at 0 as if the epoch were done.
        with pytest.warns(UserWarning, match="StatefulLoader") as caught:
            drawn = sampler.state_dict()["position"]
        assert drawn == (7 * BATCH if n == 96 else 0)
        assert f"position {drawn} (epoch 0)" in str(caught[0].message)
    assert states[0]["sampler"] == states[1]["sampler"]  # lock step: rank 0's serves all

    for rank in range(2):
        resumed_sampler = DistributedSampler(_Ids(n), num_replicas=2, rank=rank, seed=3)
        resumed = StatefulLoader(_Ids(n), BATCH, sampler=resumed_sampler, **workers)
        resumed.load_state_dict(states[0])
        trained += [i for batch in resumed for i in _ids(batch)]
    assert sorted(trained) == list(range(n))


def test_state_resumes_at_another_world_size():
    trained: list[int] = []
    for rank in range(2):
        loader = _loader(DistributedSampler(_Ids(), num_replicas=2, rank=rank, seed=5))
        trained += _first_batches(loader, 3)
        if rank == 0:
            state = loader.state_dict()
    for rank in range(3):
        resumed = _loader(DistributedSampler(_Ids(), num_replicas=3, rank=rank, seed=5))
        resumed.load_state_dict(state)
        trained += [i for batch in resumed for i in _ids(batch)]
    assert sorted(trained) == list(range(N))


def test_bare_loader_without_workers_does_not_warn():
    sampler = DistributedSampler(_Ids(), num_replicas=2, rank=0)
    it = iter(DataLoader(_Ids(), BATCH, sampler=sampler))
    for _ in range(3):
        next(it)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sampler.state_dict()["position"] == 3 * BATCH


@pytest.mark.parametrize("n", [48, 46])  # 24 per rank: full last batch; 23: a partial one
def test_state_after_the_last_batch_is_the_epoch_done(n):
    sampler = DistributedSampler(_Ids(n), num_replicas=2, rank=1, seed=1)
    loader = StatefulLoader(_Ids(n), BATCH, sampler=sampler)
    assert len(loader) == len(DataLoader(_Ids(n), BATCH, sampler=sampler)) == 6
    sampler.set_epoch(4)
    epoch = [i for batch in loader for i in _ids(batch)]
    state = loader.state_dict()
    assert (state["sampler"]["epoch"], state["sampler"]["position"]) == (4, len(sampler))

    fresh_sampler = DistributedSampler(_Ids(n), num_replicas=2, rank=1, seed=1)
    fresh = StatefulLoader(_Ids(n), BATCH, sampler=fresh_sampler)
    fresh.load_state_dict(state)
    fresh_sampler.set_epoch(4)
    assert list(fresh) == []
    fresh_sampler.set_epoch(5)
    assert len([i for batch in fresh for i in _ids(batch)]) == len(epoch)


def test_bad_arguments():
    sampler = DistributedSampler(_Ids(), num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="RandomSampler has no state_dict"):
        StatefulLoader(_Ids(), BATCH, sampler=torch.utils.data.RandomSampler(_Ids()))
    with pytest.raises(ValueError, match="in_order=True"):
        StatefulLoader(_Ids(), BATCH, sampler=sampler, in_order=False)
    with pytest.raises(ValueError, match=r"\['shuffle'\]"):
        StatefulLoader(_Ids(), BATCH, sampler=sampler, shuffle=True)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got 0"):
        StatefulLoader(_Ids(), 0, sampler=sampler)
    with pytest.raises(ValueError, match=r"lacks 'sampler'; it has \['batches'\]"):
        StatefulLoader(_Ids(), BATCH, sampler=sampler).load_state_dict({"batches": 3})
