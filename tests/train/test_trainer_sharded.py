"""The Trainer with sharded models and optimizers: checkpoints, full and sharded, resume exactly.

Set-ups, each a 2-rank Trainer run of AdamW with gradient accumulation (2 micro-batches) over a
model whose units the world size does not divide:

- FullyShardedDataParallel stage 3 and stage 2 (``auto_wrap={nn.Linear}``), ShardedOptimizer
  (ZeRO-1 over tandem.DDP);
- checkpoint formats ``"full"`` (rank 0's file, gathered) and ``"sharded"`` (a file per rank).

Proven:

- the uninterrupted sharded runs train to tandem.DDP's Trainer run's parameters (1e-6) and
  report its losses (1e-6);
- stopping after one epoch and resuming (fresh processes) ends bitwise equal to the
  uninterrupted run of the same set-up, for every set-up and format;
- the full checkpoint of an FSDP run loads into the plain module (``strict=True``), its
  optimizer entry into a plain AdamW over it, and both into a one-process FSDP wrapper, whose
  next step equals the plain model's;
- a sharded checkpoint writes one file per rank, recorded by digest in rank 0's file; a
  truncated shard makes resuming raise CheckpointError on both ranks naming that file;
- ``checkpoint_format="sharded"`` with nothing sharded, and a plain GradScaler with FSDP (not
  torch's ShardedGradScaler), are ValueErrors.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import tandem
from tandem.checkpoint.run_dir import CheckpointError, latest_checkpoint, load_checkpoint
from tandem.checkpoint.shards import SHARDS_DIR
from tandem.train.trainer import Trainer
from tests.harness import run_ranks

EPOCHS = 2


def _data() -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(61, 7, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return TensorDataset(x[:50], y[:50]), TensorDataset(x[50:], y[50:])


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 40 + 30 + 18 elements: no unit divides by 4, two of three not by 2... with the root's.
    return nn.Sequential(
        nn.Linear(7, 5), nn.Tanh(), nn.Sequential(nn.Linear(5, 5), nn.Tanh()), nn.Linear(5, 3)
    )


def _setup(kind: str) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    """(the plain module, what the Trainer gets, its optimizer)."""
    plain = _model()
    kwargs = {"lr": 0.02, "weight_decay": 0.1}
    if kind.startswith("fsdp"):
        model = tandem.FullyShardedDataParallel(plain, stage=int(kind[-1]), auto_wrap={nn.Linear})
        return plain, model, torch.optim.AdamW(model.parameters(), **kwargs)
    if kind == "zero1":
        return (
            plain,
            plain,
            tandem.ShardedOptimizer(plain.parameters(), torch.optim.AdamW, **kwargs),
        )
    return plain, plain, torch.optim.AdamW(plain.parameters(), **kwargs)


def _train(run_dir: str, kind: str, fmt: str, max_epochs: int, resume: str | None) -> dict:
    tandem.init()
    train_set, test_set = _data()
    _, model, optimizer = _setup(kind)
    trainer = Trainer(
        model,
        optimizer,
        train_set,
        loss_fn=F.cross_entropy,
        eval_data=test_set,
        max_epochs=max_epochs,
        save_every=1,
        batch_size=4,
        run_dir=run_dir,
        grad_accum_steps=2,
        resume=resume,
        progress=False,
        checkpoint_format=fmt,
    )
    summary = trainer.train()
    if isinstance(model, tandem.FullyShardedDataParallel):
        with model.gathered(writeback=False) as net:
            params = [p.detach().clone() for p in _ordered(net)]
    else:
        params = [p.detach().clone() for p in model.parameters()]
    return {
        "params": params,
        "history": [(r["step"], r["train_loss"], r["eval_loss"]) for r in summary.history],
    }


def _ordered(net: nn.Module) -> list[torch.Tensor]:
    return [
        net[0].weight,
        net[0].bias,
        net[2][0].weight,
        net[2][0].bias,
        net[3].weight,
        net[3].bias,
    ]


def _run(run_dir: Path, kind: str, fmt: str = "full", epochs: int = EPOCHS, resume=None):
    return run_ranks(_train, 2, args=(str(run_dir), kind, fmt, epochs, resume), timeout=90)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> list[dict]:
    return _run(tmp_path_factory.mktemp("ddp"), "ddp")


@pytest.mark.distributed
@pytest.mark.parametrize(
    "kind, formats",
    [("fsdp3", ("full", "sharded")), ("fsdp2", ("sharded",)), ("zero1", ("full", "sharded"))],
)
def test_sharded_runs_equal_ddp_and_resume_bitwise(ddp_run, tmp_path, kind, formats):
    whole = _run(tmp_path / "whole", kind)
    for rank in range(2):
        for a, b in zip(whole[rank]["params"], ddp_run[rank]["params"], strict=True):
            assert (a - b).abs().max().item() < 1e-6
        for got, want in zip(whole[rank]["history"], ddp_run[rank]["history"], strict=True):
            assert got[0] == want[0]
            assert abs(got[1] - want[1]) < 1e-6 and abs(got[2] - want[2]) < 1e-6
    for fmt in formats:
        run_dir = tmp_path / fmt
        _run(run_dir, kind, fmt, epochs=1)
        if fmt == "sharded":
            ckpt = latest_checkpoint(run_dir)
            files = sorted((ckpt.parent / SHARDS_DIR / ckpt.stem).iterdir())
            assert [f.name for f in files] == ["rank00000.pt", "rank00001.pt"]
            digests = load_checkpoint(ckpt)["state"]["shards"]["sha256"]
            assert len(digests) == 2 and digests[0] != digests[1]
        resumed = _run(run_dir, kind, fmt, resume="latest")
        for rank in range(2):
            assert resumed[rank]["history"] == whole[rank]["history"]
            for a, b in zip(resumed[rank]["params"], whole[rank]["params"], strict=True):
                assert torch.equal(a, b), (kind, fmt, rank, (a - b).abs().max())


@pytest.mark.distributed
def test_full_fsdp_checkpoint_loads_into_the_plain_model_and_one_process(tmp_path):
    _run(tmp_path, "fsdp3", "full", epochs=1)
    state = load_checkpoint(tmp_path)["state"]
    plain = _model()
    plain.load_state_dict(state["model"], strict=True)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.02, weight_decay=0.1)
    plain_opt.load_state_dict(copy.deepcopy(state["optimizer"]))

    # A one-process wrapper (no process group) takes the same full state.
    _, wrapped, opt = _setup("fsdp3")
    wrapped.load_full_state_dict(state["model"])
    wrapped.load_full_optim_state_dict(opt, copy.deepcopy(state["optimizer"]))
    x, y = _data()[0].tensors
    for model, o in ((plain, plain_opt), (wrapped, opt)):
        o.zero_grad()
        F.cross_entropy(model(x), y).backward()
        o.step()
    with wrapped.gathered(writeback=False) as net:
        for a, b in zip(_ordered(net), _ordered(plain), strict=True):
            assert (a - b).abs().max().item() < 1e-6


def _resume_error(run_dir: str) -> str:
    try:
        _train(run_dir, "fsdp3", "sharded", EPOCHS, "latest")
    except CheckpointError as e:
        return str(e)
    raise AssertionError("resuming with a truncated shard did not raise")


@pytest.mark.distributed
def test_truncated_shard_is_a_checkpoint_error_on_every_rank(tmp_path):
    _run(tmp_path, "fsdp3", "sharded", epochs=1)
    ckpt = latest_checkpoint(tmp_path)
    shard = ckpt.parent / SHARDS_DIR / ckpt.stem / "rank00001.pt"
    shard.write_bytes(shard.read_bytes()[:100])
    messages = run_ranks(_resume_error, 2, args=(str(tmp_path),), timeout=60)
    for message in messages:
        assert str(shard) in message and "corrupt or truncated" in message


def _build(model: nn.Module, opt: torch.optim.Optimizer, run_dir: Path, **kwargs) -> Trainer:
    args = {"loss_fn": F.cross_entropy, "max_epochs": 1, "save_every": 1, "batch_size": 4}
    return Trainer(model, opt, _data()[0], run_dir=run_dir, **args, **kwargs)


def test_bad_sharded_set_ups(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match=r"needs a tandem\.FullyShardedDataParallel"):
        _build(model, opt, tmp_path, checkpoint_format="sharded")
    with pytest.raises(ValueError, match="checkpoint_format must be"):
        _build(model, opt, tmp_path, checkpoint_format="zip")
    _, wrapped, opt = _setup("fsdp3")
    with pytest.raises(ValueError, match="GradScaler sees only"):
        _build(wrapped, opt, tmp_path, scaler=torch.amp.GradScaler("cpu"))
