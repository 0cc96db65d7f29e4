"""What a Trainer is apart from its loop: views of the run, requests, evaluation, checkpoints.

:class:`TrainerBase` is the Trainer's base class. It holds what a script reads from a Trainer
(the model as forward calls it, the optimizer, epoch, step, history, the last step's gradient
norm and metrics, the fp16 steps skipped), what a script asks of it (a checkpoint or a stop at
the next step boundary, an exact evaluation), and how the run is saved and resumed (the
checkpointer's stateful objects). The Trainer (:mod:`tandem.train.trainer`) builds the objects
these use and runs the loop.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from tandem._dist import wait_for_all
from tandem._profile import span
from tandem.checkpoint.checkpointer import Checkpointer
from tandem.doctor import trace as tracing
from tandem.parallel.engine import Engine
from tandem.parallel.fsdp.wrapper import FullyShardedDataParallel
from tandem.train.evaluation import evaluate
from tandem.train.loaders import Loaders
from tandem.train.metrics_log import Summary, write_metrics
from tandem.train.plan import RunPlan
from tandem.train.precision import ScalerState
from tandem.train.run_state import RunState
from tandem.train.step import BatchStep, Update
from tandem.train.step_log import RunLog, SavedRun
from tandem.world import World


class TrainerBase:
    """Views of a Trainer's run, its requests, evaluation, and its checkpoints' objects.

    Example::

        trainer = tandem.Trainer(...)
        trainer.train()
        print(trainer.step, trainer.last_grad_norm, trainer.skipped_steps)
    """

    # Set by the Trainer's constructor.
    world: World
    run_dir: Path
    plan: RunPlan
    log: RunLog
    grad_accum_steps: int
    trace: Path | None
    engine: Engine
    scheduler: Any
    state: RunState
    checkpointer: Checkpointer
    loaders: Loaders
    eval_loader: DataLoader | None
    _update: Update
    _scaler_state: ScalerState | None
    _eval_step: BatchStep
    _eval_forwards: int | None

    @property
    def model(self) -> nn.Module:
        """The model as forward calls it: tandem.DDP, FSDP, or the plain module (one rank)."""
        return self.engine.model

    @property
    def module(self) -> nn.Module:
        """The user's module, unwrapped."""
        return self.engine.module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer the Trainer steps (built by the factory, if one was given)."""
        return self.engine.optimizer

    @property
    def epoch(self) -> int:
        """Epochs completed (the index of the epoch in progress)."""
        return self.state.epoch

    @property
    def step(self) -> int:
        """Optimizer steps taken."""
        return self.state.step

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the whole run: ``max_steps``, or ``max_epochs`` x the steps of an
        epoch (its batches over ``grad_accum_steps``, rounded up), whichever is fewer.

        A resumed run's total counts the steps already taken (at another world size the steps
        of an epoch change, and so does the total). See :mod:`tandem.train.plan`.

        Example::

            schedule = warmup_cosine(warmup=100, total=trainer.total_steps)
        """
        return self._total_steps(self.plan)

    def _total_steps(self, plan: RunPlan) -> int:
        run = self.state
        return plan.total_steps(
            step=run.step,
            epoch=run.epoch,
            batch=run.batch,
            per_epoch=len(self.loaders.train),
            accum=self.grad_accum_steps,
        )

    @property
    def history(self) -> list[dict[str, Any]]:
        """One record per completed epoch (what ``metrics.jsonl`` holds)."""
        return self.state.history

    @property
    def last_checkpoint(self) -> Path | None:
        """The newest checkpoint this run wrote or resumed from."""
        return self.state.last_checkpoint

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps the fp16 GradScaler skipped (inf/nan gradients) in this run, resumed
        sessions included; 0 with any other precision. :attr:`step` counts them too."""
        return self._scaler_state.skipped_steps if self._scaler_state is not None else 0

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last optimizer step, before clipping (None without
        ``clip_grad_norm``); inf or nan on a step the fp16 scaler skipped."""
        return self._update.last_grad_norm

    @property
    def last_step_metrics(self) -> dict[str, float]:
        """This rank's last optimizer step: ``"loss"`` and the training step's metrics, means
        over its micro-batches weighted by their counts (not yet averaged over ranks)."""
        return self._update.last_metrics

    def elapsed_seconds(self) -> float:
        """Seconds spent in ``train()`` by this run, over all its sessions (resumes)."""
        return self.state.elapsed_seconds()

    def request_checkpoint(self) -> None:
        """Ask for a checkpoint at the next step boundary, as SIGUSR1 does (any rank may ask).

        Example::

            if step_time > limit:
                trainer.request_checkpoint()
        """
        self.state.requests.checkpoint()

    def request_stop(self) -> None:
        """Ask every rank to save and stop at the next step boundary, as SIGTERM does.

        Example::

            if time.time() > deadline:
                trainer.request_stop()
        """
        self.state.requests.stop()

    def evaluate(self) -> dict[str, float | None]:
        """Exact evaluation of ``eval_data`` over all ranks (call on every rank).

        Returns:
            ``{"eval_loss": mean loss, "eval_accuracy": accuracy or None}`` and ``eval_NAME``
            for every metric an ``eval_step`` returns, equal to one process's on the whole set
            (see :mod:`tandem.train.evaluation`).

        Example::

            metrics = trainer.evaluate()
        """
        if self.eval_loader is None:
            raise ValueError("evaluate() needs eval_data; this Trainer was built without it")
        batches = self.loaders.eval_batches(self.state.epoch)
        # Replicated engines evaluate the plain module (no collectives, so the ranks' unequal
        # shards are fine); an FSDP wrapper gathers its units in forward, in lock step.
        sharded = isinstance(self.model, FullyShardedDataParallel)
        model = self.model if sharded else self.module
        return evaluate(model, batches, self._eval_step, forwards=self._eval_forwards)

    def _summary(self, stopped_by: str | None) -> Summary:
        """What ``train()`` returns: the run so far, its last epoch's metrics."""
        run = self.state
        last = run.history[-1] if run.history else {}
        return Summary(
            epochs=run.epoch,
            steps=run.step,
            train_loss=last.get("train_loss"),
            eval_loss=last.get("eval_loss"),
            eval_accuracy=last.get("eval_accuracy"),
            stopped_by=stopped_by,
            checkpoint=run.last_checkpoint,
            history=list(run.history),
        )

    def _stateful(self) -> dict[str, Any]:
        # The scaler's entry also holds the skipped steps (see precision.ScalerState); the
        # run's, the step log's window (see step_log.SavedRun).
        run = SavedRun(self.state, self.log.window, world_size=self.world.world_size)
        return {"trainer": run, "scheduler": self.scheduler, "scaler": self._scaler_state}

    def _resume(self, resume: str | Path) -> None:
        path = self.checkpointer.resume(self.engine, self._stateful(), resume)
        if path is None:
            return
        state = self.state
        state.last_checkpoint = path
        if self.world.is_main:
            # Drop the lines of epochs after the checkpoint (a resume from an older one).
            write_metrics(self.run_dir, state.history)
            saved, now = state.saved_world_size, self.world.world_size
            moved = (
                f" (written by {saved} processes, now {now}: the rest of the epoch is dealt "
                "anew; not bitwise)"
                if saved is not None and saved != now
                else ""
            )
            print(
                f"resumed from {path}: epoch {state.epoch + 1}, batch {state.batch}, "
                f"step {state.step}{moved}",
                flush=True,
            )

    def _save(self) -> None:
        run = self.state
        with span("tandem.train.checkpoint", f"epoch {run.epoch} step {run.step}"):
            run.last_checkpoint = self.checkpointer.save(
                self.engine, self._stateful(), epoch=run.epoch, step=run.step
            )

    def _finish(self) -> None:
        """``train()`` ends: rank 0's loggers flushed and plot drawn, every rank's trace, and
        a barrier, so that every rank leaves once rank 0's files are written."""
        self.log.finish(self.state.history)
        # The barrier comes last: it carries no Python tensors. A Gloo worker thread that
        # drops the last reference to a Python tensor while the interpreter exits (a script
        # ending right after train()) aborts the process ("terminate called without an active
        # exception").
        if self.trace is not None:
            tracing.flush()  # every rank's file is written before the barrier; rank 0 merges
        wait_for_all()
        if self.trace is not None and self.world.is_main:
            tracing.merge(self.trace, os.environ.get("TORCHELASTIC_RUN_ID"))
