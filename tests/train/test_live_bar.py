"""Under `tandem run`, rank 0's progress is a live bar on a terminal and plain lines elsewhere.

Proves:

- on a real pseudo-terminal (``os.openpty``), ``tandem run --nproc-per-node 2`` on a small
  Trainer script shows rank 0's bar while it runs: redraws of ``[rank 0] epoch E/2: ...|
  N/16 steps`` (optimizer steps of the run's 16, not micro-batches: the run accumulates 2 per
  step) arrive one after another with a carriage return and an erased line, at least one of
  them in the middle of the run; the epoch lines are printed whole above the bar, and no
  plain progress line is printed;
- without a terminal (pipes, as in CI or SLURM's files) the same command prints plain
  progress lines, ``[rank 0] step N/16  epoch E/2  batch B/16 ...``, and no carriage return;
- the relay itself (a pipe, no processes): lines are passed on whole, the text after each
  carriage return is shown at once as the bar's new state, prefixed, and a bar that ends with
  a newline stays as a line.
"""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import pytest

from tandem.launch.relay import relay
from tests.launching import clean_env

SCRIPT = """
import sys, time
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
import tandem
from tandem.train import progress
from tandem.train.trainer import Trainer

progress.LOG_INTERVAL_S = 0.0  # off a terminal: a line at every step


def step(model, batch):
    time.sleep(0.04)  # 32 micro-batches: the bar (redrawn every 0.5 s) shows the middle
    x, y = batch
    return F.cross_entropy(model(x), y)


torch.manual_seed(0)
x = torch.randn(128, 4)
data = TensorDataset(x, (x[:, 0] > 0).long())
trainer = Trainer(nn.Linear(4, 2), lambda ps: torch.optim.SGD(ps, lr=0.1), data,
                  training_step=step, max_epochs=2, batch_size=4, grad_accum_steps=2,
                  run_dir=sys.argv[1], log_every=None, loggers=[])
trainer.train()
tandem.shutdown()
"""
TIMEOUT_S = 90


def _command(tmp_path: Path) -> list[str]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run = [sys.executable, "-m", "tandem.cli", "run", "--nproc-per-node", "2"]
    return [*run, str(script), str(tmp_path / "run")]


def _on_a_terminal(command: list[str]) -> tuple[int, str]:
    """Run ``command`` with stdout and stderr on a new pseudo-terminal; its exit and output."""
    import fcntl
    import struct
    import termios

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 120, 0, 0))
    proc = subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=clean_env()
    )
    os.close(slave)
    chunks, deadline = [], time.monotonic() + TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                continue
            try:
                data = os.read(master, 1 << 16)
            except OSError:  # EIO: every process holding the terminal has exited
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    return proc.returncode, b"".join(chunks).decode("utf-8", errors="replace")


@pytest.mark.launch
def test_a_live_bar_of_optimizer_steps_on_a_terminal(tmp_path):
    code, out = _on_a_terminal(_command(tmp_path))
    assert code == 0, out
    # Each redraw: back to the line's start, erase it, rank 0's bar.
    redraws = re.findall(r"\r\x1b\[K\[rank 0\] epoch ([12])/2: .*?\| *(\d+)/16 steps", out)
    counts = [int(n) for _, n in redraws]
    assert counts and counts == sorted(counts), out
    assert any(0 < n < 16 for n in counts), out  # a redraw in the middle of the run
    assert re.search(r"\[rank 0\] epoch   1  loss \d", out), out  # lines, whole
    assert not re.search(r"step \d+/16  epoch", out), out


@pytest.mark.launch
def test_plain_progress_lines_without_a_terminal(tmp_path):
    result = subprocess.run(
        _command(tmp_path), capture_output=True, text=True, timeout=TIMEOUT_S, env=clean_env()
    )
    assert result.returncode == 0, result.stderr
    lines = re.findall(r"^\[rank 0\] step (\d+)/16  epoch ([12])/2  batch (\d+)/16 ",
                       result.stderr, re.MULTILINE)  # fmt: skip
    assert [int(step) for step, _, _ in lines] == list(range(1, 17)), result.stderr
    assert "\r" not in result.stderr + result.stdout


class _Console:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def show(self, status: str) -> None:
        self.events.append(("bar", status))

    def line(self, out, text: str) -> None:
        self.events.append(("line", text))


def test_the_relay_shows_each_redraw_and_passes_lines(tmp_path):
    read, write = os.pipe()
    console, tail = _Console(), deque()
    chunks = [b"first \xc3", b"\xa9\n", b"\r 1/4 steps", b"\r 2/4 steps", b"\r 4/4 steps\n",
              b"\r    \r", b"done\n"]  # fmt: skip
    with open(read, "rb", buffering=0) as pipe:
        thread = relay(pipe, sys.stderr, "[rank 0] ", tmp_path, "stderr", tail, console, True)
        for chunk in chunks:
            os.write(write, chunk)
            time.sleep(0.05)  # one read per write: each redraw is a chunk of its own
        os.close(write)
        thread.join(timeout=10)
    assert console.events == [
        ("line", "[rank 0] first é"),  # a character cut in two by the pipe, whole
        ("bar", "[rank 0]  1/4 steps"),
        ("bar", "[rank 0]  2/4 steps"),
        ("bar", ""),  # the bar's last state ends with a newline: it stays as a line
        ("line", "[rank 0]  4/4 steps"),
        ("line", "[rank 0] done"),  # a cleared bar is nothing to show
    ]
    assert list(tail) == ["first é", " 4/4 steps", "done"]
    assert (tmp_path / "stderr.log").read_text() == "first é\n 4/4 steps\ndone\n"
