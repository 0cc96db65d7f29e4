"""The digits CNN example trains, unchanged, as one process and as two under tandem run.

Proves: ``python -m tandem.examples.digits`` and ``tandem run --nproc-per-node 2 -m
tandem.examples.digits`` exit 0; the header reports the number of processes started (one
group of two, not two lone runs); exactly one line per epoch, numbered 1..E (only rank 0
prints); the training loss averaged over ranks falls below a tenth of the first epoch's; the
final test accuracy is at least 0.97, where the untrained network scores near chance (checked
in-process, so the threshold measures training); and the run directory holds the checkpoints,
``metrics.jsonl`` (one record per epoch) and ``metrics.png``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem.checkpoint.run_dir import list_checkpoints
from tandem.examples.digits import load_data, make_model
from tests.launching import clean_env, tandem_run_module

EPOCHS = 15
MIN_ACCURACY = 0.97

_HEADER = re.compile(r"^digits: \d+ training samples on (\d+) process\(es\)", re.MULTILINE)
_EPOCH = re.compile(r"^epoch\s+(\d+)\s+loss\s+([0-9.]+)\s+test accuracy\s+([0-9.]+)$", re.M)
_FINAL = re.compile(r"^final test accuracy ([0-9.]+)$", re.MULTILINE)


def _run_and_check(command: list[str], run_dir: Path, processes: int) -> None:
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=180, env=clean_env(), check=False
    )
    shown = f"command: {command}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert done.returncode == 0, f"exit code {done.returncode}\n{shown}"
    header, final = _HEADER.findall(done.stdout), _FINAL.findall(done.stdout)
    epochs = _EPOCH.findall(done.stdout)
    assert header == [str(processes)] and len(final) == 1, shown
    assert [int(e) for e, _, _ in epochs] == list(range(1, EPOCHS + 1)), shown
    losses = [float(loss) for _, loss, _ in epochs]
    assert losses[-1] < 0.1 * losses[0], shown
    assert float(final[0]) >= MIN_ACCURACY, shown

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == list(range(1, EPOCHS + 1))
    assert (run_dir / "metrics.png").stat().st_size > 0
    assert list_checkpoints(run_dir), f"no checkpoints in {run_dir}"


def test_untrained_network_is_near_chance():
    _, test_set = load_data()
    torch.manual_seed(0)  # the example's initial weights
    model = make_model().eval()
    x, y = test_set.tensors
    with torch.no_grad():
        assert (model(x).argmax(-1) == y).float().mean().item() < 0.3


@pytest.mark.launch
def test_one_process(tmp_path):
    command = [sys.executable, "-m", "tandem.examples.digits", "--run-dir", str(tmp_path)]
    _run_and_check(command, tmp_path, processes=1)


@pytest.mark.launch
def test_two_processes_under_tandem_run(tmp_path):
    command = tandem_run_module("tandem.examples.digits", "--run-dir", str(tmp_path))
    _run_and_check(command, tmp_path, processes=2)
