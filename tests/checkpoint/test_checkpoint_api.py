"""tandem.checkpoint on 2 real processes: hand-written loops resume bitwise; errors on every rank.

Proven (2 ranks, Gloo):

- a loop (dropout, AdamW, a scheduler, tandem's DistributedSampler, ``RNG()``, plain values)
  saved mid-epoch and loaded into fresh objects on both ranks continues bitwise as the
  uninterrupted loop (every rank's parameters, batches and losses) for tandem.DDP with
  ``kind="full"``, FSDP stage 3 with ``kind="sharded"`` (one shard file per rank) and
  ShardedOptimizer with ``kind="sharded"``;
- FSDP's full checkpoint loads in one process into the unwrapped model and a plain AdamW, equal
  to the FSDP model's gathered weights; its sharded checkpoint into that plain model is a
  ValueError naming both kinds of model (shards load into an FSDP model, at any world size:
  test_checkpoint_api_resize.py), and a shard file passed for the checkpoint is named as one;
  tandem.DDP's full checkpoint loads in one process too, without a warning, the one rank
  continuing saved rank 0's generators;
- ``export_weights`` of those checkpoints (FSDP's sharded: flat shards, padded, put together)
  and of the live FSDP model (a collective: rank 0 writes) loads strictly into the plain model,
  every tensor equal to the model's at that point;
- errors are raised on both ranks, never a hang: ranks passing different keys; rank 1 failing
  to write its shard (nothing committed); rank 1's shard corrupt (CheckpointError naming it).
"""

from __future__ import annotations

import itertools
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

import tandem
import tandem.checkpoint as ckpt
import tandem.checkpoint.phases as steps
from tandem.checkpoint.run_dir import CheckpointError
from tandem.checkpoint.shards import shard_path
from tandem.data import DistributedSampler
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed

X = torch.randn(26, 6, generator=torch.Generator().manual_seed(0))
Y = (X[:, 0] > 0).long() + (X[:, 1] > 0.3).long()
BATCH = 3
SETUPS = [("ddp", "full"), ("fsdp3", "sharded"), ("zero1", "sharded")]


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))


def _state(setup: str, seed: int) -> dict:
    net = _net(seed)
    if setup == "fsdp3":
        model = tandem.FullyShardedDataParallel(net, stage=3, auto_wrap={nn.Linear})
    else:
        model = tandem.DDP(net)
    if setup == "zero1":
        opt = tandem.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.01)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return {
        "model": model,
        "optimizer": opt,
        "scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
        "sampler": DistributedSampler(range(len(X)), seed=3),
        "rng": ckpt.RNG(),
        "step": 0,
        "epoch": 0,
        "losses": [],
    }


def _run(state: dict, until: int, save_at=None, path=None, kind="full") -> list[list[int]]:
    model, opt, sampler = state["model"], state["optimizer"], state["sampler"]
    drawn = []
    while state["step"] < until:
        sampler.set_epoch(state["epoch"])
        indices = iter(sampler)
        while batch := list(itertools.islice(indices, BATCH)):
            drawn.append(batch)
            jitter = 1 + 0.01 * random.random() + 0.01 * float(np.random.rand())
            loss = F.cross_entropy(model(X[batch]), Y[batch]) * jitter
            opt.zero_grad()
            loss.backward()
            opt.step()
            state["scheduler"].step()
            state["losses"].append(loss.item())
            state["step"] += 1
            if state["step"] == save_at:
                ckpt.save(state, path, kind=kind)
            if state["step"] == until:
                return drawn
        state["epoch"] += 1
    return drawn


def _weights(model: nn.Module) -> list[torch.Tensor]:
    """This rank's trained tensors: FSDP's shards, or the replicated parameters."""
    if isinstance(model, tandem.FullyShardedDataParallel):
        return [u.shard.detach().clone() for u in model.units]
    return [p.detach().clone() for p in model.parameters()]


def _plain_weights(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The plain module's weights on rank 0 (a collective for FSDP)."""
    if isinstance(model, tandem.FullyShardedDataParallel):
        return model.full_state_dict()
    if dist.get_rank() != 0:
        return None
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def _seed_rank(base: int) -> None:
    # Every rank its own generators, so that restoring the wrong rank's would show.
    rank = dist.get_rank()
    torch.manual_seed(base + rank)
    random.seed(base + rank)
    np.random.seed(base + rank)


def _resume_rank(tmp: str) -> dict:
    """Every set-up's loop, whole and resumed, one after the other (one start-up for all)."""
    results = {}
    for setup, kind in SETUPS:
        path = Path(tmp) / f"{setup}.pt"
        whole = _state(setup, seed=0)
        _seed_rank(10)
        drawn = _run(whole, 9, save_at=4, path=path, kind=kind)  # step 4: mid-epoch
        resumed = _state(setup, seed=3)
        _seed_rank(50)
        ckpt.load(resumed, path)
        at_save = _plain_weights(resumed["model"])
        rest = _run(resumed, 9)
        full = None
        if setup == "fsdp3":
            state = {"model": whole["model"], "optimizer": whole["optimizer"]}
            ckpt.save(state, Path(tmp) / "full.pt")
            ckpt.export_weights(whole["model"], Path(tmp) / "live.safetensors")
            full = whole["model"].full_state_dict()
        same = all(
            torch.equal(a, b)
            for a, b in zip(_weights(whole["model"]), _weights(resumed["model"]), strict=True)
        )
        results[setup] = {
            "same_weights": same,
            "same_batches": rest == drawn[4:],
            # Plain values are rank 0's: the losses saved are rank 0's, the later ones each
            # rank's own.
            "same_losses": resumed["losses"][4:] == whole["losses"][4:],
            "losses": resumed["losses"][:4] == whole["losses"][:4],
            "full": full,
            "at_save": at_save,
        }
    return results


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> tuple[Path, list[dict]]:
    tmp = tmp_path_factory.mktemp("loops")
    return tmp, run_ranks(_resume_rank, 2, args=(str(tmp),), timeout=120)


@pytest.mark.parametrize(("setup", "kind"), SETUPS)
def test_hand_written_loop_resumes_bitwise(resumed, setup, kind):
    tmp, results = resumed
    for rank, result in enumerate(r[setup] for r in results):
        assert result["same_weights"], f"rank {rank}"
        assert result["same_batches"] and result["same_losses"], f"rank {rank}"
    assert results[0][setup]["losses"]  # rank 0's saved list came back
    path = tmp / f"{setup}.pt"
    shards = sorted(p.name for p in shard_path(tmp, path.stem, 0).parent.glob("*.pt"))
    assert shards == ([] if kind == "full" else ["rank00000.pt", "rank00001.pt"])


def test_fsdp_checkpoints_in_one_process(resumed):
    tmp, results = resumed
    # The full checkpoint of the FSDP run loads in one process, into the unwrapped model.
    plain = _net(seed=8)
    opt = torch.optim.AdamW(plain.parameters(), lr=0.01)
    ckpt.load({"model": plain, "optimizer": opt}, tmp / "full.pt")
    for key, value in results[0]["fsdp3"]["full"].items():
        assert torch.equal(plain.state_dict()[key], value), key
    assert len(opt.state) == 4  # the moments of every plain parameter
    # Its sharded checkpoint does not load at another world size.
    one = {
        "model": plain,
        "optimizer": opt,
        "scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2),
        "sampler": DistributedSampler(range(len(X)), num_replicas=1, rank=0, seed=3),
        "rng": ckpt.RNG(),
        "step": 0,
        "epoch": 0,
        "losses": [],
    }
    with pytest.raises(ValueError, match=r"FullyShardedDataParallel model .* this is a Seq"):
        ckpt.load(one, tmp / "fsdp3.pt")
    with pytest.raises(CheckpointError, match=r"rank 1's shard file of the sharded checkpoint"):
        ckpt.load(one, shard_path(tmp, "fsdp3", 1))
    # A full checkpoint of 2 ranks loads on 1; rank 0 continues saved rank 0's generators.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt.load(one, tmp / "ddp.pt")
    assert one["step"] == 4
    saved = torch.load(tmp / "ddp.pt", weights_only=True)["objects"]["rng"]["ranks"]
    assert torch.equal(torch.get_rng_state(), saved[0]["torch"])


def test_export_of_sharded_save_files_and_of_a_live_model(resumed, tmp_path):
    tmp, results = resumed
    out = tmp_path / "w.safetensors"
    for setup, _ in SETUPS:
        # FSDP's flat shards (a unit of 51 elements: padded) put together; ZeRO's model whole.
        ckpt.export_weights(tmp / f"{setup}.pt", out)
        _equal_when_loaded(out, results[0][setup]["at_save"])
    _equal_when_loaded(tmp / "live.safetensors", results[0]["fsdp3"]["full"])


def _equal_when_loaded(path: Path, weights: dict[str, torch.Tensor]) -> None:
    loaded = load_file(path)
    _net(seed=8).load_state_dict(loaded, strict=True)
    assert sorted(loaded) == sorted(weights)
    for key, value in weights.items():
        assert torch.equal(loaded[key], value), key


def _errors_rank(tmp: str) -> dict:
    rank = dist.get_rank()
    model = tandem.FullyShardedDataParallel(_net(0), auto_wrap={nn.Linear})
    state = {"model": model, "optimizer": torch.optim.AdamW(model.parameters()), "step": 1}
    path = Path(tmp) / "s.pt"
    ckpt.save(state, path, kind="sharded")
    seen = {}
    # Ranks that pass different keys: both refuse before any collective could hang.
    try:
        ckpt.save({**state, **({"extra": 1} if rank == 1 else {})}, Path(tmp) / "x.pt")
    except ValueError as e:
        seen["keys"] = str(e)
    # Rank 1 cannot write its shard: both raise, nothing is committed.
    real = steps.write_shard

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    if rank == 1:
        steps.write_shard = full_disk
    try:
        ckpt.save(state, Path(tmp) / "y.pt", kind="sharded")
    except OSError as e:
        seen["disk"] = str(e)
    finally:
        steps.write_shard = real
    seen["committed"] = (Path(tmp) / "y.pt.sha256").exists()
    # Rank 1's shard corrupt: both ranks raise, naming it, and nothing is loaded.
    if rank == 1:
        shard = shard_path(Path(tmp), "s", 1)
        data = bytearray(shard.read_bytes())
        data[-50] ^= 0xFF
        shard.write_bytes(bytes(data))
    dist.barrier()
    before = [t.clone() for t in _weights(model)]
    try:
        ckpt.load(state, path)
    except CheckpointError as e:
        seen["corrupt"] = str(e)
    seen["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, _weights(model), strict=True))
    return seen


def test_errors_are_raised_on_every_rank(tmp_path):
    results = run_ranks(_errors_rank, 2, args=(str(tmp_path),), timeout=60)
    for seen in results:
        assert "different values" in seen["keys"] and "extra" in seen["keys"]
        assert "rank 1 could not save its shard" in seen["disk"]
        assert not seen["committed"]
        assert "rank 1's shard" in seen["corrupt"] and "corrupt or truncated" in seen["corrupt"]
        assert seen["unchanged"]
