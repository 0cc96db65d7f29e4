"""tandem.checkpoint saved by 2 processes loads on 1 and on 3: resharded, no sample twice or lost.

Hand-written loops, each saved once by 2 processes after 2 batches of 3 per rank of its first
epoch (12 of the 48 samples trained on; 48 and the 36 left divide by 1, 2 and 3: no padding):

- tandem.DDP, ``kind="full"``, its data through a :class:`tandem.data.StatefulLoader` (in the
  rank's process: the harness's ranks cannot start workers; that its state counts batches
  yielded, not drawn, is tests/data/test_stateful_loader.py's);
- FSDP stage 3 (units of 25 and 18 elements, cut into other slices and paddings at every world
  size), ``kind="sharded"``, a :class:`tandem.data.DistributedSampler`;
- tandem.ShardedOptimizer over tandem.DDP, ``kind="sharded"`` (other owners at every world
  size), a DistributedSampler.

Each state also holds a scheduler, ``tandem.checkpoint.RNG()`` and plain values. Loaded into
fresh objects (other initial weights, other generator states) in fresh processes, proven at 1
and at 3 processes for each set-up:

- right after loading, the model and optimizer gathered whole equal bitwise what the 2
  processes had when they saved (resharding moves numbers, it does not change them);
- the sample ids trained before the save and those trained from the load to the epoch's end
  are the epoch's 48 samples, each exactly once;
- ``RNG()``: a rank that existed draws (torch, Python, NumPy) what its saved rank drew right
  after the save; the new rank 2 draws the same after two loads of the checkpoint, and not what
  ranks 0 and 1 draw.

And, in the same processes: an object with per-rank state but no ``load_rank_state_dicts``,
saved by 2 and loaded by 1, is a ValueError naming both sizes before anything loads; an FSDP
model with tied weights saved sharded exports (``export_weights``) to a safetensors file with
both keys that loads into the plain model with ``strict=True``, equal to its gathered weights.
Bitwise equality with an uninterrupted run is not asked for: the global batch and the order of
the gradient sums change with the world size.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import TensorDataset

import tandem
import tandem.checkpoint as ckpt
from tandem.data import DistributedSampler, StatefulLoader
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed

N = 48
BATCH = 3
STOP_AFTER = 2  # batches per rank before the save
SETUPS = {"ddp": "full", "fsdp": "sharded", "zero1": "sharded"}

_G = torch.Generator().manual_seed(0)
X = torch.randn(N, 4, generator=_G)
Y = (X[:, 0] > 0).long() + (X[:, 1] > 0.5).long()
DATA = TensorDataset(X, Y, torch.arange(N))


class Tied(nn.Module):
    """An embedding whose weight is also the output layer's: one tensor, two state_dict keys."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(7, 3)
        self.head = nn.Linear(3, 7, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


class PerRank:
    """A stateful object with a per-rank part and no way to map it onto another world size."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def rank_state_dict(self) -> dict:
        return {"rank": dist.get_rank()}

    def load_rank_state_dict(self, state: dict) -> None:
        pass


def _state(setup: str, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))  # 25 + 18 elements
    if setup == "fsdp":
        model: nn.Module = tandem.FullyShardedDataParallel(net, stage=3, auto_wrap={nn.Linear})
    else:
        model = tandem.DDP(net)
    if setup == "zero1":
        opt: Any = tandem.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.02)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    sampler = DistributedSampler(DATA, seed=5)
    state = {
        "model": model,
        "optimizer": opt,
        "scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9),
        "sampler": sampler,
        "rng": ckpt.RNG(),
        "epoch": 0,
        "ids": [],
    }
    if setup == "ddp":
        state["loader"] = StatefulLoader(DATA, BATCH, sampler=sampler)
        del state["sampler"]
    return state


def _batches(state: dict[str, Any]):
    """The rest of the epoch's batches: (inputs, targets, ids)."""
    if "loader" in state:
        state["loader"].sampler.set_epoch(state["epoch"])
        yield from state["loader"]
        return
    sampler = state["sampler"]
    sampler.set_epoch(state["epoch"])  # keeps a loaded position of the same epoch
    indices = iter(sampler)
    while batch := list(itertools.islice(indices, BATCH)):
        yield X[batch], Y[batch], torch.tensor(batch)


def _train(state: dict[str, Any], batches: int | None) -> list[int]:
    """Train ``batches`` batches (None: to the epoch's end); the sample ids trained on."""
    model, opt = state["model"], state["optimizer"]
    ids: list[int] = []
    for x, y, i in itertools.islice(_batches(state), batches):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        state["scheduler"].step()
        ids += i.tolist()
    return ids


def _whole(setup: str, state: dict[str, Any]) -> dict[str, Any] | None:
    """The plain model's and optimizer's state dicts, gathered on rank 0 (a collective)."""
    model, opt = state["model"], state["optimizer"]
    if setup == "fsdp":
        weights, optim = model.full_state_dict(), model.full_optim_state_dict(opt)
    elif setup == "zero1":
        weights, optim = model.module.state_dict(), opt.full_state_dict()
    else:
        weights, optim = model.module.state_dict(), opt.state_dict()
    return _copied({"model": weights, "optimizer": optim}) if dist.get_rank() == 0 else None


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_copied(v) for v in value)
    return value


def _draw() -> tuple[float, float, float]:
    return torch.rand(1).item(), random.random(), float(np.random.rand())


def _seed_rank(base: int) -> None:
    # Every rank its own generators, so that restoring the wrong rank's would show.
    rank = dist.get_rank()
    torch.manual_seed(base + rank)
    random.seed(base + rank)
    np.random.seed(base + rank)


def _save_rank(tmp: str) -> dict[str, Any]:
    """At 2 ranks: every set-up trained 2 batches and saved; the tied and per-rank files."""
    results: dict[str, Any] = {}
    for setup, kind in SETUPS.items():
        state = _state(setup, seed=0)
        _seed_rank(10)
        ids = _train(state, STOP_AFTER)
        ckpt.save(state, Path(tmp) / f"{setup}.pt", kind=kind)
        draw = _draw()  # what the next draw after the save is, on this rank
        results[setup] = {"ids": ids, "draw": draw, "whole": _whole(setup, state)}
    tied = tandem.FullyShardedDataParallel(Tied(), stage=3)
    ckpt.save({"model": tied}, Path(tmp) / "tied.pt", kind="sharded")
    results["tied"] = tied.full_state_dict()
    ckpt.save({"model": tandem.DDP(nn.Linear(2, 2)), "per_rank": PerRank()}, Path(tmp) / "pr.pt")
    return results


def _load_rank(tmp: str) -> dict[str, Any]:
    """At another world size: every set-up loaded, checked, trained to the epoch's end."""
    results: dict[str, Any] = {}
    for setup in SETUPS:
        state = _state(setup, seed=7)
        path = Path(tmp) / f"{setup}.pt"
        _seed_rank(50)
        ckpt.load(state, path)
        first = _draw()  # before anything else draws
        ckpt.load(state, path)
        again = _draw()
        whole = _whole(setup, state)
        results[setup] = {"draws": (first, again), "whole": whole, "ids": _train(state, None)}
    if dist.get_world_size() == 1:
        model = tandem.DDP(nn.Linear(2, 2))
        before = _copied(model.module.state_dict())
        try:
            ckpt.load({"model": model, "per_rank": PerRank()}, Path(tmp) / "pr.pt")
        except ValueError as e:
            results["per_rank"] = str(e)
        after = model.module.state_dict()
        results["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    return results


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("resize")
    return tmp, run_ranks(_save_rank, 2, args=(str(tmp),), timeout=120)


@pytest.fixture(scope="module")
def loaded(saved) -> dict[int, list[dict[str, Any]]]:
    tmp, _ = saved
    return {w: run_ranks(_load_rank, w, args=(str(tmp),), timeout=120) for w in (1, 3)}


@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("setup", list(SETUPS))
def test_loads_resharded_and_continues_the_epoch(saved, loaded, setup, world_size):
    _, before = saved
    after = loaded[world_size]
    _assert_equal(after[0][setup]["whole"], before[0][setup]["whole"], setup)
    trained = Counter(i for r in before + after for i in r[setup]["ids"])
    assert trained == Counter(range(N)), sorted(trained.items())
    for rank, result in enumerate(after):
        first, again = result[setup]["draws"]
        assert first == again, rank  # the same checkpoint, the same draws
        if rank < 2:
            assert first == before[rank][setup]["draw"], rank
        else:
            assert first not in [before[r][setup]["draw"] for r in range(2)]


def test_per_rank_state_without_a_mapping_is_refused(loaded):
    result = loaded[1][0]
    assert "per-rank state of 2 process(es) and this job has 1" in result["per_rank"]
    assert "load_rank_state_dicts" in result["per_rank"]
    assert result["unchanged"]


def test_tied_weights_export_from_a_sharded_checkpoint(saved, tmp_path):
    tmp, before = saved
    out = tmp_path / "tied.safetensors"
    ckpt.export_weights(tmp / "tied.pt", out)
    weights = load_file(out)
    assert sorted(weights) == ["embed.weight", "head.weight"]
    Tied().load_state_dict(weights, strict=True)
    for key, value in before[0]["tied"].items():
        assert torch.equal(weights[key], value), key


def _assert_equal(got: Any, want: Any, where: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), (where, got, want)
        for key in want:
            _assert_equal(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            _assert_equal(a, b, f"{where}[{i}]")
    else:
        assert got == want, (where, got, want)
