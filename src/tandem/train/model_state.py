"""What a Trainer checkpoint stores for the model and the optimizer, whatever shards them.

Three set-ups, two formats:

=============================  =================================  ===============================
set-up                         ``"full"`` (rank 0's file)          ``"sharded"`` (a file per rank)
=============================  =================================  ===============================
plain model or tandem.DDP      ``state_dict()`` of both            refused: nothing is sharded
tandem.ShardedOptimizer        optimizer gathered on rank 0        each rank's optimizer shard
FullyShardedDataParallel       model and optimizer gathered        each rank's shards as they are
=============================  =================================  ===============================

The full format is a plain module's and a plain optimizer's ``state_dict()``: it loads into the
unwrapped model, and into a sharded one at any world size. The sharded format never gathers:
no rank holds more than its own shards, and it loads only at the world size that wrote it.
Gathering is a collective, so every function here is called on every rank.

The engine that wraps the model keeps state of its own: :class:`tandem.DDP` learns its bucket
order from the first backward. :func:`engine_state` and :func:`restore_engine` carry it (rank
0's, the order its rebuild broadcasts), so that a resumed run sums its gradients in the same
buckets as the run it continues: Gloo's sum of three or more ranks rounds differently when the
bucket boundaries move.

Example::

    main, shard = capture(model, optimizer, sharded=True)   # shard: this rank's own file
    restore(model, optimizer, main, shard)
    restore_engine(ddp_model, engine_state(ddp_model))     # before the first forward
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tandem.parallel.ddp import DistributedDataParallel
from tandem.parallel.fsdp import FullyShardedDataParallel
from tandem.parallel.zero import ShardedOptimizer

FORMATS = ("full", "sharded")


def check_set_up(
    model: nn.Module, optimizer: torch.optim.Optimizer, fmt: str, scaler: Any = None
) -> None:
    """Raise ValueError unless this set-up can train and write checkpoints in format ``fmt``."""
    if isinstance(model, FullyShardedDataParallel) and scaler is not None:
        raise ValueError(
            "scaler with a FullyShardedDataParallel model: a GradScaler sees only this "
            "rank's gradient shards, so ranks could disagree on skipping a step; train "
            "in bfloat16 autocast without a scaler, or with tandem.DDP"
        )
    if fmt not in FORMATS:
        raise ValueError(f"checkpoint_format must be 'full' or 'sharded', not {fmt!r}")
    sharded = isinstance(model, FullyShardedDataParallel) or isinstance(optimizer, ShardedOptimizer)
    if fmt == "sharded" and not sharded:
        raise ValueError(
            "checkpoint_format='sharded' needs a tandem.FullyShardedDataParallel model or a "
            "tandem.ShardedOptimizer: this model and optimizer are replicated on every rank, "
            "so rank 0's full checkpoint already holds everything"
        )


def capture(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, sharded: bool
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``(main, shard)``: entries for rank 0's checkpoint file and this rank's own shard file.

    A collective. ``main`` holds ``model`` and ``optimizer`` (None where the shard file holds
    it; meaningful on rank 0 only); ``shard`` is None in the full format.
    """
    fsdp = isinstance(model, FullyShardedDataParallel)
    if fsdp and sharded:
        main = {"model": None, "optimizer": None}
        return main, {"model": model.sharded_state_dict(), "optimizer": optimizer.state_dict()}
    if fsdp:
        return {
            "model": model.full_state_dict(),
            "optimizer": model.full_optim_state_dict(optimizer),
        }, None
    if isinstance(optimizer, ShardedOptimizer):
        if sharded:
            return {"model": model.state_dict(), "optimizer": None}, {
                "optimizer": optimizer.state_dict()
            }
        return {"model": model.state_dict(), "optimizer": optimizer.full_state_dict()}, None
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, None


def restore(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    main: dict[str, Any],
    shard: dict[str, Any] | None,
) -> None:
    """Load what :func:`capture` saved: ``main`` on every rank, ``shard`` this rank's own."""
    shard = shard or {}
    fsdp = isinstance(model, FullyShardedDataParallel)
    if "model" in shard:
        model.load_sharded_state_dict(shard["model"])
    elif fsdp:
        model.load_full_state_dict(main["model"])
    else:
        model.load_state_dict(main["model"])
    if "optimizer" in shard:
        optimizer.load_state_dict(shard["optimizer"])
    elif fsdp:
        model.load_full_optim_state_dict(optimizer, main["optimizer"])
    elif isinstance(optimizer, ShardedOptimizer):
        optimizer.load_full_state_dict(main["optimizer"])
    else:
        optimizer.load_state_dict(main["optimizer"])


def engine_state(model: nn.Module) -> dict[str, Any] | None:
    """The wrapping engine's own state: tandem.DDP's bucket order; None for the other engines."""
    if isinstance(model, DistributedDataParallel):
        return model.reducer.state_dict()
    return None


def restore_engine(model: nn.Module, state: dict[str, Any] | None) -> None:
    """Load :func:`engine_state`'s ``state`` into ``model``, before its first forward.

    ``state`` None (a checkpoint written before engines saved theirs, or by a plain model) leaves
    the engine as built: it then learns its buckets again, and a resumed run of three or more
    ranks equals the uninterrupted one to rounding only. A state saved by tandem.DDP is ignored
    by another engine.
    """
    if state is not None and isinstance(model, DistributedDataParallel):
        model.reducer.load_state_dict(state)
