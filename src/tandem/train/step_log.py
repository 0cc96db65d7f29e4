"""The step log's window: what the steps since the last record add up to, on every rank.

Every ``log_every`` optimizer steps rank 0 writes a record of the steps since the previous one:
the loss (the mean over every rank's samples in them, weighted by count as the epoch's loss
is), the learning rate, the gradient norm, samples/s and tokens/s. Each rank adds its
micro-batches to its own sums (:meth:`StepWindow.add`); the sums travel to the other ranks in
the step agreement the Trainer makes anyway (:class:`tandem.train.stop_and_save.Requests`, which
the plan schedules at every log step), so logging adds no collective of its own.

A checkpoint may fall between two records (every ``save_every_steps``, a signal's): each
rank's sums are then saved with the run (:class:`SavedRun`) and a resumed run adds the same
numbers in the same order as the uninterrupted one, so its records are equal, bitwise, apart
from the timing columns. At another world size the saved ranks' sums are added up on rank 0.

Example::

    window = StepWindow()
    window.add(loss=0.7, count=32, tokens=None)       # each micro-batch
    window.seconds += step_time                        # rank 0's clock
    reduced = sum_over_ranks(window.sums())            # in the step agreement
    record = window.record(reduced, step=10, epoch=0.5, lr=1e-3)
    window.reset()
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tandem._dist import from_rank0
from tandem.checkpoint.rng import capture_rng_state
from tandem.train.loggers import (
    JSONL_FILE,
    LoggerArg,
    MetricsLogger,
    flush_all,
    log_all,
    open_loggers,
    read_jsonl,
)
from tandem.train.metrics_log import plot_metrics
from tandem.train.run_state import RunState

#: Columns that measure time: they differ between a run and its resumption.
TIMING_COLUMNS = ("samples_per_s", "tokens_per_s", "elapsed_s")

_WINDOW = "step_log"  # the key of the window's state in the checkpoint's "trainer" entry


class StepWindow:
    """This rank's sums over the optimizer steps since the last record."""

    def __init__(self) -> None:
        self.loss = 0.0  # sum of loss x count over micro-batches
        self.count = 0  # sum of counts (samples, or what the step returned as "count")
        self.tokens = 0  # sum of the "tokens" steps returned
        self.token_batches = 0  # micro-batches that returned "tokens"
        self.seconds = 0.0  # training time (rank 0's is the one shown)

    def add(self, loss: float, count: int, tokens: int | None) -> None:
        """One micro-batch: its mean loss, its count, its tokens (None if not returned)."""
        self.loss += loss * count
        self.count += count
        if tokens is not None:
            self.tokens += tokens
            self.token_batches += 1

    def sums(self) -> list[float]:
        """The numbers to add up over ranks (in the step agreement)."""
        return [self.loss, self.count, self.tokens, self.token_batches]

    def reset(self) -> None:
        """Start the next record's window (every rank, after a record's agreement)."""
        self.loss, self.count, self.tokens, self.token_batches = 0.0, 0, 0, 0
        self.seconds = 0.0

    def record(
        self,
        reduced: list[float],
        *,
        epoch: float,
        lr: float | None,
        grad_norm: float | None = None,
        skipped_steps: int | None = None,
        elapsed_s: float | None = None,
    ) -> dict[str, Any]:
        """The record of this window from ``reduced`` (:meth:`sums` added up over ranks).

        Entries that do not apply are left out: ``grad_norm`` without clipping,
        ``tokens_per_s`` when no step returned ``"tokens"``, ``skipped_steps`` unless fp16.

        Example::

            window.record([6.4, 64, 0, 0], epoch=0.25, lr=0.1)
            # {'epoch': 0.25, 'loss': 0.1, 'lr': 0.1, 'samples_per_s': ...}
        """
        loss, count, tokens, token_batches = reduced
        seconds = self.seconds
        out: dict[str, Any] = {"epoch": epoch, "loss": loss / count if count else math.nan}
        if lr is not None:
            out["lr"] = lr
        if grad_norm is not None:
            out["grad_norm"] = grad_norm
        if skipped_steps is not None:
            out["skipped_steps"] = skipped_steps
        out["samples_per_s"] = count / seconds if seconds > 0 else None
        if token_batches:
            out["tokens_per_s"] = tokens / seconds if seconds > 0 else None
        if elapsed_s is not None:
            out["elapsed_s"] = elapsed_s
        return out

    # -- state: the shared part is rank 0's clock, the rest is each rank's own --------------

    def state_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds}

    def rank_state_dict(self) -> dict[str, Any]:
        return {"sums": [self.loss, self.count, self.tokens, self.token_batches]}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.seconds = 0.0 if state is None else float(state["seconds"])

    def load_rank_state_dicts(
        self, states: list[dict[str, Any] | None], rank: int, world_size: int
    ) -> None:
        """This rank's saved sums at the same world size, else all of them added up on rank 0
        (see the module doc); a checkpoint of an older tandem saved none: zeros."""
        if any(s is None for s in states):
            sums: list[Any] = [0.0, 0, 0, 0]
        elif len(states) == world_size:
            sums = list(states[rank]["sums"])  # type: ignore[index]
        else:
            columns = zip(*(s["sums"] for s in states), strict=True)  # type: ignore[index]
            sums = [sum(c) if rank == 0 else type(c[0])(0) for c in columns]
        self.loss, self.count, self.tokens, self.token_batches = sums


def lr_of(optimizer: Any) -> float | None:
    """The learning rate of the optimizer's first parameter group (None if it has none)."""
    groups = getattr(optimizer, "param_groups", None)
    if not groups or "lr" not in groups[0]:
        return None
    return float(groups[0]["lr"])


class SavedRun:
    """The checkpoint's ``"trainer"`` entry: the run's state with the step log's window in it.

    One entry, so that a checkpoint of an older tandem (without the window) still resumes,
    with an empty window, and the checkpointer needs no new object.

    Example::

        objects = {"trainer": SavedRun(run_state, window, world_size=2), ...}
    """

    def __init__(self, run: RunState, window: StepWindow, *, world_size: int) -> None:
        self.run = run
        self.window = window
        self.world_size = world_size

    def state_dict(self) -> dict[str, Any]:
        return {**self.run.state_dict(), _WINDOW: self.window.state_dict()}

    def rank_state_dict(
        self, capture: Callable[[], dict[str, Any]] = capture_rng_state
    ) -> dict[str, Any]:
        return {**self.run.rank_state_dict(capture), _WINDOW: self.window.rank_state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self.window.load_state_dict(state.pop(_WINDOW, None))
        self.run.load_state_dict(state)

    def load_rank_state_dicts(self, states: list[dict[str, Any]], rank: int) -> None:
        windows = [s.get(_WINDOW) for s in states]
        self.window.load_rank_state_dicts(windows, rank, self.world_size)
        self.run.load_rank_state_dicts([_without(s, _WINDOW) for s in states], rank)


def _without(state: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in state.items() if k != key}


class RunLog:
    """A run's step log: this rank's window; on rank 0 the loggers and the plot.

    Args:
        run_dir: the run's directory (the file loggers and ``metrics.png`` go there).
        loggers: the checked ``loggers`` argument (:func:`tandem.train.loggers.check_loggers`).
        main: this is rank 0, the one that logs.

    Example::

        log = RunLog(run_dir, ["csv", "jsonl"], main=w.is_main)
        log.open(start_step=run.step)                      # after a resume: cut back to it
        log.write({"epoch": 0.5, **log.window.record(reduced, epoch=0.5, lr=0.1)}, step=10)
        log.finish(history)
    """

    def __init__(self, run_dir: Path, loggers: Sequence[LoggerArg], *, main: bool) -> None:
        self.run_dir = run_dir
        self.specs = list(loggers)
        self.main = main
        self.window = StepWindow()
        self.loggers: list[MetricsLogger] = []

    def open(self, *, start_step: int) -> None:
        """Open rank 0's loggers for a run going on from ``start_step`` (call on every rank:
        an error opening them is raised on every rank alike)."""
        verdict = None
        if self.main:
            try:
                self.loggers = open_loggers(self.specs, self.run_dir, start_step=start_step)
            except (ImportError, OSError, ValueError) as e:
                verdict = (type(e).__name__, f"rank 0 could not open the loggers: {e}")
        verdict = from_rank0(verdict)
        if verdict is not None:
            kind, message = verdict
            raise {"ImportError": ImportError, "OSError": OSError}.get(kind, ValueError)(message)

    def reopen(self, *, main: bool, start_step: int) -> None:
        """The group was re-formed (recovery in memory) and rank 0 may be another process:
        the old loggers are flushed and let go, ``main``'s opened from ``start_step`` (a
        collective, as :meth:`open`)."""
        if self.main:
            flush_all(self.loggers)
        self.loggers, self.main = [], main
        self.open(start_step=start_step)

    def write(self, metrics: dict[str, Any], step: int) -> None:
        """``metrics`` of optimizer step ``step`` to the loggers (rank 0; a no-op elsewhere)."""
        if self.main:
            log_all(self.loggers, metrics, step)

    def finish(self, history: Sequence[dict[str, Any]]) -> None:
        """``train()`` returns: flush the loggers, draw ``metrics.png`` (rank 0)."""
        if not self.main:
            return
        flush_all(self.loggers)
        steps = read_jsonl(self.run_dir / JSONL_FILE) if "jsonl" in self.specs else []
        if not steps and not history:
            return
        try:
            plot_metrics(self.run_dir, history, steps)
        except ImportError as e:  # the run is done: a missing extra must not fail it
            warnings.warn(f"{self.run_dir / 'metrics.png'} not drawn: {e}", stacklevel=3)
