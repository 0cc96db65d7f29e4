"""BroadcastLoader delivers, on every rank, exactly the batches that reading directly gives.

The oracle is the loader itself, read directly on the same rank with the same sampler:

- broadcast mode, 4 ranks in groups [0, 1] and [2, 3]: every member yields, over two shuffled
  epochs, exactly what its group's shard read directly yields (the leader reads the group's shard
  through a sampler over groups); only the leaders touch the data set.
- scatter mode, 4 ranks: every rank yields exactly what its own sampler read directly yields; with
  the world as one group (rank 0 reads for all) and in two groups with a non-default leader and
  loaders of different lengths per member.
- batches vary in shape (padded variable-length sequences, a short last batch) and dtype (bool,
  int64, int32, float16, float64: the flat buffer's alignment) and carry non-tensor metadata
  (string ids, ints, a tuple) in dicts, lists and a named tuple.
- the leader's loader raising, while reading or while being built, or yielding metadata that
  cannot be pickled: every rank raises
  LoaderError naming the reading rank and the cause (no hang: the harness timeout would fail it),
  and the group stays in step for the next loader.
- ranks that disagree on the leader: ValueError on every rank.
- one process without a process group: a plain loader, in both modes.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from tandem.data.broadcast import BroadcastLoader, LoaderError
from tests.harness import run_ranks

SAMPLES = 40
BATCH = 3
EPOCHS = 2


class Extra(NamedTuple):
    scale: torch.Tensor
    note: str


class Sequences(Dataset):
    """Sample i: a sequence of length 1 + i % 5, a label and an id; counts its reads."""

    def __init__(self, size: int = SAMPLES, fail_at: int | None = None) -> None:
        self.size = size
        self.fail_at = fail_at
        self.reads = 0

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i == self.fail_at:
            raise OSError(f"disk error reading sample {i}")
        self.reads += 1
        g = torch.Generator().manual_seed(i)
        return {"tokens": torch.randint(1, 100, (1 + i % 5,), generator=g), "id": f"s{i}"}


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Pad to the longest sequence: the batches differ in shape from one to the next."""
    longest = max(len(s["tokens"]) for s in samples)
    tokens = torch.zeros(len(samples), longest, dtype=torch.int64)
    for j, s in enumerate(samples):
        tokens[j, : len(s["tokens"])] = s["tokens"]
    return {
        "mask": tokens != 0,  # bool first: the int64 after it needs an aligned offset
        "tokens": tokens,
        "lengths": torch.tensor([len(s["tokens"]) for s in samples], dtype=torch.int32),
        "extra": Extra(torch.tensor(0.5, dtype=torch.float16), note="padded"),
        "weights": [tokens.sum(1, dtype=torch.float64) / 7, torch.empty(0, 3)],
        "ids": [s["id"] for s in samples],
        "meta": ("epoch-batch", longest),
    }


def shard_loader(dataset: Dataset, shards: int, index: int, epoch: int) -> DataLoader:
    sampler = DistributedSampler(dataset, num_replicas=shards, rank=index, shuffle=True, seed=7)
    sampler.set_epoch(epoch)
    return DataLoader(dataset, batch_size=BATCH, sampler=sampler, collate_fn=collate)


def assert_same(got: Any, want: Any, where: str = "batch") -> None:
    """Same structure and types, equal tensors (shape, dtype, values), equal other values."""
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, (
            f"{where}: {got.dtype} {tuple(got.shape)} != {want.dtype} {tuple(want.shape)}"
        )
        assert torch.equal(got, want), f"{where}: values differ"
    elif isinstance(want, dict):
        assert list(got) == list(want), f"{where}: keys {list(got)} != {list(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        for j, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{j}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def assert_same_batches(got: list, want: list, who: str) -> None:
    assert len(got) == len(want), f"{who}: {len(got)} batches, direct reading gives {len(want)}"
    for b, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_same(g, w, f"{who}, batch {b}")


# --- rank bodies (module level: the harness pickles them by reference) --------------------------


def _groups_of_two() -> tuple[int, dist.ProcessGroup]:
    # Every rank creates every group, in the same order: new_group is collective over the world.
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    index = dist.get_rank() // 2
    return index, groups[index]


def _broadcast_mode() -> dict[str, Any]:
    index, group = _groups_of_two()
    shared = Sequences()
    # Every rank passes the factory; only the leader calls it (the reads below prove it).
    loader = BroadcastLoader(lambda: shard_loader(shared, 2, index, 0), group=group)
    received, direct = [], []
    for e in range(EPOCHS):
        loader.set_epoch(e)
        received.append(list(loader))
        direct.append(list(shard_loader(Sequences(), 2, index, e)))
    return {"received": received, "direct": direct, "reads": shared.reads, "len": len(loader)}


def _scatter_mode(grouped: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    if grouped:
        # Leader: the group's second rank; rank r's loader has its own number of batches.
        _, group = _groups_of_two()
        leader = dist.get_process_group_ranks(group)[1]
        datasets = {r: Sequences(size=SAMPLES - 6 * r) for r in range(4)}
    else:
        group, leader = None, None
        datasets = {r: Sequences() for r in range(4)}

    def factory(r: int) -> DataLoader:
        return shard_loader(datasets[r], 4, r, 0)

    # The ranks that do not read may pass None (they do, in the world case).
    source = factory if grouped or rank == 0 else None
    loader = BroadcastLoader(source, group=group, leader=leader, mode="scatter")
    received, direct = [], []
    for e in range(EPOCHS):
        loader.set_epoch(e)
        received.append(list(loader))
        direct.append(list(shard_loader(Sequences(datasets[rank].size), 4, rank, e)))
    reads = {r: d.reads for r, d in datasets.items()}
    return {"received": received, "direct": direct, "reads": reads, "len": len(loader)}


def _failing() -> dict[str, str]:
    """Failures in turn, in one world: after each, the group is still in step for the next."""
    messages = {}
    cases = [
        ("broadcast", "read"),
        ("scatter", "read"),
        ("broadcast", "build"),
        ("scatter", "pickle"),
    ]
    for mode, when in cases:

        def build(r: int = 0, mode: str = mode, when: str = when) -> Any:
            if when == "build":
                raise RuntimeError(f"no such file: shard-{r}")
            if when == "pickle":  # metadata that cannot travel: a local function
                return [{"x": torch.ones(2), "f": lambda: r}]
            # Broadcast mode: the leader's loader fails; scatter mode: the one read for rank 2.
            fails = mode == "broadcast" or r == 2
            dataset = Sequences(fail_at=7 if fails else None)
            return DataLoader(dataset, batch_size=BATCH, collate_fn=collate)

        with pytest.raises(LoaderError) as info:
            for _ in BroadcastLoader(build, mode=mode):  # type: ignore[arg-type]
                pass
        if dist.get_rank() == 0:  # the reader's own error is chained to the original exception
            assert info.value.__cause__ is not None
        messages[f"{mode}-{when}"] = str(info.value)
    return messages


def _disagreeing_leaders() -> str:
    with pytest.raises(ValueError) as info:
        BroadcastLoader([], leader=dist.get_rank() % 2)
    return str(info.value)


# --- tests -------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_broadcast_mode_gives_every_member_its_groups_batches():
    results = run_ranks(_broadcast_mode, world_size=4, timeout=60)
    for rank, r in enumerate(results):
        for e in range(EPOCHS):
            assert_same_batches(r["received"][e], r["direct"][e], f"rank {rank}, epoch {e}")
        assert r["len"] == len(r["direct"][0]) == 7  # 20 samples per group, batches of 3
    # Only the leaders read: each its group's 20 samples per epoch.
    assert [r["reads"] for r in results] == [20 * EPOCHS, 0, 20 * EPOCHS, 0]
    # The members of a group share one stream; the groups read disjoint halves.
    ids = [{i for b in r["received"][0] for i in b["ids"]} for r in results]
    assert ids[0] == ids[1] and ids[2] == ids[3] and not ids[0] & ids[2]
    assert len(ids[0] | ids[2]) == SAMPLES
    shapes = {tuple(b["tokens"].shape) for b in results[0]["received"][0]}
    assert len(shapes) > 1, f"the test needs batches of varying shape, got {shapes}"


@pytest.mark.distributed
@pytest.mark.parametrize("grouped", [False, True], ids=["world", "two-groups"])
def test_scatter_mode_gives_every_rank_its_own_batches(grouped):
    results = run_ranks(_scatter_mode, world_size=4, args=(grouped,), timeout=60)
    for rank, r in enumerate(results):
        for e in range(EPOCHS):
            assert_same_batches(r["received"][e], r["direct"][e], f"rank {rank}, epoch {e}")
        assert r["len"] == len(r["direct"][0])
    readers = [1, 3] if grouped else [0]
    for rank, r in enumerate(results):
        touched = {k for k, v in r["reads"].items() if v}
        if rank in readers:
            assert touched == ({rank - 1, rank} if grouped else {0, 1, 2, 3})
        else:
            assert not touched, f"rank {rank} read from storage: {r['reads']}"
    if grouped:  # members with loaders of different lengths each got all of theirs
        assert len({r["len"] for r in results}) > 1


@pytest.mark.distributed
def test_an_error_of_the_leaders_loader_is_raised_on_every_rank():
    results = run_ranks(_failing, world_size=4, timeout=30)
    for rank, messages in enumerate(results):
        for case, message in messages.items():
            where = f"rank {rank}, {case}: {message}"
            assert "the loader on rank 0 raised" in message, where
            if case.endswith("build"):
                assert "RuntimeError: no such file: shard-0" in message, where
            elif case.endswith("pickle"):
                assert "reading batch 0 of the epoch for rank 0" in message, where
                assert "pickle local object" in message, where
            else:
                assert "OSError: disk error reading sample 7" in message, where
                assert "reading batch 2 of the epoch" in message, where
            if case == "scatter-read":
                assert "for rank 2" in message, where


@pytest.mark.distributed
def test_ranks_that_disagree_on_the_leader_raise_on_every_rank():
    messages = run_ranks(_disagreeing_leaders, world_size=2, timeout=30)
    for message in messages:
        assert "rank 0: mode='broadcast' leader=0, rank 1: mode='broadcast' leader=1" in message


def test_one_process_without_a_process_group_is_a_plain_loader():
    assert not dist.is_initialized()
    dataset = Sequences()
    direct = list(shard_loader(dataset, 1, 0, 0))
    for mode, source in [
        ("broadcast", shard_loader(dataset, 1, 0, 0)),
        ("scatter", [shard_loader(dataset, 1, 0, 0)]),
    ]:
        loader = BroadcastLoader(source, mode=mode)
        assert len(loader) == len(direct) == 14
        assert_same_batches(list(loader), direct, f"{mode} mode")
    with pytest.raises(
        ValueError, match="one loader per member of the group \\[0\\]; got 2 loaders"
    ):
        BroadcastLoader([[], []], mode="scatter")
    with pytest.raises(ValueError, match="mode='gather'"):
        BroadcastLoader([], mode="gather")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="the loader for rank 0 is not iterable: 3"):
        BroadcastLoader(lambda: 3)
