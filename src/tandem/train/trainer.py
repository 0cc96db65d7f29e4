"""Trainer: the guides' training loop, from one process to many nodes, resuming exactly.

The loop, as its steps::

    train()                                   every rank, in lock step, until max_epochs or
      for each epoch left:                    max_steps (the first reached; plan.py)
        _run_epoch(plan)                      sampler.set_epoch(epoch), then per optimizer step:
          _run_batch(batch) x grad_accum_steps  step.BatchStep: move, forward + loss under
                                                the precision; backward (no_sync but the last)
          _optimizer_step()                     step.Update: unscale, clip, step, zero_grad;
                                                the scheduler (per step)
          _step_boundary()                      agree (requests, loss sums), evaluate, log,
                                                save, stop: each when the plan says
        _end_epoch()                          the same at the epoch's last step, with the
                                              epoch's record, its evaluation, metrics files

The per-batch step (precision, scaler, clipping, any batch structure) is
:mod:`tandem.train.step`; the arguments' checks and the optimizer and scheduler factories
:mod:`tandem.train.arguments`. The Trainer talks to the model's engine only through
:class:`tandem.parallel.engine.Engine` (sync, clip, save, load), keeps where the run stands in one
:class:`tandem.train.run_state.RunState`, and hands both to the
:class:`tandem.checkpoint.checkpointer.Checkpointer`. A resumed run ends bitwise where the
uninterrupted run would: :mod:`tandem.train.run_state` says which pieces that takes and why.

The whole class is here, in three parts: the constructor and the loop; what a script reads
from a Trainer and asks of it (views of the run, ``request_checkpoint``, ``request_stop``,
``evaluate``); and what happens between two optimizer steps (agree, evaluate, log, save, in the
plan's order, everything before the step's checkpoint, so a resumed run does exactly what the
uninterrupted one did after it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence, Sized
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Literal, cast

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from tandem._dist import wait_for_all
from tandem._profile import span
from tandem.checkpoint.checkpointer import Checkpointer, check_writable
from tandem.doctor import records, step_clock
from tandem.doctor import trace as tracing
from tandem.job.join import replacing
from tandem.parallel.adapters import model_state
from tandem.parallel.engine import Engine, ReplicatedEngine, make_engine
from tandem.recovery import MembershipError
from tandem.train import arguments
from tandem.train.arguments import OptimizerArg, SchedulerArg
from tandem.train.evaluation import evaluate, lockstep_forwards
from tandem.train.in_memory import InMemory
from tandem.train.loaders import Loaders, make_loaders
from tandem.train.loggers import LoggerArg, check_loggers
from tandem.train.metrics_log import Summary, epoch_line, write_metrics
from tandem.train.plan import RunPlan
from tandem.train.precision import ScalerState, resolve_precision
from tandem.train.progress import Progress
from tandem.train.run_state import RunState
from tandem.train.step import BatchStep, StepFn, Update, check_clip, make_steps
from tandem.train.step_log import RunLog, SavedRun, lr_of
from tandem.train.stop_and_save import Decision, Requests
from tandem.world import World, init, world

PrecisionName = Literal["32-true", "bf16-mixed", "fp16-mixed", "bf16-true"]


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


class Trainer:
    """Train a model data-parallel: the same script on one process, one machine or many nodes.

    Calls ``tandem.init()`` (nothing happens if the script already has). With more than one
    rank the model is wrapped in :class:`tandem.DDP` (kept plain with one); a model wrapped in
    :class:`tandem.FullyShardedDataParallel` is taken as it is, and a
    :class:`tandem.ShardedOptimizer` works as any optimizer. Training data goes through a
    :class:`tandem.data.DistributedSampler` (``set_epoch`` is called for you), evaluation
    through the exact :class:`tandem.data.EvalSampler` and :mod:`tandem.metrics`, so reported
    metrics equal one process's. Rank 0 prints a line per epoch, draws a bar of the run's
    optimizer steps (:attr:`total_steps`), logs a record every ``log_every`` steps to the
    ``loggers``, and writes ``run_dir/metrics.jsonl`` (per epoch), ``metrics.png`` and the
    checkpoints.

    A run lasts ``max_epochs`` epochs or ``max_steps`` optimizer steps, whichever comes first
    (it may end in the middle of an epoch). Checkpoints are written every ``save_every`` epochs
    and every ``save_every_steps`` steps, at the end of training, and at the next
    step boundary after SIGTERM (then ``train()`` returns, ``stopped_by="SIGTERM"``) or SIGUSR1
    (training goes on), all ranks agreeing on the step first. ``resume="latest"`` continues from
    the newest one: model, optimizer, scheduler, grad scaler, epoch, step, the sampler's place,
    every rank's RNG states and tandem.DDP's bucket order, so the run ends bitwise where the
    uninterrupted run would. Under ``tandem run --recover in-memory`` a lost rank costs the step
    in flight, not the run: the others go on at the smaller size from the state they hold, as
    if resumed from a checkpoint of the last step (:mod:`tandem.train.in_memory`); with
    ``--max-restarts`` the launcher's replacement is admitted at a step boundary and handed the
    run by the others (its ``resume`` is not read).

    Batches: by default ``(inputs, targets)``, and ``loss_fn(model(inputs), targets)`` is the
    batch's mean loss (evaluation adds the accuracy when outputs are class scores for integer
    targets). Any other structure (dicts, tuples of any length, namedtuples, dataclasses,
    objects with a ``to`` method) is moved to the device whole and given to ``training_step``.
    A batch weighs its count in the epoch's loss, in samples/s and in evaluation's averages:
    the leading dimension of its first tensor, or the ``"count"`` the step returns (the tokens
    a loss is the mean over). See :mod:`tandem.train.step`.

    Args:
        model: the model (moved to ``tandem.world().device``).
        optimizer: an optimizer over ``model``'s parameters, or a factory ``params ->
            optimizer`` called with them (an FSDP model's: its shards) once the model is on its
            device and in its precision (:mod:`tandem.train.arguments`).
        train_data: training data set.
        loss_fn: ``loss_fn(outputs, targets) -> scalar`` mean loss of an ``(inputs, targets)``
            batch (the default step); needed unless ``training_step`` is given.
        eval_data: held-out data set evaluated after every epoch (printed as "test") and every
            ``eval_every`` steps.
        max_epochs: epochs to train in all (a resumed run continues to this number); None:
            no limit, ``max_steps`` ends the run. One of the two is needed.
        max_steps: optimizer steps to train in all, or None (:mod:`tandem.train.plan`).
        save_every: write a checkpoint every this many epochs; None: every epoch, unless
            ``save_every_steps`` is given. The end of the run is always saved.
        save_every_steps: write a checkpoint every this many optimizer steps, or None.
        eval_every: evaluate every this many optimizer steps too (results to the loggers).
        log_every: a step log record every this many optimizer steps: loss (over all ranks and
            the steps since the last record), lr, grad norm (with ``clip_grad_norm``),
            samples/s, tokens/s (if the step returns ``"tokens"``), fp16's skipped steps
            (:mod:`tandem.train.step_log`); None: no records.
        loggers: where records and evaluations go, on rank 0: ``"csv"``, ``"jsonl"`` (files
            ``steps.csv``, ``steps.jsonl`` in ``run_dir``), ``"tensorboard"`` (``run_dir/
            tensorboard``; ``tandem[tensorboard]``), objects with ``log_metrics(metrics,
            step)`` (:mod:`tandem.train.loggers`). Default ``["csv", "jsonl"]``; a resumed
            run appends from its checkpoint's step.
        batch_size: samples per rank per micro-batch; the global batch of one optimizer step is
            ``batch_size * world_size * grad_accum_steps``.
        run_dir: directory for checkpoints and metrics (created; checked writable at once).
        scheduler: an LR scheduler, or a factory ``optimizer -> scheduler``; stepped every epoch
            or every optimizer step (``scheduler_interval``: ``"epoch"`` or ``"step"``).
        grad_accum_steps: micro-batches per optimizer step (gradients summed locally, one
            all-reduce); an epoch's last step takes the micro-batches that are left.
        resume: ``None`` (start fresh), ``"latest"`` (the newest checkpoint in ``run_dir``, if
            any: one command line starts and restarts a job), or a checkpoint or run directory.
            At the same world size the resumed run ends bitwise where the uninterrupted one
            would; at another (a 2-process run continued on 1, 3 or 4) the rest of the epoch is
            dealt anew to the new ranks, none repeated or skipped, but sums are taken in
            another order and batches composed differently, so it cannot be bitwise.
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"fp16-mixed"`` or ``"bf16-true"``
            (:mod:`tandem.train.precision`). Mixed: forward and loss under ``torch.autocast``
            on the run's device (evaluation too); fp16 with a GradScaler made for you, saved
            with checkpoints, its skipped steps counted (:attr:`skipped_steps`). bf16-true:
            floating parameters, buffers and batch tensors in bfloat16. With an FSDP model
            built without a ``mixed_precision`` policy, a mixed precision also gathers the
            parameters and reduces the gradients in its low dtype (float32 shards and
            optimizer state; Lightning's FSDP precision), and fp16's scaler is torch's
            ``ShardedGradScaler``, which agrees across ranks on skipping a step. Default
            ``"32-true"``, or ``"fp16-mixed"`` when ``scaler`` is given.
        scaler: your own ``torch.amp.GradScaler`` for ``"fp16-mixed"`` (another
            ``init_scale``, say; a ``ShardedGradScaler`` with an FSDP model); with any other
            precision a ValueError.
        clip_grad_norm: before every optimizer step, clip the gradient to this norm over all
            parameters of all ranks and shards (after unscaling under fp16), as
            ``torch.nn.utils.clip_grad_norm_`` on one process; see :attr:`last_grad_norm`.
        training_step: ``training_step(model, batch) -> loss | dict`` with ``"loss"`` (other
            entries are metrics, ``"count"`` the batch's weight); ``model`` as forward must call
            it (tandem.DDP, FSDP), ``batch`` on the device. Replaces the default step.
        eval_step: the same for evaluation (no grad; ``model`` the plain module, or the FSDP
            wrapper); metrics are reported as ``eval_NAME``, averaged exactly over the set.
            Default: the default step with ``loss_fn``, else ``training_step``.
        eval_batch_size: evaluation batch size per rank (default ``batch_size``).
        seed: seed of the sampler's shuffle and of the loaders' generators.
        drop_last: the sampler cuts the data set's tail instead of padding the ranks' shares.
        num_workers: DataLoader worker processes per rank; 0 keeps every draw in this process's
            saved generators (with workers, see :mod:`tandem.train.loaders`).
        collate_fn: makes a batch of a list of samples (both loaders), as a DataLoader's.
        keep_checkpoints: how many checkpoints to keep.
        check_every: agree on stop/save requests every this many optimizer steps, besides
            every log step and every epoch's end. With tandem.DDP the requests ride in the
            engine's own end-of-backward check every step (this setting then does not
            matter); otherwise one small all-reduce is sent in the background. Either way the
            result is read at the next step boundary: a SIGTERM/SIGUSR1 or request during step
            k is acted on after step k + 1, on every rank alike.
        progress: draw rank 0's progress bar (periodic lines off a terminal).
        ddp_kwargs: extra arguments for :class:`tandem.DDP` (``find_unused_parameters``, ...).
        checkpoint_format: ``"full"`` (rank 0 writes one file, gathered, loadable at any world
            size) or ``"sharded"`` (each rank also writes its own shards, resharded on a resume at
            another world size, which needs every rank's shard files visible, e.g. a shared
            file system; needs an FSDP model or a ShardedOptimizer); see
            :mod:`tandem.parallel.engine`.
        checkpoint_async: write checkpoints in the background: a save holds the loop only
            while the state is copied to host memory (one copy, reused between saves); the
            next save, and the end of ``train()`` (SIGTERM's included), wait for the write in
            flight, and raise its error on every rank (:mod:`tandem.checkpoint.async_save`).
        trace: a directory for every rank's timeline, merged into a Chrome ``trace.json`` at
            the end of ``train()`` (:mod:`tandem.doctor.trace`).

    Raises:
        ValueError: a bad argument (an unknown precision, ``clip_grad_norm <= 0``, neither
            ``max_epochs`` nor ``max_steps``, an optimizer factory over other parameters,
            ...), a ``run_dir`` that cannot be written, or a
            checkpoint that does not fit this run; on every rank, before the first step. At the
            first step: a batch the default step cannot split, a step that returns no loss.
        CheckpointError: the checkpoint to resume from is missing, corrupt or truncated
            (named, with the other checkpoints); raised on every rank.

    Example::

        tandem.init()
        trainer = Trainer(model, lambda params: torch.optim.AdamW(params, lr=3e-4), train_set,
                          loss_fn=F.cross_entropy, eval_data=test_set, max_steps=5000,
                          eval_every=500, save_every_steps=1000, batch_size=32,
                          run_dir="runs/exp1", resume="latest", precision="bf16-mixed",
                          clip_grad_norm=1.0, loggers=["csv", "jsonl", "tensorboard"])
        summary = trainer.train()
        tandem.shutdown()
    """

    # Set by the constructor, and by train().
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
    progress: Progress
    scheduler_interval: str
    _lr: float | None
    _segment_start: float  # when the epoch's clock last counted (monotonic)

    @records.members_sequence  # a replacement's constructor meets the members' admission
    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerArg,
        train_data: Dataset,
        *,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        eval_data: Dataset | None = None,
        max_epochs: int | None = None,
        max_steps: int | None = None,
        save_every: int | None = None,
        save_every_steps: int | None = None,
        eval_every: int | None = None,
        log_every: int | None = 10,
        loggers: Sequence[LoggerArg] | None = None,
        batch_size: int,
        run_dir: str | Path,
        scheduler: SchedulerArg = None,
        scheduler_interval: Literal["epoch", "step"] = "epoch",
        grad_accum_steps: int = 1,
        resume: str | Path | None = None,
        precision: PrecisionName | None = None,
        scaler: torch.amp.GradScaler | None = None,
        clip_grad_norm: float | None = None,
        training_step: StepFn | None = None,
        eval_step: StepFn | None = None,
        eval_batch_size: int | None = None,
        seed: int = 0,
        drop_last: bool = False,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        keep_checkpoints: int = 3,
        check_every: int = 1,
        progress: bool = True,
        ddp_kwargs: dict[str, Any] | None = None,
        checkpoint_format: Literal["full", "sharded"] = "full",
        checkpoint_async: bool = False,
        trace: str | Path | None = None,
    ) -> None:
        # Checks that need no process group first: the same verdict on every rank, at once.
        self.plan = RunPlan.from_args(
            max_epochs=max_epochs,
            max_steps=max_steps,
            save_every=save_every,
            save_every_steps=save_every_steps,
            eval_every=eval_every,
            log_every=log_every,
            check_every=check_every,
        )
        arguments.check_counts(
            batch_size=(batch_size, 1),
            grad_accum_steps=(grad_accum_steps, 1),
            num_workers=(num_workers, 0),
            keep_checkpoints=(keep_checkpoints, 1),
        )
        arguments.check_choices(scheduler_interval=(scheduler_interval, ("epoch", "step")))
        if eval_data is not None and len(cast(Sized, eval_data)) == 0:
            raise ValueError("eval_data is empty (len 0): there is nothing to evaluate")
        if eval_every is not None and eval_data is None:
            raise ValueError(f"eval_every={eval_every!r} needs eval_data: there is nothing to "
                             "evaluate")  # fmt: skip
        logger_args = check_loggers(loggers)
        arguments.check_callables(optimizer, scheduler, loss_fn, training_step, eval_step)
        self.clip_grad_norm = check_clip(clip_grad_norm)

        self.world = init()  # a no-op when the script already called it
        mode, scaler = resolve_precision(precision, scaler, model, self.world.device)
        self.trace = tracing.start(trace) if trace is not None else None
        self._steps = step_clock.clock("tandem.Trainer optimizer steps", priority=0)
        self.run_dir = Path(run_dir)
        self.loss_fn = loss_fn
        self.scheduler_interval = scheduler_interval
        self.scaler = scaler
        self._scaler_state = ScalerState(scaler) if scaler is not None else None
        self.grad_accum_steps = grad_accum_steps
        self.show_progress = progress
        # On its device and in its precision before the optimizer is built over it and the
        # engine lays out its buckets for its dtype.
        model = model.to(self.world.device)
        mode.convert_module(model)
        # The model as forward calls it (tandem.DDP when world > 1), its optimizer, and how
        # they sync, clip and save: the Trainer never asks which engine it is.
        self._wraps_itself = model_state(model).target is model  # a plain module
        self._engine_args: dict[str, Any] = dict(
            ddp_kwargs=ddp_kwargs, checkpoint_format=checkpoint_format, scaler=scaler
        )
        self.engine = make_engine(
            model, arguments.build_optimizer(optimizer, model), **self._engine_args
        )
        self.scheduler = arguments.build_scheduler(scheduler, self.engine.optimizer)
        self.precision = mode.name
        self._train_step, self._eval_step = make_steps(
            training_step, eval_step, loss_fn, mode, self.world.device
        )
        self._update = Update(self.engine, self._scaler_state, self.clip_grad_norm)
        self.checkpointer = Checkpointer(
            self.run_dir, keep=keep_checkpoints, kind=checkpoint_format, async_=checkpoint_async
        )
        check_writable(self.run_dir)

        self._data = (train_data, eval_data)
        self._loader_args: dict[str, Any] = dict(
            batch_size=batch_size,
            eval_batch_size=eval_batch_size or batch_size,
            seed=seed,
            drop_last=drop_last,
            num_workers=num_workers,
            collate_fn=collate_fn,
        )
        self._make_loaders_and_state(Requests())
        self.log = RunLog(self.run_dir, logger_args, main=self.world.is_main)
        self._lr: float | None = None  # of the last optimizer step, for the step log
        if resume is not None and not replacing():  # a replacement's run comes from the members
            self._resume(resume)
        self.log.open(start_step=self.state.step)  # a resumed run's logs cut back to its step
        # Under `tandem run --recover in-memory`: a lost rank costs the step, not the run.
        self._in_memory = InMemory(self)

    def _make_loaders_and_state(self, requests: Requests) -> None:
        """What depends on the world's size and this rank's place in it, beside the engine:
        the loaders (the sampler deals the data by rank), the run state, and the requests
        riding in the engine's collective."""
        train_data, eval_data = self._data
        self.loaders = make_loaders(self.world, train_data, eval_data, **self._loader_args)
        self.sampler = self.loaders.sampler  # its len() is this rank's samples per epoch
        self.train_loader, self.eval_loader = self.loaders.train, self.loaders.eval
        self._eval_forwards = lockstep_forwards(
            self.model, eval_data, self._loader_args["eval_batch_size"]
        )
        # Where the run stands; the checkpointer saves it with the engine and these objects.
        self.state = RunState(
            self.sampler,
            world_size=self.world.world_size,
            batch_size=self._loader_args["batch_size"],
            grad_accum_steps=self.grad_accum_steps,
        )
        self.state.requests = requests
        # Stop and checkpoint requests ride in the engine's own per-step all-reduce where it
        # has one (tandem.DDP): no collective of their own between log steps.
        requests.riding = self.engine.carry(requests)

    def _release_world(self) -> None:
        """Recovery in memory: let go of everything of the old group (tandem.DDP's hooks and
        its wrapper, a request's collective in flight), before the group is taken down."""
        reducer = self.engine.model_state.reducer
        if reducer is not None:
            reducer.release()
        self.state.requests.discard()
        self.checkpointer.abandon()  # a save in the background reports over the old group
        plain = ReplicatedEngine(self.module, self.module, self.optimizer)
        self.engine, self._update = plain, Update(plain, self._scaler_state, self.clip_grad_norm)

    def _build_world(self, log_from: int) -> None:
        """Recovery in memory: the group was re-formed (or grew); build what depends on it anew
        (the state is loaded by :class:`tandem.train.in_memory.InMemory`); the step log keeps
        its records up to step ``log_from``. Its collectives are the constructor's, in its
        order: an admitted replacement's constructor meets them."""
        self.world = world()
        module, optimizer = self.module, self.optimizer
        self.engine = make_engine(module, optimizer, **self._engine_args)
        self._update = Update(self.engine, self._scaler_state, self.clip_grad_norm)
        self.checkpointer.rank = self.world.rank
        check_writable(self.run_dir)  # rank 0 may be another process now
        self._make_loaders_and_state(self.state.requests)
        self.log.reopen(main=self.world.is_main, start_step=log_from)

    def train(self, max_epochs: int | None = None, max_steps: int | None = None) -> Summary:
        """Train until ``max_epochs`` or ``max_steps`` (default: the constructor's), or a stop.

        Call on every rank. Returns early, after saving, when SIGTERM arrives or
        :meth:`request_stop` is called on any rank.

        Args:
            max_epochs: overrides the constructor's ``max_epochs`` for this call.
            max_steps: overrides the constructor's ``max_steps`` for this call.

        Example::

            summary = trainer.train()
            if summary.stopped_by:  # preempted: the job can exit, a restart resumes
                sys.exit(0)
        """
        plan = self.plan.limited(max_epochs, max_steps)
        run = self.state
        shown = self.show_progress and self.world.is_main
        self.progress = Progress(shown, self._total_steps(plan), done=run.step)
        run.restore_rng()  # here, not at load time: nothing between load and this may draw
        self.optimizer.zero_grad()
        run.start_session()
        run.requests.discard()  # one an earlier train() sent before it raised
        records.training_started()  # a replacement makes the members' collectives from here
        stopped: Decision | None = None
        # True for a replacement handed the run within a re-form: the boundary of the step the
        # members went back to comes first, as theirs does.
        redo = self._in_memory.begin(self)
        run = self.state  # built anew if a loss in the start's commit was recovered
        with run.requests.signals():
            while not plan.finished(epoch=run.epoch, step=run.step) and stopped is None:
                lost = False
                try:
                    if not redo:  # after the boundary redone: _run_epoch returns for them
                        self._in_memory.admit(self)  # replacements the last commit let in
                    stopped = self._run_epoch(plan, redo_boundary=redo)
                except MembershipError:
                    raise
                except Exception as error:
                    if not self._in_memory.lost(error):
                        raise
                    lost = True
                # Outside the except block: the failed step's frames are gone.
                redo = self._in_memory.recover(self) if lost else False
                run = self.state  # built anew by a recovery or an admission
            # checkpoint_async: the save still being written is committed (or its error raised,
            # on every rank) before train() returns; signals meanwhile only set flags.
            committed = self.checkpointer.wait()
        if committed is not None and self.world.is_main:
            print(f"checkpoint {committed} committed (written in the background)", flush=True)
        run.end_session()
        self.progress.close()
        if self.world.is_main and (stopped is not None or run.batch):
            why = f"stopped by {stopped.reason}" if stopped else f"max_steps {plan.max_steps} done"
            print(
                f"{why} at epoch {run.epoch + 1} step {run.step} (batch {run.batch} of "
                f"{len(self.train_loader)}); checkpoint {run.last_checkpoint}",
                flush=True,
            )
        self._finish()
        return self._summary(stopped.reason if stopped else None)

    def _run_epoch(self, plan: RunPlan, redo_boundary: bool = False) -> Decision | None:
        """Run what is left of the epoch in progress, and its end if it gets there; return
        the agreement that stopped the run, else None. ``redo_boundary``: first the boundary
        of the last step, which a lost rank cut short (recovery in memory)."""
        run = self.state
        self.model.train()
        per_epoch = len(self.train_loader)
        self.progress.start_epoch(run.epoch + 1, plan.max_epochs, per_epoch, run.batch)
        batches = self.loaders.epoch(run.epoch)
        self._segment_start = time.monotonic()  # the epoch's clock runs (see _clock_in)
        while run.batch < per_epoch:
            if not redo_boundary:
                group = min(self.grad_accum_steps, per_epoch - run.batch)
                for i in range(group):
                    self._run_batch(next(batches), sync=i == group - 1, weight=1 / group)
                self._optimizer_step()
                run.batch += group
                self._in_memory.keep(self)
            redo_boundary = False
            if run.batch == per_epoch:
                break  # the epoch's end agrees, evaluates, logs and saves on its own
            agreed = self._step_boundary(plan)
            stop = agreed if agreed is not None and agreed.stop else None
            if stop is not None or plan.finished(epoch=run.epoch, step=run.step):
                self._clock_in()  # a stop, or max_steps in the middle of an epoch: saved
                return stop
            if self._in_memory.growing:  # replacements join here: train() admits them
                self._clock_in()
                return None
        self._clock_in()
        return self._end_epoch(plan)

    def _run_batch(self, batch: Any, *, sync: bool, weight: float) -> None:
        """Forward and backward one micro-batch; its loss counts ``weight`` of the step's."""
        # Micro-batches before a step's last sum their gradients locally: one all-reduce a step.
        with nullcontext() if sync else self.engine.no_sync():
            out = self._train_step(self.model, batch)
            # The step's gradient is the mean over its micro-batches, as one big batch's.
            loss = self._update.backward(out, weight)
        self.state.epoch_loss[0] += loss * out.count
        self.state.epoch_loss[1] += out.count
        self.log.window.add(loss, out.count, out.tokens)

    def _optimizer_step(self) -> None:
        self._lr = lr_of(self.optimizer)  # the rate this step takes, before a scheduler moves it
        self._in_memory.commit(self, self.state.step + 1)  # on every rank or none
        self._update.step()
        if self.scheduler is not None and self.scheduler_interval == "step":
            self.scheduler.step()
        self.state.step += 1
        self._in_memory.committed()
        self._steps.tick()

    # -- what a script reads from a Trainer, and asks of it ----------------------------------------

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
        return evaluate(
            self.engine.eval_model, batches, self._eval_step, forwards=self._eval_forwards
        )

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

    # -- between two optimizer steps: agree, evaluate, log, save, as planned --------------------

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

    def _step_boundary(self, plan: RunPlan) -> Decision | None:
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

    def _end_epoch(self, plan: RunPlan) -> Decision | None:
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
        agreed: Decision | None,
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
