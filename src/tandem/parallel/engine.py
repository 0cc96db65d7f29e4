"""The one contract between a training loop and the engines: sync, clip, save, load, export.

A training loop needs five things from whatever parallelises the model, and nothing else::

    engine.model                 what forward calls (tandem.DDP, FSDP, or the plain module)
    engine.no_sync()             micro-steps of gradient accumulation, without communication
    engine.clip_grad_norm_(c)    the norm of the gradient over all ranks and shards, clipped
    engine.state_dict(kind)      model + optimizer (+ the engine's own state), full or sharded
    engine.plain_weights()       the user's module's weights, whole, without wrapper prefixes

and, for the Trainer and the checkpoints, ``engine.eval_model`` (what evaluation calls) and
``engine.reshard(n, read)`` (this rank's shard cut from a run of ``n`` processes). How the
model and the optimizer are saved, checked and loaded is their adapters' (``model_state``,
``optimizer_state``: :mod:`tandem.parallel.adapters`), which the checkpoint entries use too.

Two implementations cover every set-up, and :func:`make_engine` is the one place that looks at
what it was given to choose:

============================================  ===================  ==============================
set-up                                        engine               ``"sharded"`` checkpoints
============================================  ===================  ==============================
plain module (one process)                    ReplicatedEngine     refused: nothing is sharded
tandem.DataParallel (one process, devices)    ReplicatedEngine     refused: nothing is sharded
module wrapped in tandem.DDP                  ReplicatedEngine     refused: nothing is sharded
tandem.DDP + tandem.ShardedOptimizer          ReplicatedEngine     each rank's optimizer shard
tandem.FullyShardedDataParallel (stage 2/3)   ShardedEngine        each rank's shards as they are
============================================  ===================  ==============================

The ``"full"`` kind is a plain module's and a plain optimizer's ``state_dict()`` (gathered where
sharded): it loads into the unwrapped model, and into a sharded one at any world size. The
``"sharded"`` kind never gathers: no rank holds more than its own shards. Every method that
gathers is a collective, called on every rank.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any, Literal

import torch
from torch import nn

from tandem._dist import group_size
from tandem.parallel.adapters import (
    ModelState,
    OptimizerState,
    PlainModel,
    Reader,
    ShardedModel,
    ShardOptimizer,
    check_scaler,
    optimizer_state,
)
from tandem.parallel.ddp.end_of_backward import Rider
from tandem.parallel.ddp.wrapper import DistributedDataParallel
from tandem.parallel.dp.wrapper import DataParallel
from tandem.parallel.fsdp.wrapper import FullyShardedDataParallel
from tandem.parallel.grad_norm import clip_sharded_grad_norm_

Kind = Literal["full", "sharded"]
KINDS: tuple[Kind, ...] = ("full", "sharded")


class Engine(ABC):
    """A model, its optimizer, and how they synchronise, clip and save (see the module doc).

    ``state_dict(kind)`` returns ``{"model", "optimizer", "engine", "shard"}``: the first three
    belong in the run's main checkpoint (meaningful on rank 0), ``"shard"`` is this rank's own
    file (None in the full kind). ``load_state_dict`` takes the same dict, with this rank's
    ``"shard"``, on every rank.

    Example::

        engine = make_engine(net, torch.optim.AdamW(net.parameters()))
        for i, (x, y) in enumerate(batches):
            with engine.no_sync() if i % 4 != 3 else contextlib.nullcontext():
                loss_fn(engine.model(x), y).backward()
            if i % 4 == 3:
                engine.clip_grad_norm_(1.0)
                engine.optimizer.step()
                engine.optimizer.zero_grad()
        state = engine.state_dict("full")
    """

    def __init__(
        self,
        model: nn.Module,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        model_state: ModelState,
        optimizer_state: OptimizerState,
    ) -> None:
        self.model = model  # what forward calls
        self.module = module  # the user's module, unwrapped
        self.optimizer = optimizer
        # How the model and the optimizer are saved, checked, loaded and resharded: the same
        # adapters serve tandem.checkpoint's entries (tandem.parallel.adapters).
        self.model_state = model_state
        self.optimizer_state = optimizer_state

    @property
    def has_shards(self) -> bool:
        """The set-up holds shards, so the ``"sharded"`` kind has something to write."""
        return self.model_state.sharded or self.optimizer_state.sharded

    @property
    def eval_model(self) -> nn.Module:
        """What evaluation calls: the plain module (no collectives, so the ranks' unequal
        shards of an evaluation set are fine), or the FSDP wrapper, whose forwards gather its
        units and so run on every rank in lock step."""
        return self.model_state.eval_model

    def check(self, kind: str) -> None:
        """Raise ValueError unless this set-up can write checkpoints of ``kind``."""
        if kind not in KINDS:
            raise ValueError(f"checkpoint_format must be 'full' or 'sharded', not {kind!r}")
        if kind == "sharded" and not self.has_shards:
            raise ValueError(
                "checkpoint_format='sharded' needs a tandem.FullyShardedDataParallel model or a "
                "tandem.ShardedOptimizer: this model and optimizer are replicated on every rank, "
                "so rank 0's full checkpoint already holds everything"
            )

    @abstractmethod
    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward inside this block accumulates gradients without communicating."""

    @abstractmethod
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every gradient so that their global norm is at most ``max_norm``; that norm."""

    def state_dict(self, kind: Kind = "full") -> dict[str, Any]:
        """``{"model", "optimizer", "engine", "shard"}`` (a collective; see the class doc)."""
        self.check(kind)
        model, model_shard = self.model_state.save(kind)
        optimizer, optimizer_shard = self.optimizer_state.save(kind)
        shard = {
            name: part
            for name, part in (("model", model_shard), ("optimizer", optimizer_shard))
            if part is not None
        }
        engine = self.model_state.engine_state()
        return {"model": model, "optimizer": optimizer, "engine": engine, "shard": shard or None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` gave, before the first forward (every rank)."""
        shard = state.get("shard") or {}
        self.model_state.load(state.get("model"), shard.get("model"))
        self.optimizer_state.load(state.get("optimizer"), shard.get("optimizer"))
        # A checkpoint written before engines saved theirs, or by another engine, has none.
        self.model_state.load_engine_state(state.get("engine"))

    def reshard(self, saved_world_size: int, read: Reader) -> dict[str, Any]:
        """This rank's ``"shard"``, cut from the shard files of a run of another world size.

        ``read(rank)`` returns a saved rank's shard file; only the ranks whose shards overlap
        this rank's are read. The result is what ``state_dict("sharded")`` would give here as
        ``"shard"``, so :meth:`load_state_dict` takes it unchanged: FSDP's flat shards and its
        optimizer's element-wise state cut anew; a ShardedOptimizer's state of the parameters
        this rank owns now, from their old owners.

        Raises:
            ValueError: the files do not fit this engine (another model, another set-up).

        Example::

            shard = engine.reshard(2, lambda q: read_shard(ckpt_dir, name, q, digests[q]))
            engine.load_state_dict({**main_file_parts, "shard": shard})
        """
        shard = {}
        if self.model_state.sharded:
            shard["model"] = self.model_state.reshard("the model", saved_world_size, read)
        shard["optimizer"] = self.optimizer_state.reshard("the optimizer", saved_world_size, read)
        return shard

    def carry(self, rider: Rider) -> bool:
        """Let ``rider``'s counts travel in a collective the engine issues every step anyway.

        True if the engine does (tandem.DDP: its end-of-backward check, see
        ``tandem.parallel.ddp.end_of_backward``); False: the caller sends them itself.
        """
        return False

    def plain_weights(self, to: int = 0) -> dict[str, torch.Tensor] | None:
        """The user's module's ``state_dict()``, whole, on rank ``to``; None on the others.

        A collective. The keys are the plain module's (no ``module.`` prefix): the dict loads
        into the unwrapped model.
        """
        return self.model_state.plain_weights(to)


class ReplicatedEngine(Engine):
    """Every rank holds the whole model: one process, or tandem.DDP (with a ShardedOptimizer,
    whose state is the one thing sharded).

    Gradients are whole and the same on every rank once backward has averaged them (a
    ShardedOptimizer shards its state, not the gradients), so the local norm is the global one
    and clipping is torch's own ``clip_grad_norm_``, without communication.
    """

    def __init__(
        self,
        model: nn.Module,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        reducer: Any = None,
    ) -> None:
        # tandem.DDP's bucket order (its reducer) is saved with the model, when it has one.
        super().__init__(
            model, module, optimizer, PlainModel(module, reducer), optimizer_state(optimizer)
        )

    def carry(self, rider: Rider) -> bool:
        reducer = self.model_state.reducer
        if reducer is None:
            return False
        reducer.end_of_backward.rider = rider
        return True

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        no_sync = getattr(self.model, "no_sync", None)
        return no_sync() if no_sync is not None else contextlib.nullcontext()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm, norm_type)


class ShardedEngine(Engine):
    """tandem.FullyShardedDataParallel: each rank holds a shard of parameters, gradients and
    optimizer state.

    Every micro-batch reduce-scatters its gradients into the shards (they add up there), so
    accumulation has no communication to skip; the gradient norm adds the ranks' shards.
    """

    def __init__(self, model: FullyShardedDataParallel, optimizer: torch.optim.Optimizer):
        sharded = ShardedModel(model)
        super().__init__(
            model, model.module, optimizer, sharded, ShardOptimizer(optimizer, sharded)
        )
        self._fsdp = model

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return clip_sharded_grad_norm_(
            self._fsdp.parameters(), max_norm, norm_type, self._fsdp.process_group
        )


def make_engine(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    ddp_kwargs: dict[str, Any] | None = None,
    checkpoint_format: str = "full",
    scaler: Any = None,
) -> Engine:
    """The engine for ``model`` and ``optimizer``; a plain module is wrapped in tandem.DDP when
    the job has more than one process (it stays plain with one).

    A model already wrapped (tandem.DDP or tandem.FullyShardedDataParallel) is used as it is.
    Checked first, on every rank alike: that ``checkpoint_format`` fits the set-up, and that a
    ``scaler`` fits the model (:func:`check_scaler`).

    Example::

        tandem.init()
        engine = make_engine(net.to(tandem.world().device), opt)   # tandem.DDP when world > 1
        engine.model(x)
    """
    check_scaler(model, scaler)
    if isinstance(model, FullyShardedDataParallel):
        sharded: Engine = ShardedEngine(model, optimizer)
        sharded.check(checkpoint_format)
        return sharded
    wrapped: nn.Module
    if isinstance(model, (DataParallel, nn.DataParallel)):
        # One process driving several devices: its replicas are made anew every forward, so
        # the wrapped module is the whole model, and there are no other ranks to sync with.
        if group_size() > 1:
            raise ValueError(
                f"a DataParallel model in a job of {group_size()} processes: DataParallel is "
                "one process driving several devices; with one process per device pass the "
                "plain module (it is wrapped in tandem.DDP)"
            )
        parallel = ReplicatedEngine(model, model.module, optimizer)
        parallel.check(checkpoint_format)
        return parallel
    if isinstance(model, DistributedDataParallel):
        wrapped, module = model, model.module
    else:
        wrapped = module = model
    ReplicatedEngine(module, module, optimizer).check(checkpoint_format)
    if wrapped is module and group_size() > 1:
        wrapped = DistributedDataParallel(module, **(ddp_kwargs or {}))
    reducer = wrapped.reducer if isinstance(wrapped, DistributedDataParallel) else None
    return ReplicatedEngine(wrapped, module, optimizer, reducer)
