"""A run counted in steps logs exactly, and its resumptions log and train as it does, bitwise.

Proves, on 2 ranks (Gloo, real processes):

- the logged loss is the loss by hand: with a learning rate of 0 (the model stays as built),
  every record's ``loss`` equals the mean, computed in one process, of the per-sample losses of
  every sample both ranks trained on in the record's steps (windows of 3 steps over epochs of 4
  steps, 2 micro-batches a step: they cross epoch ends), to 1e-12; ``epoch`` is the epochs done
  (batches over batches per epoch); ``tokens_per_s / samples_per_s`` is the window's tokens
  (what the step returns) over its samples, by hand; ``lr`` is the step's rate;
- a run of ``max_steps=13`` (no ``max_epochs``; 4 steps an epoch, so it ends in the middle of
  epoch 4, saved there) with dropout, momentum, a per-step schedule, clipping, accumulation,
  evaluation every 5 steps and a checkpoint every 5 steps, is equal to (a) the same run stopped
  by ``max_steps=7`` in the middle of epoch 2 and resumed with ``max_steps=13``, and (b) the
  run resumed from its own step-5 checkpoint (a record's window half done there) in a copy of
  its run directory, whose logs run on past step 5: ``torch.equal`` parameters on every rank;
  ``steps.jsonl`` and ``steps.csv`` equal line for line apart from the timing columns, each
  step once; the TensorBoard event files (when tensorboard is installed) read back with
  TensorBoard's own ``event_accumulator`` hold each step once with equal values; the epoch
  records of ``metrics.jsonl`` equal.
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

from tandem.checkpoint.run_dir import list_checkpoints
from tandem.train.step_log import TIMING_COLUMNS
from tandem.train.trainer import Trainer
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed

PER_RANK = 20  # in batches of 3: 7 batches an epoch, in steps of 2 (2, 2, 2, 1): 4 steps
BATCH = 3
STEPS = 13
try:
    import tensorboard  # noqa: F401

    LOGGERS = ["csv", "jsonl", "tensorboard"]
except ImportError:  # the dev extra brings it; without it the files are still compared
    LOGGERS = ["csv", "jsonl"]


def _data() -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 * PER_RANK + 11, 6, generator=g, dtype=torch.float64)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    n = 2 * PER_RANK
    return TensorDataset(x[:n], y[:n]), TensorDataset(x[n:], y[n:])


def _tokens_step(model: nn.Module, batch) -> dict:
    x, y = batch
    return {"loss": F.cross_entropy(model(x), y), "tokens": int((y + 1).sum())}


def _net(dropout: float) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 3)
    ).double()


# -- the loss by hand -------------------------------------------------------------------------


def _frozen(run_dir: str) -> list[dict]:
    train_set, _ = _data()
    trainer = Trainer(
        _net(0.0),
        lambda ps: torch.optim.SGD(ps, lr=0.0),
        train_set,
        training_step=_tokens_step,
        max_steps=8,
        log_every=3,
        grad_accum_steps=2,
        batch_size=BATCH,
        run_dir=run_dir,
        progress=False,
    )
    trainer.train()
    return [json.loads(line) for line in (Path(run_dir) / "steps.jsonl").read_text().splitlines()]


def _by_hand() -> list[dict]:
    """Every 3 steps: the mean loss, samples and tokens of both ranks' samples in them."""
    data, _ = _data()
    x, y = data.tensors
    losses = F.cross_entropy(_net(0.0)(x), y, reduction="none").detach()
    steps = []  # per optimizer step: the sample indices both ranks trained on
    for epoch in range(2):
        orders = []
        for rank in range(2):
            sampler = DistributedSampler(data, 2, rank, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            orders.append(list(sampler))
        for start in range(0, PER_RANK, 2 * BATCH):  # 2 micro-batches of BATCH a step
            steps.append([i for order in orders for i in order[start : start + 2 * BATCH]])
    records = []
    for end in (3, 6):
        index = [i for step in steps[end - 3 : end] for i in step]
        records.append({
            "step": end,
            "loss": losses[index].mean().item(),
            "tokens_per_sample": (y[index] + 1).sum().item() / len(index),
        })  # fmt: skip
    return records


def test_the_logged_loss_is_the_loss_by_hand(tmp_path):
    got = run_ranks(_frozen, 2, args=(str(tmp_path),), timeout=60)[0]
    want = _by_hand()
    assert [r["step"] for r in got] == [3, 6]
    for record, hand in zip(got, want, strict=True):
        assert record["loss"] == pytest.approx(hand["loss"], rel=1e-12, abs=0)
        ratio = record["tokens_per_s"] / record["samples_per_s"]
        assert ratio == pytest.approx(hand["tokens_per_sample"], rel=1e-12)
        assert record["lr"] == 0.0 and "grad_norm" not in record
    # Epochs done: step 3 is batch 6 of 7 of epoch 1; step 6 is batch 4 of epoch 2.
    assert [r["epoch"] for r in got] == [6 / 7, 1 + 4 / 7]


# -- resumed runs log and train as the uninterrupted one --------------------------------------


def _train(run_dir: str, max_steps: int, resume: str | None) -> list[torch.Tensor]:
    rank = int(os.environ["RANK"])
    train_set, test_set = _data()
    model = _net(0.2)
    torch.manual_seed(100 + rank)  # each rank its own dropout masks
    trainer = Trainer(
        model,
        lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9),
        train_set,
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s)),
        scheduler_interval="step",
        loss_fn=F.cross_entropy,
        eval_data=test_set,
        max_steps=max_steps,
        eval_every=5,
        save_every_steps=5,
        log_every=3,
        check_every=4,
        loggers=LOGGERS,
        clip_grad_norm=1.0,
        grad_accum_steps=2,
        batch_size=BATCH,
        run_dir=run_dir,
        resume=resume,
        keep_checkpoints=10,
        progress=False,
    )
    assert trainer.total_steps == max_steps  # no max_epochs
    trainer.train()
    return [p.detach().clone() for p in trainer.module.parameters()]


def _run(run_dir: Path, max_steps: int = STEPS, resume: str | None = None) -> list:
    return run_ranks(_train, 2, args=(str(run_dir), max_steps, resume), timeout=90)


def _logs(run_dir: Path) -> dict:
    """What a run directory's logs hold, timing columns left out."""

    def untimed(record: dict) -> dict:
        return {k: v for k, v in record.items() if k not in TIMING_COLUMNS}

    lines = (run_dir / "steps.jsonl").read_text().splitlines()
    with open(run_dir / "steps.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    epochs = (run_dir / "metrics.jsonl").read_text().splitlines()
    logs = {
        "jsonl": [untimed(json.loads(line)) for line in lines],
        "csv": [untimed(row) for row in rows],
        "epochs": [untimed({**json.loads(line), "epoch_s": None}) for line in epochs],
    }
    if "tensorboard" in LOGGERS:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(run_dir / "tensorboard"))
        events.Reload()
        logs["tensorboard"] = {
            tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]
            if tag not in TIMING_COLUMNS
        }
    return logs


def _assert_same(got: list, want: list, got_dir: Path, want_dir: Path) -> None:
    for rank, (mine, theirs) in enumerate(zip(got, want, strict=True)):
        for a, b in zip(mine, theirs, strict=True):
            assert torch.equal(a, b), f"rank {rank}: parameters differ by {(a - b).abs().max()}"
    assert _logs(got_dir) == _logs(want_dir)


def test_resumed_runs_log_and_train_as_the_uninterrupted_run(tmp_path):
    full = _run(tmp_path / "full")
    logs = _logs(tmp_path / "full")
    steps = [r["step"] for r in logs["jsonl"]]
    # Records every 3 steps, evaluations every 5 and at the epochs' ends (steps 4, 8, 12).
    assert steps == [3, 4, 5, 6, 8, 9, 10, 12], steps
    assert [r["step"] for r in logs["jsonl"] if "loss" in r] == [3, 6, 9, 12]
    assert all(math.isfinite(r["grad_norm"]) for r in logs["jsonl"] if "loss" in r)
    assert [row["step"] for row in logs["csv"]] == [str(s) for s in steps]
    assert [r["step"] for r in logs["epochs"]] == [4, 8, 12]
    if "tensorboard" in LOGGERS:
        assert [s for s, _ in logs["tensorboard"]["loss"]] == [3, 6, 9, 12]
    names = [p.name for p in list_checkpoints(tmp_path / "full")]
    assert names == ["ckpt-e0001-s00000005.pt", "ckpt-e0002-s00000010.pt",
                     "ckpt-e0003-s00000013.pt"]  # fmt: skip

    # (a) stopped by max_steps in the middle of epoch 2, resumed to the end.
    _run(tmp_path / "stopped", max_steps=7)
    assert [p.name for p in list_checkpoints(tmp_path / "stopped")][-1] == "ckpt-e0001-s00000007.pt"
    resumed = _run(tmp_path / "stopped", resume="latest")
    _assert_same(resumed, full, tmp_path / "stopped", tmp_path / "full")

    # (b) the finished run's directory resumed from its step-5 checkpoint: the logs after step
    # 5 are written again, never twice.
    shutil.copytree(tmp_path / "full", tmp_path / "again")
    step5 = list_checkpoints(tmp_path / "again")[0]
    again = _run(tmp_path / "again", resume=str(step5))
    _assert_same(again, full, tmp_path / "again", tmp_path / "full")
