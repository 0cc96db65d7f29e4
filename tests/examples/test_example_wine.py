"""The wine example trains, unchanged, as one process and as two under torchrun and tandem run.

Proves: ``python -m tandem.examples.wine`` and ``torchrun --nproc-per-node 2 -m
tandem.examples.wine`` both exit 0; the header reports the number of processes the launcher
started (so the two-process run really formed one group of two, not two lone runs); exactly
one line per epoch is printed, numbered 1..E (only rank 0 prints); the training loss averaged
over ranks falls to well under a fifth of the first epoch's; and the final test accuracy is at
least 0.95, where the same network untrained scores well below that (checked in-process, so
the threshold measures training, not the data set's ease).
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from tandem.examples.wine import accuracy, load_data, make_model
from tests.harness import free_port
from tests.launching import clean_env, tandem_run_module

EPOCHS = 15
MIN_ACCURACY = 0.95

_HEADER = re.compile(r"^wine: \d+ training samples on (\d+) process\(es\)", re.MULTILINE)
_EPOCH = re.compile(r"^epoch\s+(\d+)\s+loss\s+([0-9.]+)\s+test accuracy\s+([0-9.]+)$", re.M)
_FINAL = re.compile(r"^final test accuracy ([0-9.]+)$", re.MULTILINE)


@dataclass
class Printed:
    processes: int
    epochs: list[int]
    losses: list[float]
    final_accuracy: float


def _run(command: list[str], timeout: float) -> Printed:
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=clean_env(), check=False
    )
    shown = f"command: {command}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert done.returncode == 0, f"exit code {done.returncode}\n{shown}"
    header = _HEADER.findall(done.stdout)
    epochs = _EPOCH.findall(done.stdout)
    final = _FINAL.findall(done.stdout)
    assert len(header) == 1 and len(final) == 1, shown
    return Printed(
        processes=int(header[0]),
        epochs=[int(e) for e, _, _ in epochs],
        losses=[float(loss) for _, loss, _ in epochs],
        final_accuracy=float(final[0]),
    )


def _check_trained(printed: Printed, processes: int) -> None:
    assert printed.processes == processes, printed
    assert printed.epochs == list(range(1, EPOCHS + 1)), printed
    first, last = printed.losses[0], printed.losses[-1]
    assert last < 0.2 * first, f"loss fell only from {first} to {last}: {printed.losses}"
    assert printed.final_accuracy >= MIN_ACCURACY, printed


def test_untrained_network_is_far_below_the_threshold():
    _, x_test, y_test = load_data()
    torch.manual_seed(0)  # the example's initial weights
    assert accuracy(make_model(), x_test, y_test) < MIN_ACCURACY - 0.2


@pytest.mark.launch
def test_one_process():
    command = [sys.executable, "-m", "tandem.examples.wine", "--epochs", str(EPOCHS)]
    _check_trained(_run(command, timeout=120), processes=1)


@pytest.mark.launch
def test_two_processes_under_torchrun():
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        "-m",
        "tandem.examples.wine",
        "--epochs",
        str(EPOCHS),
    ]
    _check_trained(_run(command, timeout=180), processes=2)


@pytest.mark.launch
def test_two_processes_under_tandem_run():
    command = tandem_run_module("tandem.examples.wine", "--epochs", str(EPOCHS))
    _check_trained(_run(command, timeout=180), processes=2)
