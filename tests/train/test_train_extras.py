"""The Trainer's optional pieces without their extras: a clear word, never a lost run.

- Without matplotlib (the ``plots`` extra) ``plot_metrics`` raises ImportError naming
  ``tandem[plots]``; a Trainer's run still finishes, with a warning saying the plot was skipped.
- Without tqdm (the ``progress`` extra) the progress display prints lines instead of a bar,
  and says once which extra brings the bar back.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from tandem.train import progress as progress_module
from tandem.train.metrics_log import plot_metrics
from tandem.train.trainer import Trainer


def _hide(monkeypatch, *modules: str) -> None:
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)  # import then raises ModuleNotFoundError


def test_plot_metrics_names_the_plots_extra(monkeypatch, tmp_path):
    _hide(monkeypatch, "matplotlib", "matplotlib.figure")
    with pytest.raises(ImportError, match=r'pip install "tandem\[plots\]"'):
        plot_metrics(tmp_path, [{"epoch": 1, "train_loss": 0.5}])
    assert not (tmp_path / "metrics.png").exists()


def test_a_run_finishes_without_matplotlib(monkeypatch, tmp_path):
    _hide(monkeypatch, "matplotlib", "matplotlib.figure")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    net = nn.Linear(4, 2)
    trainer = Trainer(
        net, torch.optim.SGD(net.parameters(), lr=0.1), data, loss_fn=F.cross_entropy,
        max_epochs=1, save_every=1, batch_size=8, run_dir=tmp_path, progress=False,
    )  # fmt: skip
    with pytest.warns(UserWarning, match=r"metrics\.png not drawn.*tandem\[plots\]"):
        summary = trainer.train()
    assert summary.epochs == 1 and summary.checkpoint is not None
    assert (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "metrics.png").exists()


def test_progress_without_tqdm_prints_lines(monkeypatch, capsys):
    _hide(monkeypatch, "tqdm")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    with pytest.warns(UserWarning, match=r'pip install "tandem\[progress\]"'):
        shown = progress_module.Progress(enabled=True, total_steps=2)
    monkeypatch.setattr(progress_module, "LOG_INTERVAL_S", 0.0)  # a line at every advance
    capsys.readouterr()
    shown.start_epoch(epoch=1, max_epochs=1, batches=4, done=0)
    shown.advance(2, batch=4, loss=0.5, samples_per_s=100.0)
    shown.close()
    err = capsys.readouterr().err
    assert "step 2/2  epoch 1/1  batch 4/4  loss 0.5000  samples/s 100" in err, err
