"""The Trainer's new arguments on one process: what they build, and every bad value's error.

Proves:

- precision: the default is 32-true without a scaler; ``"fp16-mixed"`` makes a
  ``torch.amp.GradScaler``; a scaler given alone means fp16-mixed with that very scaler;
  ``"bf16-true"`` turns the module's floating parameters (and buffers) to bfloat16, and its
  batches too, so training runs;
- factories: ``optimizer=lambda params: ...`` is called once with the model's parameters,
  ``scheduler=lambda opt: ...`` with the Trainer's optimizer;
- one walker moves any batch: namedtuples, dataclasses, dict subclasses and objects with a
  ``to`` method keep their types; a batch counts the leading dimension of its first tensor,
  or the step's ``"count"``;
- bad input is a ValueError naming the value and the way out: an unknown precision (the valid
  names listed), a scaler with another precision, ``clip_grad_norm`` not a number > 0, neither
  ``loss_fn`` nor ``training_step``, an optimizer factory over other parameters or returning no
  optimizer, a scheduler factory returning no scheduler, all before training; a step returning
  no loss, a metric that is not one number, and a batch the default step cannot split, at the
  first step, before any optimizer step.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from tandem._tree import to_device
from tandem.train.precision import PRECISIONS
from tandem.train.step import count_samples, unpack
from tandem.train.trainer import Trainer


def _data(n: int = 16) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


def _trainer(tmp_path, model=None, optimizer=None, data=None, **kwargs) -> Trainer:
    model = _net() if model is None else model
    args = {"loss_fn": F.cross_entropy, "max_epochs": 1, "save_every": 1, "batch_size": 4}
    return Trainer(
        model,
        optimizer or (lambda ps: torch.optim.SGD(ps, lr=0.1)),
        _data() if data is None else data,
        run_dir=tmp_path,
        progress=False,
        **{**args, **kwargs},
    )


def test_precision_rule_and_the_scaler(tmp_path):
    plain = _trainer(tmp_path)
    assert (plain.precision, plain.scaler, plain.skipped_steps) == ("32-true", None, 0)
    made = _trainer(tmp_path, precision="fp16-mixed")
    assert isinstance(made.scaler, torch.amp.GradScaler) and made.precision == "fp16-mixed"
    mine = torch.amp.GradScaler("cpu", init_scale=8.0)
    given = _trainer(tmp_path, scaler=mine)
    assert given.scaler is mine and given.precision == "fp16-mixed"
    true = _trainer(tmp_path, precision="bf16-true")
    assert {t.dtype for t in true.module.state_dict().values() if t.is_floating_point()} == {
        torch.bfloat16
    }
    summary = true.train()  # float32 batches become bfloat16 on the way in
    assert summary.steps == 4 and summary.train_loss == summary.train_loss  # not nan


def test_factories_are_built_over_the_models_parameters(tmp_path):
    seen = []

    def optimizer(params):
        seen.append(params)
        return torch.optim.AdamW(params, lr=1e-3)

    trainer = _trainer(
        tmp_path,
        optimizer=optimizer,
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5),
    )
    assert len(seen) == 1 and [id(p) for p in seen[0]] == [
        id(p) for p in trainer.module.parameters()
    ]
    assert trainer.scheduler.optimizer is trainer.optimizer
    trainer.train()
    assert trainer.optimizer.param_groups[0]["lr"] == 5e-4  # the scheduler stepped once


@dataclasses.dataclass
class _Pair:
    x: torch.Tensor
    note: str


class _Movable:
    def __init__(self) -> None:
        self.moved_to = None

    def to(self, device):
        self.moved_to = device
        return self


def test_one_walker_moves_any_batch_and_counts_it():
    Batch = namedtuple("Batch", "inputs extra")
    movable = _Movable()
    batch = Batch(
        OrderedDict(ids=torch.zeros(5, 3), mask=torch.ones(5, 3, dtype=torch.bool)),
        [_Pair(torch.ones(5), "kept"), movable, "text", 7],
    )
    moved = to_device(batch, torch.device("cpu"), torch.bfloat16)
    assert type(moved) is Batch and type(moved.inputs) is OrderedDict
    assert moved.inputs["ids"].dtype == torch.bfloat16 and moved.inputs["mask"].dtype == torch.bool
    pair = moved.extra[0]
    assert type(pair) is _Pair and pair.note == "kept" and pair.x.dtype == torch.bfloat16
    assert moved.extra[1] is movable and movable.moved_to == torch.device("cpu")
    assert moved.extra[2:] == ["text", 7]
    assert count_samples(batch) == 5
    assert count_samples({"label": torch.tensor(3)}) == 1
    assert (
        unpack({"loss": torch.tensor(1.0), "count": torch.tensor(12)}, batch, "eval_step").count
        == 12
    )
    with pytest.raises(ValueError, match="batch of type list with no tensor"):
        count_samples(["a", "b"])


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (
            {"precision": "fp16"},
            "precision='fp16' is not one of " + ", ".join(map(repr, PRECISIONS)),
        ),
        (
            {"precision": "bf16-mixed", "scaler": torch.amp.GradScaler("cpu")},
            "scaler= was given with precision='bf16-mixed'",
        ),
        ({"clip_grad_norm": 0}, "clip_grad_norm must be > 0, got 0"),
        ({"clip_grad_norm": -1.5}, "clip_grad_norm must be > 0, got -1.5"),
        ({"clip_grad_norm": "1.0"}, "clip_grad_norm must be a finite number > 0 .* got '1.0'"),
        ({"clip_grad_norm": True}, "clip_grad_norm must be a finite number > 0 .* got True"),
        ({"clip_grad_norm": float("nan")}, "clip_grad_norm must be a finite number > 0 .* got nan"),
        ({"loss_fn": None}, "neither loss_fn nor training_step was given"),
        ({"optimizer": 3}, "optimizer must be an optimizer or a factory .* got int"),
        (
            {"optimizer": lambda ps: torch.optim.SGD(nn.Linear(8, 2).parameters(), lr=0.1)},
            r"over 2 parameter\(s\) that are not the model's \(it holds 2; .* has 6\)",
        ),
        ({"optimizer": lambda ps: list(ps)}, "the optimizer factory returned list"),
        ({"scheduler": lambda opt: None}, "the scheduler factory returned NoneType"),
    ],
)
def test_bad_arguments_before_training(tmp_path, kwargs, words):
    with pytest.raises(ValueError, match=words):
        _trainer(tmp_path, **kwargs)
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (
            {"training_step": lambda m, b: "a string", "loss_fn": None},
            "training_step returned a str: 'a string'; it must return the loss",
        ),
        (
            {"training_step": lambda m, b: {"logits": m(b[0])}, "loss_fn": None},
            r"training_step returned a dict \(keys \['logits'\]\)",
        ),
        (
            {"loss_fn": lambda out, y: F.cross_entropy(out, y, reduction="none")},
            r"training_step's loss must be a one-element tensor, got shape \(4,\)",
        ),
        (
            {
                "training_step": lambda m, b: {
                    "loss": F.cross_entropy(m(b[0]), b[1]),
                    "per_sample": torch.ones(4),
                },
                "loss_fn": None,
            },
            r"metric 'per_sample' = shape \(4,\): a metric is one number",
        ),
        (
            {"data": TensorDataset(*_data().tensors, torch.zeros(16))},
            r"this batch is a list of 3 items\. Pass training_step=",
        ),
    ],
)
def test_bad_steps_and_batches_at_the_first_step(tmp_path, kwargs, words):
    trainer = _trainer(tmp_path, **kwargs)
    with pytest.raises(ValueError, match=words):
        trainer.train()
    assert trainer.step == 0
