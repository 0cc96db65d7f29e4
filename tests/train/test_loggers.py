"""The step log's pieces on one process: the plan's arithmetic, the loggers' files, a Trainer's.

Proves:

- the plan: ``max_epochs`` and ``max_steps`` both missing is a ValueError naming both;
  ``total_steps`` is ``max_epochs`` x the steps of an epoch (batches over ``grad_accum_steps``,
  rounded up: 7 batches in steps of 2 are 4 steps), capped by ``max_steps``, the same number
  from any point of the run; agreements fall on every check and every log step;
- the CSV and JSONL loggers: what is read back is what was logged; a metric that appears later
  widens the CSV's header with the earlier rows' cells empty; reopened at a step they keep the
  records up to it (a resumed run appends after them), at step 0 they start empty;
- TensorBoard: the real ``SummaryWriter``'s event file, read back with TensorBoard's
  ``event_accumulator``, holds every logged step; a writer reopened at step 4 after steps 1..6
  purges 5 and 6, so steps 1..8 read back once each, with the resumed values;
- bad ``loggers``: an unknown name, an object without ``log_metrics``, a string instead of a
  list are ValueErrors naming the value; ``"tensorboard"`` without tensorboard installed is an
  ImportError naming ``tandem[tensorboard]``;
- a one-process Trainer with ``max_steps`` ends in the middle of an epoch with a checkpoint
  there; its logger object gets a record every ``log_every`` steps (loss, lr, samples/s,
  tokens/s since its step returns ``"tokens"``; grad norm only with clipping) and the
  evaluation of every ``eval_every`` steps and of each epoch's end, at their steps;
  ``total_steps`` says how many steps the run has; ``eval_every`` without ``eval_data`` is a
  ValueError.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from tandem.checkpoint.run_dir import list_checkpoints, load_checkpoint
from tandem.train.loggers import CsvLogger, JsonlLogger, TensorBoardLogger, check_loggers
from tandem.train.plan import RunPlan
from tandem.train.trainer import Trainer


def _plan(**kwargs) -> RunPlan:
    args = dict(max_epochs=None, max_steps=None, save_every=None, save_every_steps=None,
                eval_every=None, log_every=10, check_every=1)  # fmt: skip
    return RunPlan.from_args(**{**args, **kwargs})


def test_plan_limits_total_steps_and_schedule():
    with pytest.raises(ValueError, match="neither max_epochs nor max_steps"):
        _plan()
    with pytest.raises(
        ValueError, match=r"save_every_steps must be an int >= 1, got 0 \(or None\)"
    ):
        _plan(max_steps=5, save_every_steps=0)
    epochs = _plan(max_epochs=3)
    assert epochs.save_every == 1  # the default: every epoch
    assert _plan(max_steps=5, save_every_steps=2).save_every is None
    where = dict(per_epoch=7, accum=2)
    assert epochs.total_steps(step=0, epoch=0, batch=0, **where) == 12
    # Resumed in the middle of epoch 2 (batch 4, step 6) or at its end: the same total.
    assert epochs.total_steps(step=6, epoch=1, batch=4, **where) == 12
    assert epochs.total_steps(step=8, epoch=2, batch=0, **where) == 12
    assert _plan(max_steps=10).total_steps(step=0, epoch=0, batch=0, **where) == 10
    assert _plan(max_epochs=3, max_steps=100).total_steps(step=0, epoch=0, batch=0, **where) == 12
    assert _plan(max_epochs=3, max_steps=5).total_steps(step=0, epoch=0, batch=0, **where) == 5
    both = _plan(max_epochs=3, max_steps=5, check_every=4, log_every=3, eval_every=2)
    assert [s for s in range(1, 13) if both.agrees_at(s)] == [3, 4, 6, 8, 9, 12]
    assert both.finished(epoch=1, step=5) and not both.finished(epoch=2, step=4)
    assert [s for s in range(1, 7) if both.saves_at(s)] == [5]  # the end of the run


def test_jsonl_and_csv_append_widen_and_resume(tmp_path):
    jsonl, csv_path = tmp_path / "steps.jsonl", tmp_path / "steps.csv"
    loggers = [JsonlLogger(jsonl, start_step=0), CsvLogger(csv_path, start_step=0)]
    for step in (2, 4, 6):
        metrics = {"epoch": step / 4, "loss": 1 / step}
        if step == 4:
            metrics["eval_loss"] = 0.5  # a new column from the 2nd row on
        for logger in loggers:
            logger.log_metrics(metrics, step)
    assert [json.loads(line)["step"] for line in jsonl.read_text().splitlines()] == [2, 4, 6]
    assert csv_path.read_text().splitlines() == [
        "step,epoch,loss,eval_loss",
        "2,0.5,0.5,",
        "4,1.0,0.25,0.5",
        "6,1.5,0.16666666666666666,",
    ]
    # A run resumed from step 4: steps after it go, new ones follow.
    again = [JsonlLogger(jsonl, start_step=4), CsvLogger(csv_path, start_step=4)]
    for logger in again:
        logger.log_metrics({"epoch": 1.5, "loss": 0.125}, 6)
    assert [json.loads(line) for line in jsonl.read_text().splitlines()][1:] == [
        {"step": 4, "epoch": 1.0, "loss": 0.25, "eval_loss": 0.5},
        {"step": 6, "epoch": 1.5, "loss": 0.125},
    ]
    assert csv_path.read_text().splitlines()[2:] == ["4,1.0,0.25,0.5", "6,1.5,0.125,"]
    JsonlLogger(jsonl, start_step=0), CsvLogger(csv_path, start_step=0)  # a fresh run
    assert jsonl.read_text() == "" and csv_path.read_text().splitlines() == [
        "step,epoch,loss,eval_loss"
    ]


def _scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def test_tensorboard_event_files_hold_the_steps_and_a_resume_purges(tmp_path):
    pytest.importorskip("tensorboard")
    first = TensorBoardLogger(tmp_path, start_step=0)
    for step in range(1, 7):
        first.log_metrics({"loss": float(step)}, step)
    first.flush()
    assert _scalars(tmp_path) == {"loss": [(s, float(s)) for s in range(1, 7)]}
    resumed = TensorBoardLogger(tmp_path, start_step=4)  # from a checkpoint at step 4
    for step in range(5, 9):
        resumed.log_metrics({"loss": 10.0 * step, "lr": 0.5}, step)
    resumed.flush()
    assert _scalars(tmp_path) == {
        "loss": [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)] + [(s, 10.0 * s) for s in range(5, 9)],
        "lr": [(s, 0.5) for s in range(5, 9)],
    }


def test_bad_loggers(monkeypatch):
    with pytest.raises(ValueError, match=r"unknown logger 'wandb': the names are 'csv'"):
        check_loggers(["csv", "wandb"])
    with pytest.raises(ValueError, match=r"has no log_metrics\(metrics, step\)"):
        check_loggers([object()])
    with pytest.raises(ValueError, match="must be a list of names and objects"):
        check_loggers("csv")
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ImportError, match=r'pip install "tandem\[tensorboard\]"'):
        check_loggers(["tensorboard"])


class _Recorder:
    def __init__(self) -> None:
        self.records: list[tuple[int, dict]] = []

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.records.append((step, dict(metrics)))


def _token_step(model: nn.Module, batch) -> dict:
    x, y = batch
    return {"loss": F.cross_entropy(model(x), y), "tokens": 3 * len(x)}


def _trainer(tmp_path, recorder, **kwargs) -> Trainer:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 4, generator=g)
    data = TensorDataset(x, (x[:, 0] > 0).long())
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    args = dict(training_step=_token_step, eval_data=data, batch_size=4, max_steps=7,
                log_every=2, eval_every=3, loggers=["jsonl", recorder])  # fmt: skip
    return Trainer(net, lambda ps: torch.optim.SGD(ps, lr=0.1), data, run_dir=tmp_path,
                   progress=False, **{**args, **kwargs})  # fmt: skip


def test_a_trainer_logs_steps_and_evaluations_and_ends_mid_epoch(tmp_path):
    recorder = _Recorder()
    trainer = _trainer(tmp_path, recorder)
    assert trainer.total_steps == 7  # 10 batches an epoch, max_steps first
    summary = trainer.train()
    assert (summary.steps, summary.epochs, trainer.state.batch) == (7, 0, 7)
    saved = list_checkpoints(tmp_path)[-1]
    assert load_checkpoint(saved)["state"]["trainer"]["batch"] == 7  # mid-epoch
    steps = [step for step, _ in recorder.records]
    assert steps == [2, 3, 4, 6]
    by_step = dict(recorder.records)
    assert set(by_step[2]) == {"epoch", "loss", "lr", "samples_per_s", "tokens_per_s", "elapsed_s"}
    assert by_step[2]["epoch"] == 0.2 and by_step[2]["lr"] == 0.1
    # Tokens are 3 per sample, timed by the same clock as the samples.
    assert by_step[2]["tokens_per_s"] == pytest.approx(3 * by_step[2]["samples_per_s"])
    assert set(by_step[3]) == {"epoch", "eval_loss"}  # an evaluation (no accuracy: own step)
    assert {"loss", "eval_loss"} <= set(by_step[6])
    assert "grad_norm" not in by_step[6] and "skipped_steps" not in by_step[6]
    lines = (tmp_path / "steps.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == steps

    clipped = _trainer(tmp_path / "clipped", _Recorder(), clip_grad_norm=0.5, max_steps=2)
    clipped.train()
    assert clipped.log.loggers[1].records[-1][1]["grad_norm"] == clipped.last_grad_norm


def test_run_length_errors(tmp_path):
    with pytest.raises(ValueError, match="neither max_epochs nor max_steps"):
        _trainer(tmp_path, _Recorder(), max_steps=None)
    with pytest.raises(ValueError, match="eval_every=3 needs eval_data"):
        _trainer(tmp_path, _Recorder(), eval_data=None)
