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

A resumed run ends bitwise where the uninterrupted run would: :mod:`tandem.train.snapshot`
says what a checkpoint holds and why each piece is needed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.data import Dataset

import tandem
from tandem.parallel.ddp import DistributedDataParallel
from tandem.parallel.fsdp import FullyShardedDataParallel
from tandem.train import snapshot
from tandem.train.collective import wait_for_all
from tandem.train.evaluation import evaluate
from tandem.train.loaders import make_loaders
from tandem.train.metrics_log import Summary, epoch_line, plot_metrics, write_metrics
from tandem.train.model_state import check_set_up, restore_engine
from tandem.train.progress import Progress
from tandem.train.requests import Agreement, Requests
from tandem.train.rng import restore_rng_state


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
            model or a :class:`tandem.ShardedOptimizer`; see :mod:`tandem.train.model_state`.

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
        check_set_up(model, optimizer, checkpoint_format, scaler)
        if eval_data is not None and len(eval_data) == 0:
            raise ValueError("eval_data is empty (len 0): there is nothing to evaluate")

        self.world = tandem.init()  # a no-op when the script already called it
        self.run_dir = Path(run_dir)
        self.loss_fn = loss_fn
        self.max_epochs = max_epochs
        self.save_every = save_every
        self.batch_size = batch_size
        self.grad_accum_steps = grad_accum_steps
        self.scheduler = scheduler
        self.scheduler_interval = scheduler_interval
        self.scaler = scaler
        self.seed = seed
        self.keep_checkpoints = keep_checkpoints
        self.check_every = check_every
        self.show_progress = progress
        self.optimizer = optimizer
        self.sharded_checkpoints = checkpoint_format == "sharded"
        snapshot.check_writable(self.run_dir, self.world.is_main)

        self.module = model.to(self.world.device)
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

        # Where the run stands; all of it goes into a checkpoint (snapshot.py).
        self.epoch = 0  # epochs completed = index of the epoch in progress
        self.step = 0  # optimizer steps taken
        self.batch = 0  # batches of the epoch in progress handed out
        self.epoch_loss = [0.0, 0]  # this rank's loss sum and sample count in the epoch
        self.epoch_seconds = 0.0  # training time of the epoch in progress
        self.elapsed = 0.0  # seconds in train(), over every session of the run
        self._clock = (time.monotonic(), 0.0)  # (start of this session, elapsed before it)
        self.history: list[dict[str, Any]] = []
        self.last_checkpoint: Path | None = None
        self._rng_to_restore: dict[str, Any] | None = None
        self._engine_to_restore: dict[str, Any] | None = None
        self._requests = Requests()
        if resume is not None:
            snapshot.resume(self, resume)

        # After loading: tandem.DDP broadcasts rank 0's parameters, which are the loaded ones.
        # A sharded model already averages its gradients.
        self.model: nn.Module = self.module
        if self.world.world_size > 1 and not isinstance(model, FullyShardedDataParallel):
            self.model = DistributedDataParallel(self.module, **(ddp_kwargs or {}))
        # The buckets the run had learnt, before the first forward would start learning anew.
        restore_engine(self.model, self._engine_to_restore)

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
        per_epoch = len(self.train_loader)
        left = max(max_epochs - self.epoch, 0) * per_epoch - self.batch
        self.progress = Progress(self.show_progress and self.world.is_main, left)
        if self._rng_to_restore is not None:
            # Restored here, not at load time: nothing between load and this point may draw.
            restore_rng_state(self._rng_to_restore)
            self._rng_to_restore = None
        self.optimizer.zero_grad()
        self._clock = (time.monotonic(), self.elapsed)
        stopped: Agreement | None = None
        with self._requests.signals():
            while self.epoch < max_epochs and stopped is None:
                stopped = self._run_epoch(self.epoch, max_epochs)
                if stopped is None:
                    agreed = self._end_epoch()
                    if agreed.save or self.epoch % self.save_every == 0 or self.epoch == max_epochs:
                        self._save()
                    stopped = agreed if agreed.stop else None
        self.elapsed = self.elapsed_seconds()
        if stopped is not None and self.world.is_main:
            print(
                f"stopped by {stopped.reason} at epoch {self.epoch + 1} step {self.step} "
                f"(batch {self.batch} of {per_epoch}); checkpoint {self.last_checkpoint}",
                flush=True,
            )
        if self.world.is_main and self.history:
            plot_metrics(self.run_dir, self.history)
        # Leave together, once rank 0's files are written, and with a barrier last: it carries
        # no Python tensors. A Gloo worker thread that drops the last reference to a Python
        # tensor while the interpreter exits (a script ending right after train()) aborts the
        # process ("terminate called without an active exception").
        wait_for_all()
        last = self.history[-1] if self.history else {}
        return Summary(
            epochs=self.epoch,
            steps=self.step,
            train_loss=last.get("train_loss"),
            eval_loss=last.get("eval_loss"),
            eval_accuracy=last.get("eval_accuracy"),
            stopped_by=stopped.reason if stopped else None,
            checkpoint=self.last_checkpoint,
            history=list(self.history),
        )

    def _run_epoch(self, epoch: int, max_epochs: int) -> Agreement | None:
        """Run what is left of ``epoch``; return the agreement that stopped it, else None."""
        self.model.train()
        per_epoch = len(self.train_loader)
        self.progress.start_epoch(epoch + 1, max_epochs, per_epoch, self.batch)
        batches = self.loaders.epoch(epoch)
        segment_start = time.monotonic()
        shown: list[float | None] = [None, None]
        try:
            while self.batch < per_epoch:
                group = min(self.grad_accum_steps, per_epoch - self.batch)
                for i in range(group):
                    inputs, targets = next(batches)
                    self._run_batch(inputs, targets, sync=i == group - 1, weight=1 / group)
                self._optimizer_step()
                self.batch += group
                # The epoch's end agrees on its own (after its evaluation): not here as well.
                if self.batch < per_epoch and self.step % self.check_every == 0:
                    seconds = self.epoch_seconds + time.monotonic() - segment_start
                    agreed = self._requests.agree(self.epoch_loss)
                    total, count = agreed.sums
                    shown = [total / count, count / seconds if seconds > 0 else None]
                    if agreed.save:
                        self.epoch_seconds, segment_start = seconds, time.monotonic()
                        self._save()
                    if agreed.stop:
                        return agreed
                self.progress.advance(group, *shown)
            return None
        finally:
            self.epoch_seconds += time.monotonic() - segment_start
            self.progress.end_epoch()

    def _run_batch(self, inputs: Any, targets: Any, *, sync: bool, weight: float) -> None:
        """Forward and backward one micro-batch; its loss counts ``weight`` of the step's."""
        inputs, targets = inputs.to(self.world.device), targets.to(self.world.device)
        with self._gradient_sync(sync):
            loss = self.loss_fn(self.model(inputs), targets)
            # The step's gradient is the mean over its micro-batches, as one big batch's.
            scaled = loss * weight
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        self.epoch_loss[0] += loss.item() * len(targets)
        self.epoch_loss[1] += len(targets)

    def _gradient_sync(self, sync: bool) -> AbstractContextManager[None]:
        # Micro-batches before a step's last sum their gradients locally: one all-reduce a step.
        if sync or not isinstance(self.model, DistributedDataParallel):
            return nullcontext()
        return self.model.no_sync()

    def _optimizer_step(self) -> None:
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad()
        if self.scheduler is not None and self.scheduler_interval == "step":
            self.scheduler.step()
        self.step += 1

    def _end_epoch(self) -> Agreement:
        """Reduce the loss, evaluate, record and print the epoch; return the requests agreed."""
        agreed = self._requests.agree(self.epoch_loss)  # the loss sums ride along
        total, count = agreed.sums
        record: dict[str, Any] = {"epoch": self.epoch + 1, "step": self.step}
        record["train_loss"] = total / count
        if self.eval_loader is not None:
            record.update(self.evaluate())
        record["samples_per_s"] = count / self.epoch_seconds if self.epoch_seconds > 0 else None
        record["epoch_s"] = self.epoch_seconds
        record["elapsed_s"] = self.elapsed_seconds()
        self.epoch, self.batch = self.epoch + 1, 0
        self.epoch_loss, self.epoch_seconds = [0.0, 0], 0.0
        if self.scheduler is not None and self.scheduler_interval == "epoch":
            self.scheduler.step()
        self.history.append(record)
        if self.world.is_main:
            write_metrics(self.run_dir, self.history)
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
        batches = self.loaders.eval_batches(self.epoch)
        return evaluate(self.module, batches, self.loss_fn, self.world.device)

    def elapsed_seconds(self) -> float:
        """Seconds spent in ``train()`` by this run, over all its sessions (resumes)."""
        start, before = self._clock
        return before + time.monotonic() - start

    def _save(self) -> None:
        self.last_checkpoint = snapshot.save(self)

    def request_checkpoint(self) -> None:
        """Ask for a checkpoint at the next step boundary, as SIGUSR1 does (any rank may ask).

        Example::

            if step_time > limit:
                trainer.request_checkpoint()
        """
        self._requests.checkpoint()

    def request_stop(self) -> None:
        """Ask every rank to save and stop at the next step boundary, as SIGTERM does.

        Example::

            if time.time() > deadline:
                trainer.request_stop()
        """
        self._requests.stop()
