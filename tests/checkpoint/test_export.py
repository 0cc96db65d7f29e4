"""Export from 2-rank runs: safetensors that load strictly into the plain model, equal to it.

Proven (2 ranks, Gloo; the file is read back in this process, without a process group):

- for Trainer runs of tandem.DDP (full checkpoints), ShardedOptimizer (sharded: the model in
  rank 0's file), FSDP stage 3 (sharded: every rank's flat shards assembled into whole tensors)
  and FSDP stage 2 (full), ``tandem export RUN_DIR OUT`` takes the run's latest checkpoint and
  writes a file that ``safetensors.torch.load_file`` reads into the unwrapped model with
  ``load_state_dict(strict=True)``, every tensor equal (``torch.equal``) to the trained
  model's;
- (``tandem.checkpoint.save`` files and live models: tests/checkpoint/test_checkpoint_api.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import TensorDataset

import tandem
from tandem.checkpoint.run_dir import latest_checkpoint
from tandem.cli import main as cli
from tandem.train.trainer import Trainer
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed

SETUPS = [("ddp", "full"), ("zero1", "sharded"), ("fsdp3", "sharded"), ("fsdp2", "full")]


def _net() -> nn.Module:
    torch.manual_seed(0)
    # 35 + 18 + 16 elements (with biases): units the world size does not divide.
    return nn.Sequential(
        nn.Linear(7, 5), nn.Tanh(), nn.Sequential(nn.Linear(5, 3), nn.Tanh()), nn.Linear(3, 4)
    )


def _setup(setup: str) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    """(the plain module, the model the run trains, its optimizer)."""
    plain = _net()
    if setup.startswith("fsdp"):
        model = tandem.FullyShardedDataParallel(plain, stage=int(setup[-1]), auto_wrap={nn.Linear})
        return plain, model, torch.optim.AdamW(model.parameters(), lr=0.02)
    if setup == "zero1":
        return plain, plain, tandem.ShardedOptimizer(plain.parameters(), torch.optim.AdamW, lr=0.02)
    return plain, plain, torch.optim.AdamW(plain.parameters(), lr=0.02)


def _trained(model: nn.Module, plain: nn.Module) -> dict[str, torch.Tensor] | None:
    """The plain module's weights on rank 0 (a collective for FSDP)."""
    if isinstance(model, tandem.FullyShardedDataParallel):
        return model.full_state_dict()
    if torch.distributed.get_rank() != 0:
        return None
    return {k: v.detach().clone() for k, v in plain.state_dict().items()}


def _trainer_rank(tmp: str) -> dict:
    """Every set-up's Trainer run, one after the other (one start-up for all)."""
    tandem.init()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 7, generator=g)
    data = TensorDataset(x, (x[:, 0] > 0).long())
    trained = {}
    for setup, fmt in SETUPS:
        plain, model, opt = _setup(setup)
        Trainer(
            model,
            opt,
            data,
            loss_fn=F.cross_entropy,
            max_epochs=2,
            save_every=1,
            batch_size=4,
            run_dir=Path(tmp) / setup,
            progress=False,
            checkpoint_format=fmt,
        ).train()
        trained[setup] = _trained(model, plain)
    return trained


def _check(out: Path, trained: dict[str, torch.Tensor]) -> None:
    loaded = load_file(out)
    fresh = nn.Sequential(
        nn.Linear(7, 5), nn.Tanh(), nn.Sequential(nn.Linear(5, 3), nn.Tanh()), nn.Linear(3, 4)
    )
    fresh.load_state_dict(loaded, strict=True)
    assert sorted(loaded) == sorted(trained)
    for key, value in trained.items():
        assert torch.equal(loaded[key], value), key


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("runs")
    return tmp, run_ranks(_trainer_rank, 2, args=(str(tmp),), timeout=120)[0]


@pytest.mark.parametrize(("setup", "fmt"), SETUPS)
def test_export_of_a_trainer_run(runs, tmp_path, capsys, setup, fmt):
    tmp, trained = runs
    run_dir = tmp / setup
    out = tmp_path / "model.safetensors"
    assert cli(["export", str(run_dir), str(out)]) == 0
    latest = latest_checkpoint(run_dir)
    assert latest is not None and str(latest) in capsys.readouterr().out
    _check(out, trained[setup])
