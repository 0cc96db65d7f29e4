"""The Trainer's precisions equal a hand-written torch loop, bitwise, and fp16's skips are counted.

Proves:

- on 2 ranks, a Trainer run with ``precision="bf16-mixed"``, ``"fp16-mixed"`` (its GradScaler
  made by the Trainer) and ``"bf16-true"``, with gradient accumulation (2 micro-batches) and
  ``clip_grad_norm`` that binds, ends with parameters ``torch.equal`` to a hand-written loop over
  torch's own DistributedDataParallel with the same autocast, GradScaler (``scale`` ->
  ``unscale_`` -> ``clip_grad_norm_`` -> ``step`` -> ``update``), bfloat16 conversion, seeds and
  data order (torch's DistributedSampler, ``set_epoch``); every epoch's train loss and eval loss
  (evaluation under the same autocast) are ``==``, and so are the last step's gradient norm and
  the scaler's scale. Under bf16-true the module's parameters are bfloat16;
- fp16 with a scaler starting too high (``scaler=GradScaler(init_scale=2**24)``, precision left
  unset, which means fp16-mixed): the Trainer's ``skipped_steps`` equals the number of steps in
  which the hand-written loop's parameters did not change (more than 0, fewer than all); the
  count and the scaler's state are saved with the checkpoint, so a run stopped after its first
  epoch and resumed ends ``torch.equal`` to the uninterrupted one with the same count (one
  process).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.data import DistributedSampler, TensorDataset

from tandem.data.eval_sampler import shard_range
from tandem.train.trainer import Trainer
from tests.harness import run_ranks

EPOCHS = 2
BATCH = 4
ACCUM = 2
CLIP = 0.5
N_TRAIN, N_EVAL = 40, 11  # 20 per rank: 5 batches, steps of 2, 2, 1


def _data() -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_TRAIN + N_EVAL, 8, generator=g) * 2
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), TensorDataset(x[N_TRAIN:], y[N_TRAIN:])


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3)
    )


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _autocast(precision: str) -> contextlib.AbstractContextManager:
    dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(precision)
    return torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()


def _trainer(run_dir: str, precision: str | None, epochs: int = EPOCHS, **kwargs) -> Trainer:
    train_set, eval_set = _data()
    return Trainer(
        _model(),
        _optimizer,
        train_set,
        loss_fn=F.cross_entropy,
        eval_data=eval_set,
        max_epochs=epochs,
        save_every=1,
        batch_size=BATCH,
        eval_batch_size=N_EVAL,  # one batch per rank's shard
        grad_accum_steps=ACCUM,
        run_dir=run_dir,
        precision=precision,
        clip_grad_norm=CLIP,
        progress=False,
        **kwargs,
    )


def _hand_loop(precision: str, scaler: torch.amp.GradScaler | None, world: int, rank: int):
    """The same training written out by hand, torch's own DDP when there are ranks."""
    train_set, eval_set = _data()
    x_all, y_all = train_set.tensors
    model = _model()
    if precision == "bf16-true":
        model.to(torch.bfloat16)
    ddp = TorchDDP(model) if world > 1 else model
    opt = _optimizer(model.parameters())
    cast = (lambda t: t.bfloat16()) if precision == "bf16-true" else (lambda t: t)
    losses, norms, unchanged = [], [], 0
    for epoch in range(EPOCHS):
        sampler = DistributedSampler(train_set, world, rank, shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        order = list(sampler)
        batches = [order[i : i + BATCH] for i in range(0, len(order), BATCH)]
        total, count = 0.0, 0
        for start in range(0, len(batches), ACCUM):
            group = batches[start : start + ACCUM]
            for i, index in enumerate(group):
                last = i == len(group) - 1
                with contextlib.nullcontext() if last or world == 1 else ddp.no_sync():
                    with _autocast(precision):
                        loss = F.cross_entropy(ddp(cast(x_all[index])), y_all[index])
                    scaled = loss * (1 / len(group))
                    (scaler.scale(scaled) if scaler is not None else scaled).backward()
                total += loss.item() * len(index)
                count += len(index)
            before = [p.detach().clone() for p in model.parameters()]
            if scaler is not None:
                scaler.unscale_(opt)
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()
            unchanged += all(
                torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
            )
        sums = torch.tensor([total, count], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(sums)
        total, count = sums.tolist()
        # Evaluation: this rank's EvalSampler shard, one batch, as the Trainer's.
        x_eval, y_eval = eval_set.tensors
        shard = list(shard_range(N_EVAL, world, rank))
        with torch.no_grad(), _autocast(precision):
            eval_loss = F.cross_entropy(model(cast(x_eval[shard])), y_eval[shard])
        eval_sums = torch.tensor(
            [float(eval_loss.double()) * len(shard), len(shard)], dtype=torch.float64
        )
        if world > 1:
            dist.all_reduce(eval_sums)
        eval_total, eval_count = eval_sums.tolist()
        losses.append((total / count, eval_total / eval_count))
    return model, losses, norms[-1], unchanged


def _parity(run_dir: str, precision: str) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    trainer = _trainer(run_dir, precision)
    summary = trainer.train()
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16-mixed" else None
    model, losses, norm, _ = _hand_loop(precision, scaler, world, rank)
    return {
        "same_params": all(
            torch.equal(a, b)
            for a, b in zip(trainer.module.parameters(), model.parameters(), strict=True)
        ),
        "dtypes": {str(p.dtype) for p in trainer.module.parameters()},
        "losses": ([(r["train_loss"], r["eval_loss"]) for r in summary.history], losses),
        "norms": (trainer.last_grad_norm, norm),
        "scales": (
            trainer.scaler.get_scale() if trainer.scaler is not None else None,
            scaler.get_scale() if scaler is not None else None,
        ),
        "made_scaler": type(trainer.scaler).__name__,
    }


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed", "bf16-true"])
def test_trainer_equals_a_hand_written_ddp_loop_bitwise(tmp_path, precision):
    for result in run_ranks(_parity, 2, args=(str(tmp_path), precision), timeout=90):
        assert result["same_params"], result
        got, want = result["losses"]
        assert got == want, result
        assert result["norms"][0] == result["norms"][1], result
        assert result["scales"][0] == result["scales"][1], result
        want_scaler = "GradScaler" if precision == "fp16-mixed" else "NoneType"
        assert result["made_scaler"] == want_scaler, result
        want_dtype = "torch.bfloat16" if precision == "bf16-true" else "torch.float32"
        assert result["dtypes"] == {want_dtype}, result


def _high_scaler() -> torch.amp.GradScaler:
    # float16 overflows in backward until the scale has halved below about 2**19.
    return torch.amp.GradScaler("cpu", init_scale=2.0**24)


def test_fp16_skipped_steps_are_counted_and_resume_with_the_checkpoint(tmp_path):
    whole = _trainer(str(tmp_path / "whole"), None, scaler=_high_scaler())
    assert whole.precision == "fp16-mixed"
    whole.train()
    model, _, _, unchanged = _hand_loop("fp16-mixed", _high_scaler(), 1, 0)
    for a, b in zip(whole.module.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    steps = whole.step
    assert 0 < whole.skipped_steps == unchanged < steps, (whole.skipped_steps, unchanged, steps)

    _trainer(str(tmp_path / "resumed"), None, epochs=1, scaler=_high_scaler()).train()
    resumed = _trainer(str(tmp_path / "resumed"), None, scaler=_high_scaler(), resume="latest")
    assert resumed.skipped_steps == min(unchanged, resumed.step)  # loaded with the checkpoint
    resumed.train()
    assert resumed.skipped_steps == whole.skipped_steps
    assert resumed.scaler.get_scale() == whole.scaler.get_scale()
    for a, b in zip(resumed.module.parameters(), whole.module.parameters(), strict=True):
        assert torch.equal(a, b)
