"""Rank 0's progress bar: one bar per epoch, showing loss, global samples/s and the time left.

Only the main rank draws (``enabled``): N bars fighting over one terminal say nothing. The bar
goes to stderr, so the per-epoch lines on stdout stay clean for logs and tests. The numbers it
shows are global (summed over ranks by the Trainer's step agreement), not rank 0's own.

A bar needs a terminal: written to a pipe or a file (``tandem run`` relays output line by line,
SLURM writes files) its carriage returns pile up into one endless line. There it becomes a
plain line every ``LOG_INTERVAL_S`` seconds instead.
"""

from __future__ import annotations

import sys
import time
import warnings
from typing import Any

from tandem._optional import require

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


class Progress:
    """Epoch bars (or, off a terminal, periodic lines) for a run with ``batches_left`` to go.

    Args:
        enabled: show progress (rank 0 with ``progress=True``); otherwise every call is a no-op.
        batches_left: batches of this rank still to run before ``max_epochs``, for the time left.

    Example::

        progress = Progress(enabled=w.is_main, batches_left=epochs * len(loader))
        progress.start_epoch(epoch=1, max_epochs=epochs, batches=len(loader), done=0)
        for ...:
            progress.advance(1, loss=0.3, samples_per_s=5200.0)
        progress.end_epoch()
    """

    def __init__(self, enabled: bool, batches_left: int) -> None:
        self.enabled = enabled
        self._left = batches_left
        self._done = 0
        self._since = time.monotonic()
        self._bar: Any = None
        self._tqdm: Any = _tqdm() if enabled and sys.stderr.isatty() else None
        self._terminal = self._tqdm is not None
        self._epoch = (0, 0, 0)  # epoch, max_epochs, batches in it
        self._batch = 0
        self._logged = time.monotonic()

    def start_epoch(self, epoch: int, max_epochs: int, batches: int, done: int) -> None:
        """Open the bar of epoch ``epoch`` (counted from 1), ``done`` of ``batches`` already run."""
        self._epoch, self._batch = (epoch, max_epochs, batches), done
        if self.enabled and self._terminal:
            self._bar = self._tqdm(
                total=batches,
                initial=done,
                desc=f"epoch {epoch}/{max_epochs}",
                unit="batch",
                leave=False,  # the epoch's printed line replaces it
                file=sys.stderr,
                dynamic_ncols=True,
                mininterval=0.5,
            )

    def advance(self, batches: int, loss: float | None, samples_per_s: float | None) -> None:
        """Count ``batches`` more, showing the global running loss and throughput."""
        self._left -= batches
        self._done += batches
        self._batch += batches
        now = time.monotonic()
        if not self.enabled or (self._bar is None and now - self._logged < LOG_INTERVAL_S):
            return
        # Time left for the whole run, from this session's pace (evaluation time not included).
        pace = (now - self._since) / self._done
        shown = {}
        if loss is not None:
            shown["loss"] = f"{loss:.4f}"
        if samples_per_s is not None:
            shown["samples/s"] = f"{samples_per_s:.0f}"
        shown["left"] = _clock(pace * self._left)
        if self._bar is not None:
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(batches)
            return
        self._logged = now
        epoch, max_epochs, total = self._epoch
        fields = "  ".join(f"{k} {v}" for k, v in shown.items())
        print(
            f"epoch {epoch}/{max_epochs}  batch {self._batch}/{total}  {fields}",
            file=sys.stderr,
            flush=True,
        )

    def end_epoch(self) -> None:
        """Close the epoch's bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
