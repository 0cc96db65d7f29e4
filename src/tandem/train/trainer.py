"""Trainer: the guides' training loop, from one process to many nodes, resuming exactly.

The loop, as its steps::

    train()                                   every rank, in lock step
      for each epoch left:
        _run_epoch(epoch)                     sampler.set_epoch(epoch), then per optimizer step:
          _run_batch(x, y) x grad_accum_steps   forward, backward (no_sync but the last)
          _optimizer_step()                     step, zero_grad, scheduler (per step)
          agree on requests                     one tiny all-reduce; save / stop if asked
        _end_epoch()                          loss over ranks, exact evaluation, metrics files
        save every `save_every` epochs        rank 0 writes, after gathering every rank's RNG

The Trainer talks to the model's engine only through :class:`tandem.parallel.engine.Engine`
(sync, clip, save, load), keeps where the run stands in one
:class:`tandem.train.run_state.RunState`, and hands both to the
:class:`tandem.train.checkpointer.Checkpointer`. A resumed run ends bitwise where the
uninterrupted run would: :mod:`tandem.train.run_state` says which pieces that takes and why.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sized
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Literal, cast

import torch
from torch import nn
from torch.utils.data import Dataset

import tandem
from tandem.parallel.engine import make_engine
from tandem.train.checkpointer import Checkpointer, check_writable
from tandem.train.collective import wait_for_all
from tandem.train.evaluation import evaluate
from tandem.train.loaders import make_loaders
from tandem.train.metrics_log import Summary, epoch_line, plot_metrics, write_metrics
from tandem.train.progress import Progress
from tandem.train.requests import Agreement
from tandem.train.run_state import RunState


class Trainer:
    """Train a model data-parallel: the same script on one process, one machine or many nodes.

    Calls ``tandem.init()`` (nothing happens if the script already has). With more than one
    rank the model is wrapped in :class:`tandem.DDP` (kept plain with one).
    Training data goes through a :class:`tandem.data.DistributedSampler` (``set_epoch`` is
    called for you), evaluation through the exact :class:`tandem.data.EvalSampler` and
    :mod:`tandem.metrics`, so reported metrics equal one process's. Rank 0 prints a line per
    epoch (``epoch   E  loss L  test accuracy A``), draws a progress bar, and writes
    ``run_dir/metrics.jsonl``, ``run_dir/metrics.png`` and the checkpoints.

    Checkpoints are written every ``save_every`` epochs, at the end of training, and at the next
    step boundary after SIGTERM (then ``train()`` returns, ``stopped_by="SIGTERM"``) or SIGUSR1
    (training goes on), all ranks agreeing on the step first. The newest ``keep_checkpoints``
    are kept. ``resume="latest"`` continues from the newest one, if there is one: model,
    optimizer, scheduler, grad scaler, epoch, step, the sampler's place in the epoch, every
    rank's RNG states and tandem.DDP's bucket order, so the run ends bitwise where the
    uninterrupted run would.

    Batches are ``(inputs, targets)``; ``loss_fn(model(inputs), targets)`` is the batch's mean
    loss. Evaluation reports the mean loss and, when outputs are class scores for integer
    targets, the accuracy.

    Data loading: ``num_workers=0`` by default, which keeps every draw in this process's saved
    generators. With workers, their seeds derive from (``seed``, epoch, rank, worker) only,
    and a random transform repeats after a mid-epoch resume only if it is seeded per sample
    (see :mod:`tandem.train.loaders`).

    Args:
        model: the model (moved to ``tandem.world().device``).
        optimizer: an optimizer over ``model``'s parameters.
        train_data: training data set of ``(inputs, targets)`` items.
        loss_fn: ``loss_fn(outputs, targets) -> scalar`` mean loss of a batch.
        eval_data: held-out data set evaluated after every epoch (printed as "test").
        max_epochs: epochs to train in all (a resumed run continues to this number).
        save_every: write a checkpoint every this many epochs (and after the last).
        batch_size: samples per rank per micro-batch; the global batch of one optimizer step is
            ``batch_size * world_size * grad_accum_steps``.
        run_dir: directory for checkpoints and metrics; created, and checked writable on rank 0
            before anything else happens.
        scheduler: an LR scheduler, stepped every epoch or every step (``scheduler_interval``).
        scheduler_interval: ``"epoch"`` or ``"step"``.
        grad_accum_steps: micro-batches per optimizer step (gradients summed locally, one
            all-reduce); an epoch's last step takes the micro-batches that are left.
        resume: ``None`` (start fresh), ``"latest"`` (the newest checkpoint in ``run_dir`` if
            there is one, else start fresh: the same command line starts and restarts a job),
            or the path of a checkpoint file or run directory (must exist).
        scaler: a ``torch.amp.GradScaler`` for mixed precision (the model's forward runs under
            autocast); it scales the loss, steps the optimizer, and is saved with checkpoints.
        eval_batch_size: evaluation batch size per rank (default ``batch_size``).
        seed: seed of the sampler's shuffle and of the loaders' generators.
        drop_last: the sampler cuts the data set's tail instead of padding (see
            :class:`tandem.data.DistributedSampler`).
        num_workers: DataLoader worker processes per rank (see "Data loading" above).
        keep_checkpoints: how many checkpoints to keep.
        check_every: agree on stop/save requests every this many optimizer steps (one
            all-reduce of five numbers each time), and at every epoch's end.
        progress: draw rank 0's progress bar.
        ddp_kwargs: extra arguments for :class:`tandem.DDP` (``find_unused_parameters``, ...).
        checkpoint_format: ``"full"`` (rank 0 writes one file; a sharded model and optimizer
            are gathered into a plain ``state_dict()`` that loads at any world size) or
            ``"sharded"`` (each rank also writes its own shards, nothing is gathered; loads at
            the same world size). Sharded needs a :class:`tandem.FullyShardedDataParallel`
            model or a :class:`tandem.ShardedOptimizer`; see :mod:`tandem.parallel.engine`.

    Sharded training: pass a model already wrapped in :class:`tandem.FullyShardedDataParallel`
    with an optimizer over its ``parameters()`` (it is not wrapped in DDP again), or a plain
    model with a :class:`tandem.ShardedOptimizer` (wrapped in DDP as usual).

    Raises:
        ValueError: a bad argument, a ``run_dir`` that cannot be written, or a checkpoint that
            does not fit this run (another world size, model or scheduler); raised on every rank.
        CheckpointError: the checkpoint to resume from is missing, corrupt or truncated (the
            message names it and the other checkpoints); raised on every rank.

    Example::

        tandem.init()
        trainer = Trainer(model, torch.optim.AdamW(model.parameters()), train_set,
                          loss_fn=F.cross_entropy, eval_data=test_set, max_epochs=30,
                          save_every=5, batch_size=32, run_dir="runs/exp1", resume="latest")
        summary = trainer.train()
        print(summary.eval_accuracy)
        tandem.shutdown()
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        train_data: Dataset,
        *,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        eval_data: Dataset | None = None,
        max_epochs: int,
        save_every: int,
        batch_size: int,
        run_dir: str | Path,
        scheduler: Any = None,
        scheduler_interval: Literal["epoch", "step"] = "epoch",
        grad_accum_steps: int = 1,
        resume: str | Path | None = None,
        scaler: torch.amp.GradScaler | None = None,
        eval_batch_size: int | None = None,
        seed: int = 0,
        drop_last: bool = False,
        num_workers: int = 0,
        keep_checkpoints: int = 3,
        check_every: int = 1,
        progress: bool = True,
        ddp_kwargs: dict[str, Any] | None = None,
        checkpoint_format: Literal["full", "sharded"] = "full",
    ) -> None:
        for name, value, least in (
            ("max_epochs", max_epochs, 0),
            ("save_every", save_every, 1),
            ("batch_size", batch_size, 1),
            ("grad_accum_steps", grad_accum_steps, 1),
            ("num_workers", num_workers, 0),
            ("keep_checkpoints", keep_checkpoints, 1),
            ("check_every", check_every, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        if scheduler_interval not in ("epoch", "step"):
            raise ValueError(
                f"scheduler_interval must be 'epoch' or 'step', not {scheduler_interval!r}"
            )
        if eval_data is not None and len(cast(Sized, eval_data)) == 0:
            raise ValueError("eval_data is empty (len 0): there is nothing to evaluate")

        self.world = tandem.init()  # a no-op when the script already called it
        self.run_dir = Path(run_dir)
        self.loss_fn = loss_fn
        self.max_epochs = max_epochs
        self.save_every = save_every
        self.scheduler = scheduler
        self.scheduler_interval = scheduler_interval
        self.scaler = scaler
        self.grad_accum_steps = grad_accum_steps
        self.check_every = check_every
        self.show_progress = progress
        # The model as forward calls it (tandem.DDP when world > 1), its optimizer, and how
        # they sync, clip and save: the Trainer never asks which engine it is.
        self.engine = make_engine(
            model.to(self.world.device),
            optimizer,
            ddp_kwargs=ddp_kwargs,
            checkpoint_format=checkpoint_format,
            scaler=scaler,
        )
        self.checkpointer = Checkpointer(
            self.run_dir, keep=keep_checkpoints, kind=checkpoint_format
        )
        check_writable(self.run_dir)

        self.loaders = make_loaders(
            self.world,
            train_data,
            eval_data,
            batch_size=batch_size,
            eval_batch_size=eval_batch_size or batch_size,
            seed=seed,
            drop_last=drop_last,
            num_workers=num_workers,
        )
        self.sampler = self.loaders.sampler  # its len() is this rank's samples per epoch
        self.train_loader, self.eval_loader = self.loaders.train, self.loaders.eval
        # Where the run stands; the checkpointer saves it with the engine and these objects.
        self.state = RunState(
            self.sampler,
            world_size=self.world.world_size,
            batch_size=batch_size,
            grad_accum_steps=grad_accum_steps,
        )
        if resume is not None:
            self._resume(resume)

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
    def history(self) -> list[dict[str, Any]]:
        """One record per completed epoch (what ``metrics.jsonl`` holds)."""
        return self.state.history

    @property
    def last_checkpoint(self) -> Path | None:
        """The newest checkpoint this run wrote or resumed from."""
        return self.state.last_checkpoint

    def _stateful(self) -> dict[str, Any]:
        return {"trainer": self.state, "scheduler": self.scheduler, "scaler": self.scaler}

    def _resume(self, resume: str | Path) -> None:
        path = self.checkpointer.resume(self.engine, self._stateful(), resume)
        if path is None:
            return
        state = self.state
        state.last_checkpoint = path
        if self.world.is_main:
            # Drop the lines of epochs after the checkpoint (a resume from an older one).
            write_metrics(self.run_dir, state.history)
            print(
                f"resumed from {path}: epoch {state.epoch + 1}, batch {state.batch}, "
                f"step {state.step}",
                flush=True,
            )

    def train(self, max_epochs: int | None = None) -> Summary:
        """Train until ``max_epochs`` (default: the constructor's), or a stop request.

        Call on every rank. Returns early, after saving, when SIGTERM arrives or
        :meth:`request_stop` is called on any rank.

        Args:
            max_epochs: overrides the constructor's ``max_epochs`` for this call.

        Example::

            summary = trainer.train()
            if summary.stopped_by:  # preempted: the job can exit, a restart resumes
                sys.exit(0)
        """
        max_epochs = self.max_epochs if max_epochs is None else max_epochs
        run = self.state
        per_epoch = len(self.train_loader)
        left = max(max_epochs - run.epoch, 0) * per_epoch - run.batch
        self.progress = Progress(self.show_progress and self.world.is_main, left)
        run.restore_rng()  # here, not at load time: nothing between load and this may draw
        self.optimizer.zero_grad()
        run.start_session()
        stopped: Agreement | None = None
        with run.requests.signals():
            while run.epoch < max_epochs and stopped is None:
                stopped = self._run_epoch(run.epoch, max_epochs)
                if stopped is None:
                    agreed = self._end_epoch()
                    if agreed.save or run.epoch % self.save_every == 0 or run.epoch == max_epochs:
                        self._save()
                    stopped = agreed if agreed.stop else None
        run.end_session()
        if stopped is not None and self.world.is_main:
            print(
                f"stopped by {stopped.reason} at epoch {run.epoch + 1} step {run.step} "
                f"(batch {run.batch} of {per_epoch}); checkpoint {run.last_checkpoint}",
                flush=True,
            )
        if self.world.is_main and run.history:
            try:
                plot_metrics(self.run_dir, run.history)
            except ImportError as e:  # the run is done: a missing extra must not fail it
                warnings.warn(f"{self.run_dir / 'metrics.png'} not drawn: {e}", stacklevel=2)
        # Leave together, once rank 0's files are written, and with a barrier last: it carries
        # no Python tensors. A Gloo worker thread that drops the last reference to a Python
        # tensor while the interpreter exits (a script ending right after train()) aborts the
        # process ("terminate called without an active exception").
        wait_for_all()
        last = run.history[-1] if run.history else {}
        return Summary(
            epochs=run.epoch,
            steps=run.step,
            train_loss=last.get("train_loss"),
            eval_loss=last.get("eval_loss"),
            eval_accuracy=last.get("eval_accuracy"),
            stopped_by=stopped.reason if stopped else None,
            checkpoint=run.last_checkpoint,
            history=list(run.history),
        )

    def _run_epoch(self, epoch: int, max_epochs: int) -> Agreement | None:
        """Run what is left of ``epoch``; return the agreement that stopped it, else None."""
        run = self.state
        self.model.train()
        per_epoch = len(self.train_loader)
        self.progress.start_epoch(epoch + 1, max_epochs, per_epoch, run.batch)
        batches = self.loaders.epoch(epoch)
        segment_start = time.monotonic()
        shown: list[float | None] = [None, None]
        try:
            while run.batch < per_epoch:
                group = min(self.grad_accum_steps, per_epoch - run.batch)
                for i in range(group):
                    inputs, targets = next(batches)
                    self._run_batch(inputs, targets, sync=i == group - 1, weight=1 / group)
                self._optimizer_step()
                run.batch += group
                # The epoch's end agrees on its own (after its evaluation): not here as well.
                if run.batch < per_epoch and run.step % self.check_every == 0:
                    seconds = run.epoch_seconds + time.monotonic() - segment_start
                    agreed = run.requests.agree(run.epoch_loss)
                    total, count = agreed.sums
                    shown = [total / count, count / seconds if seconds > 0 else None]
                    if agreed.save:
                        run.epoch_seconds, segment_start = seconds, time.monotonic()
                        self._save()
                    if agreed.stop:
                        return agreed
                self.progress.advance(group, *shown)
            return None
        finally:
            run.epoch_seconds += time.monotonic() - segment_start
            self.progress.end_epoch()

    def _run_batch(self, inputs: Any, targets: Any, *, sync: bool, weight: float) -> None:
        """Forward and backward one micro-batch; its loss counts ``weight`` of the step's."""
        inputs, targets = inputs.to(self.world.device), targets.to(self.world.device)
        # Micro-batches before a step's last sum their gradients locally: one all-reduce a step.
        with nullcontext() if sync else self.engine.no_sync():
            loss = self.loss_fn(self.model(inputs), targets)
            # The step's gradient is the mean over its micro-batches, as one big batch's.
            scaled = loss * weight
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        self.state.epoch_loss[0] += loss.item() * len(targets)
        self.state.epoch_loss[1] += len(targets)

    def _optimizer_step(self) -> None:
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad()
        if self.scheduler is not None and self.scheduler_interval == "step":
            self.scheduler.step()
        self.state.step += 1

    def _end_epoch(self) -> Agreement:
        """Reduce the loss, evaluate, record and print the epoch; return the requests agreed."""
        run = self.state
        agreed = run.requests.agree(run.epoch_loss)  # the loss sums ride along
        total, count = agreed.sums
        record: dict[str, Any] = {"epoch": run.epoch + 1, "step": run.step}
        record["train_loss"] = total / count
        if self.eval_loader is not None:
            record.update(self.evaluate())
        record["samples_per_s"] = count / run.epoch_seconds if run.epoch_seconds > 0 else None
        record["epoch_s"] = run.epoch_seconds
        record["elapsed_s"] = run.elapsed_seconds()
        run.end_epoch(record)
        if self.scheduler is not None and self.scheduler_interval == "epoch":
            self.scheduler.step()
        if self.world.is_main:
            write_metrics(self.run_dir, run.history)
            print(epoch_line(record), flush=True)
        return agreed

    def evaluate(self) -> dict[str, float | None]:
        """Exact evaluation of ``eval_data`` over all ranks (call on every rank).

        Returns:
            ``{"eval_loss": mean loss, "eval_accuracy": accuracy or None}``, equal to one
            process's on the whole set (see :mod:`tandem.train.evaluation`).

        Example::

            metrics = trainer.evaluate()
        """
        if self.eval_loader is None:
            raise ValueError("evaluate() needs eval_data; this Trainer was built without it")
        batches = self.loaders.eval_batches(self.state.epoch)
        return evaluate(self.module, batches, self.loss_fn, self.world.device)

    def elapsed_seconds(self) -> float:
        """Seconds spent in ``train()`` by this run, over all its sessions (resumes)."""
        return self.state.elapsed_seconds()

    def _save(self) -> None:
        run = self.state
        run.last_checkpoint = self.checkpointer.save(
            self.engine, self._stateful(), epoch=run.epoch, step=run.step
        )

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
