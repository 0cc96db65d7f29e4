"""What the Trainer does between two optimizer steps: agree, evaluate, log, save, as planned.

The loop (:mod:`tandem.train.trainer`) runs the micro-batches and the optimizer step; after
each step it hands over to :meth:`Boundaries._step_boundary`, and after an epoch's last step to
:meth:`Boundaries._end_epoch`, which take the plan's actions (:mod:`tandem.train.plan`) in its
order: agree, evaluate, log, save. Everything that happens at a step happens before its
checkpoint, so a run resumed from it does exactly what the uninterrupted run did after it.

Rank 0's view of it: evaluation lines and epoch lines printed (above the bar), a record to the
loggers at every log step and every evaluation, ``metrics.jsonl`` at every epoch's end.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tandem.train.metrics_log import epoch_line, write_metrics
from tandem.train.plan import RunPlan
from tandem.train.progress import Progress
from tandem.train.requests import Agreement
from tandem.train.step_log import RunLog
from tandem.train.trainer_base import TrainerBase


def eval_line(step: int, metrics: dict[str, Any]) -> str:
    """Rank 0's printed line for an evaluation every N steps.

    Example::

        >>> eval_line(200, {"eval_loss": 0.5, "eval_accuracy": 0.875, "eval_ppl": None})
        'step    200  eval loss 0.5000  eval accuracy 0.8750'
    """
    shown = "  ".join(
        f"{name.replace('_', ' ')} {value:.4f}"
        for name, value in metrics.items()
        if value is not None
    )
    return f"step {step:6d}  {shown}"


class Boundaries(TrainerBase):
    """The Trainer's step boundaries (see the module doc)."""

    # Set by the Trainer's constructor and train().
    log: RunLog
    progress: Progress
    scheduler_interval: str
    _lr: float | None
    _segment_start: float  # when the epoch's clock last counted (monotonic)

    def _clock_in(self) -> None:
        """Add the time since the clock last counted to the epoch's and the log window's.

        They count the epoch's loop, agreements and logging included (the samples/s shown
        are what the run achieves); evaluation and checkpoints are off the clock.
        """
        now = time.monotonic()
        self.state.epoch_seconds += now - self._segment_start
        self.log.window.seconds += now - self._segment_start
        self._segment_start = now

    @contextmanager
    def _off_the_clock(self) -> Iterator[None]:
        self._clock_in()
        try:
            yield
        finally:
            self._segment_start = time.monotonic()

    def _step_boundary(self, plan: RunPlan) -> Agreement | None:
        """After an optimizer step inside an epoch; the agreement acted on here, if any.

        What the ranks agreed for this boundary is acted on here (a stop or a save): the
        requests an earlier step's backward carried, or the agreement sent at the previous one;
        a log step also agrees at once, as its record needs this step's sums; without an engine
        that carries them, the other steps the plan checks send theirs in the background, to be
        read at the next one.
        """
        run = self.state
        agreed = run.requests.collect()
        loss, rate = None, None
        if agreed is not None and agreed.sums:  # the loss at the previous step: for the bar
            total, count, seconds = agreed.sums[:3]
            loss = total / count if count else None
            rate = count / seconds if seconds > 0 else None
        if plan.logs_at(run.step):
            now = run.requests.agree([*run.epoch_loss, *self.log.window.sums()])
            agreed = now if agreed is None else agreed.then(now)
            self._clock_in()
            total, count = now.sums[:2]
            loss = total / count if count else None
            rate = count / run.epoch_seconds if run.epoch_seconds > 0 else None
        elif (
            plan.agrees_at(run.step)
            and not run.requests.riding  # the engine's collective carried them already
            and not (agreed is not None and agreed.stop)
            and not plan.finished(epoch=run.epoch, step=run.step)
        ):
            self._clock_in()
            run.requests.send([*run.epoch_loss, run.epoch_seconds])
        evaluated = {}
        if plan.evaluates_at(run.step):
            with self._off_the_clock():
                evaluated = self.evaluate()
            if self.world.is_main:
                self.progress.write(eval_line(run.step, evaluated))
        self._log_step(plan, agreed, evaluated)
        self.progress.advance(1, batch=run.batch, loss=loss, samples_per_s=rate)
        if (agreed is not None and agreed.save) or plan.saves_at(run.step):
            with self._off_the_clock():
                self._save()
        return agreed

    def _end_epoch(self, plan: RunPlan) -> Agreement | None:
        """The epoch's last step boundary: its record and evaluation, the step's log, the save;
        the agreement if it stops the run, else None."""
        run = self.state
        sent = run.requests.collect(everything=True)
        agreed = run.requests.agree([*run.epoch_loss, *self.log.window.sums()])
        total, count = agreed.sums[:2]
        agreed = agreed if sent is None else sent.then(agreed)
        record: dict[str, Any] = {"epoch": run.epoch + 1, "step": run.step}
        record["train_loss"] = total / count
        evaluated = self.evaluate() if self.eval_loader is not None else {}
        record.update(evaluated)
        seconds = run.epoch_seconds
        record["samples_per_s"] = count / seconds if seconds > 0 else None
        record["epoch_s"] = seconds
        record["elapsed_s"] = run.elapsed_seconds()
        self._log_step(plan, agreed, evaluated)
        self.progress.advance(
            1, batch=run.batch, loss=record["train_loss"], samples_per_s=record["samples_per_s"]
        )
        run.end_epoch(record)
        if self.scheduler is not None and self.scheduler_interval == "epoch":
            self.scheduler.step()
        if self.world.is_main:
            write_metrics(self.run_dir, run.history)
            self.progress.write(epoch_line(record))
        finished = plan.finished(epoch=run.epoch, step=run.step)
        if agreed.save or plan.saves_at(run.step) or plan.saves_after_epoch(run.epoch) or finished:
            self._save()
        return agreed if agreed.stop else None

    def _log_step(
        self,
        plan: RunPlan,
        agreed: Agreement | None,
        evaluated: dict[str, Any],
    ) -> None:
        """The step's record, if the plan logs it, with the evaluation's results if any."""
        run = self.state
        epoch = run.epoch + run.batch / len(self.loaders.train)  # epochs done, a fraction
        record: dict[str, Any] = {}
        if plan.logs_at(run.step):
            assert agreed is not None, "the plan agrees at every log step"
            record = self.log.window.record(
                agreed.sums[2:],
                epoch=epoch,
                lr=self._lr,
                grad_norm=self.last_grad_norm,
                skipped_steps=self.skipped_steps if self._scaler_state is not None else None,
                elapsed_s=run.elapsed_seconds(),
            )
            self.log.window.reset()  # every rank: the next record's steps start here
        if evaluated:
            record = {"epoch": epoch, **record, **evaluated}
        if record:
            self.log.write(record, run.step)
