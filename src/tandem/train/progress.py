"""Rank 0's progress: one bar of optimizer steps for the whole run, or periodic lines.

Only the main rank draws (``enabled``): N bars fighting over one terminal say nothing. The bar
counts optimizer steps out of the run's total (:attr:`Trainer.total_steps`; micro-batches of
a gradient accumulation are one step), with the epoch, the loss, global samples/s and the time
left. It goes to stderr, so the lines on stdout stay clean for logs and tests; lines printed
while it is drawn go through :meth:`Progress.write`, which prints them above the bar.

A bar needs a terminal. Under ``tandem run`` the worker's stderr is a pipe to the launcher,
which says whether its own console is a terminal (``TANDEM_CONSOLE_TTY=1``, with the width
left after its ``[rank 0]`` prefix in ``TANDEM_CONSOLE_COLUMNS``) and relays the bar's
carriage-return updates as they come (:mod:`tandem.launch.relay`). Written to a pipe or a file
with no terminal behind it (CI, SLURM's output files) carriage returns pile up into one endless
line: there the progress is a plain line every ``LOG_INTERVAL_S`` seconds instead.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from typing import Any

from tandem._optional import require
from tandem.launch.relay import CONSOLE_COLUMNS, CONSOLE_TTY

LOG_INTERVAL_S = 30.0


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(max(seconds, 0)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def _tqdm() -> Any:
    """tqdm's bar class; without the ``progress`` extra, None (lines are printed instead)."""
    try:
        return require("tqdm", extra="progress").tqdm
    except ImportError as e:
        warnings.warn(f"no progress bar, lines instead: {e}", stacklevel=3)
        return None


def terminal_width() -> int | None:
    """The bar's width when stderr reaches a terminal: None where tqdm can ask the terminal
    itself (stderr is one), the launcher's width under ``tandem run``, 0 for no terminal.

    Example::

        width = terminal_width()   # 0 in CI: print lines
    """
    if sys.stderr.isatty():
        return None
    if os.environ.get(CONSOLE_TTY) == "1":
        try:
            return max(int(os.environ.get(CONSOLE_COLUMNS, "80")), 20)
        except ValueError:
            return 80
    return 0


class Progress:
    """A bar of the run's optimizer steps (or, off a terminal, periodic lines).

    Args:
        enabled: show progress (rank 0 with ``progress=True``); otherwise every call is a no-op.
        total_steps: optimizer steps of the whole run.
        done: steps already taken (a resumed run's).

    Example::

        progress = Progress(enabled=w.is_main, total_steps=trainer.total_steps, done=0)
        progress.start_epoch(epoch=1, max_epochs=epochs, batches=len(loader), done=0)
        for ...:
            progress.advance(1, batch=b, loss=0.3, samples_per_s=5200.0)
        progress.write("epoch   1  loss 0.3000")      # above the bar
        progress.close()
    """

    def __init__(self, enabled: bool, total_steps: int, done: int = 0) -> None:
        self.enabled = enabled
        self.total = total_steps
        self.step = done
        self._done_here = 0  # steps of this session: the pace for the time left
        self._since = time.monotonic()
        self._logged = time.monotonic()
        self._epoch: tuple[int, int | None, int] = (0, None, 0)  # epoch, max_epochs, batches
        self._batch = 0
        self._bar: Any = None
        self._width = terminal_width() if enabled else 0
        self._bar_cls = _tqdm() if self._width != 0 else None
        self._shown: dict[str, str] = {}  # the latest loss and samples/s

    def start_epoch(self, epoch: int, max_epochs: int | None, batches: int, done: int) -> None:
        """Epoch ``epoch`` (counted from 1) begins, ``done`` of its ``batches`` already run."""
        self._epoch, self._batch = (epoch, max_epochs, batches), done
        desc = f"epoch {epoch}" + (f"/{max_epochs}" if max_epochs is not None else "")
        if self._bar is not None:
            self._bar.set_description_str(desc, refresh=False)
        elif self._bar_cls is not None:  # drawn at once: made when its first line is known
            self._bar = self._bar_cls(
                total=self.total,
                initial=self.step,
                desc=desc,
                unit="step",
                # "12/400 steps": what the bar counts, said on it.
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} steps "
                "[{elapsed}<{remaining}{postfix}]",
                leave=False,  # the printed lines stay; the bar goes with the run
                file=sys.stderr,
                dynamic_ncols=self._width is None,
                ncols=self._width,
                mininterval=0.5,
            )

    def advance(
        self, steps: int, *, batch: int, loss: float | None, samples_per_s: float | None
    ) -> None:
        """Count ``steps`` optimizer steps more (the epoch is at ``batch``), showing the
        global running loss and throughput."""
        self.step += steps
        self._done_here += steps
        self._batch = batch
        # A step that brings no new figure keeps the last ones shown.
        if loss is not None:
            self._shown["loss"] = f"{loss:.4f}"
        if samples_per_s is not None:
            self._shown["samples/s"] = f"{samples_per_s:.0f}"
        now = time.monotonic()
        if not self.enabled or (self._bar is None and now - self._logged < LOG_INTERVAL_S):
            return
        shown = dict(self._shown)
        if self._bar is not None:
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(steps)  # tqdm redraws at most every mininterval
            return
        self._logged = now
        # Time left for the whole run, from this session's pace (evaluation time included).
        pace = (now - self._since) / self._done_here
        shown["left"] = _clock(pace * max(self.total - self.step, 0))
        epoch, max_epochs, batches = self._epoch
        of = f"/{max_epochs}" if max_epochs is not None else ""
        fields = "  ".join(f"{k} {v}" for k, v in shown.items())
        print(
            f"step {self.step}/{self.total}  epoch {epoch}{of}  batch {self._batch}/{batches}  "
            f"{fields}",
            file=sys.stderr,
            flush=True,
        )

    def write(self, line: str) -> None:
        """Print ``line`` on stdout (every rank may; on rank 0 above the bar)."""
        if self._bar is not None:
            self._bar.write(line, file=sys.stdout)
            sys.stdout.flush()
        else:
            print(line, flush=True)

    def close(self) -> None:
        """Take the bar off the terminal (the run is over)."""
        if self._bar is not None:
            self._bar.close()
        self._bar = self._bar_cls = None
