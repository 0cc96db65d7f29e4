"""A stopped and resumed 2-rank Trainer run ends bitwise equal to the uninterrupted run.

The run is built to make exactness hard: dropout with a different generator state on each rank
(so every rank's RNG must come back, each its own), SGD with momentum (optimizer state), a
scheduler stepped per epoch, gradient accumulation over 2 micro-batches with an odd number of
batches per epoch (7: steps of 2, 2, 2, 1), and a shuffled sampler. Every phase runs in fresh
processes, so nothing survives between them but the run directory.

Proves, with ``torch.equal`` on every parameter and ``==`` on every epoch's train loss, eval
loss and accuracy, on both ranks, that the uninterrupted 3-epoch run equals:

(a) a run with ``max_epochs=1`` resumed with ``resume="latest"`` to 3 epochs;
(b) a run in which rank 0 receives a real SIGUSR1 in epoch 1 and rank 1 a real SIGTERM in the
    middle of epoch 2, each in the middle of a gradient accumulation: both ranks save at the end
    of that optimizer step (the all-reduced request reaches rank 0, which never got SIGTERM),
    training goes on after SIGUSR1 and stops after SIGTERM with ``stopped_by="SIGTERM"`` on
    both ranks; resumed from ``latest`` (mid-epoch 2), from the SIGUSR1 checkpoint by its path
    (mid-epoch 1), and from the end of epoch 1 after the newest checkpoint was truncated.

The truncated checkpoint itself raises CheckpointError on both ranks, naming the file, while
the previous checkpoint stays usable by its path. Saved positions fall on accumulation
boundaries (a batch count that is a multiple of 2).
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from tandem.train.checkpoint import CheckpointError, list_checkpoints, load_checkpoint
from tandem.train.trainer import Trainer
from tests.harness import run_ranks

EPOCHS = 3
BATCHES_PER_EPOCH = 7  # 50 samples over 2 ranks is 25 each, in batches of 4
# The i-th micro-batch (counted from 1 over the whole run) after which a rank signals itself.
SIGNALS = {0: {3: signal.SIGUSR1}, 1: {BATCHES_PER_EPOCH + 3: signal.SIGTERM}}


def _data() -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(61, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return TensorDataset(x[:50], y[:50]), TensorDataset(x[50:], y[50:])


class _SignalsItself(Trainer):
    """A Trainer that sends its own process real signals after chosen micro-batches."""

    def __init__(self, *args, signals: dict[int, int], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._signals, self._seen = signals, 0

    def _run_batch(self, *args, **kwargs) -> None:
        super()._run_batch(*args, **kwargs)
        self._seen += 1
        if self._seen in self._signals:
            os.kill(os.getpid(), self._signals[self._seen])


def _train(run_dir: str, max_epochs: int, resume: str | None, signals: bool) -> dict:
    rank = int(os.environ["RANK"])
    train_set, test_set = _data()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 3))
    # Each rank its own dropout masks: restoring one rank's RNG on the other would show.
    torch.manual_seed(100 + rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    extra = {"signals": SIGNALS[rank]} if signals else {}
    trainer = (_SignalsItself if signals else Trainer)(
        model,
        optimizer,
        train_set,
        loss_fn=F.cross_entropy,
        eval_data=test_set,
        max_epochs=max_epochs,
        save_every=1,
        batch_size=4,
        run_dir=run_dir,
        scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7),
        grad_accum_steps=2,
        resume=resume,
        keep_checkpoints=10,
        progress=False,
        **extra,
    )
    assert len(trainer.train_loader) == BATCHES_PER_EPOCH
    summary = trainer.train()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "history": [
            (r["epoch"], r["step"], r["train_loss"], r["eval_loss"], r["eval_accuracy"])
            for r in summary.history
        ],
        "stopped_by": summary.stopped_by,
        "epochs": summary.epochs,
        "steps": summary.steps,
    }


def _resume_error(run_dir: str, resume: str) -> str:
    try:
        _train(run_dir, EPOCHS, resume, signals=False)
    except CheckpointError as e:
        return str(e)
    raise AssertionError("resuming from a truncated checkpoint did not raise")


def _run(run_dir: Path, max_epochs: int = EPOCHS, resume: str | None = None, signals=False):
    return run_ranks(_train, 2, args=(str(run_dir), max_epochs, resume, signals), timeout=60)


def _assert_same_run(got: list[dict], want: list[dict]) -> None:
    for rank in range(2):
        assert got[rank]["history"] == want[rank]["history"], (rank, got[rank]["history"])
        for a, b in zip(got[rank]["params"], want[rank]["params"], strict=True):
            assert torch.equal(a, b), f"rank {rank}: parameters differ by {(a - b).abs().max()}"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict]:
    result = _run(tmp_path_factory.mktemp("full"))
    assert [r["epochs"] for r in result] == [EPOCHS, EPOCHS]
    assert result[0]["history"][-1][1] == EPOCHS * 4  # 4 optimizer steps per epoch
    return result


def test_stopped_after_an_epoch_and_resumed(uninterrupted, tmp_path):
    first = _run(tmp_path, max_epochs=1)
    assert [r["epochs"] for r in first] == [1, 1]
    _assert_same_run(_run(tmp_path, resume="latest"), uninterrupted)


def test_signals_mid_epoch_then_resumed_from_each_checkpoint(uninterrupted, tmp_path):
    stopped = _run(tmp_path / "run", signals=True)
    # Rank 0 never received SIGTERM; it stopped at the same step because the ranks agreed.
    assert [r["stopped_by"] for r in stopped] == ["SIGTERM", "SIGTERM"]
    assert [(r["epochs"], r["steps"]) for r in stopped] == [(1, 6), (1, 6)]
    names = [p.name for p in list_checkpoints(tmp_path / "run")]
    # SIGUSR1 after micro-batch 3: saved at the end of step 2 (batch 4 of epoch 1); epoch 1's
    # end (step 4); SIGTERM after micro-batch 10: saved at step 6 (batch 4 of epoch 2).
    assert names == [
        "ckpt-e0000-s00000002.pt",
        "ckpt-e0001-s00000004.pt",
        "ckpt-e0001-s00000006.pt",
    ]
    usr1, epoch_end, term = list_checkpoints(tmp_path / "run")
    for path, batch in ((usr1, 4), (epoch_end, 0), (term, 4)):
        assert load_checkpoint(path)["state"]["trainer"]["batch"] == batch, path
    for copy in ("usr1", "truncated"):
        shutil.copytree(tmp_path / "run", tmp_path / copy)

    _assert_same_run(_run(tmp_path / "run", resume="latest"), uninterrupted)
    _assert_same_run(
        _run(tmp_path / "usr1", resume=str(tmp_path / "usr1" / "checkpoints" / usr1.name)),
        uninterrupted,
    )

    # A truncated newest checkpoint: a clear error on every rank; the previous one still works.
    newest = tmp_path / "truncated" / "checkpoints" / term.name
    newest.write_bytes(newest.read_bytes()[:1000])
    errors = run_ranks(_resume_error, 2, args=(str(tmp_path / "truncated"), "latest"), timeout=60)
    for message in errors:
        assert str(newest) in message and "corrupt or truncated" in message, message
        assert epoch_end.name in message, message  # the way out is named
    previous = tmp_path / "truncated" / "checkpoints" / epoch_end.name
    _assert_same_run(_run(tmp_path / "truncated", resume=str(previous)), uninterrupted)
