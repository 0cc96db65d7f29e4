"""What a Trainer checkpoint holds, and how a Trainer is put back from one.

A checkpoint (written by :func:`tandem.train.checkpoint.save_checkpoint`, rank 0 only) holds::

    model        the unwrapped module's state_dict (gathered when sharded; see model_state.py)
    optimizer    optimizer.state_dict() (gathered as a plain optimizer's when sharded)
    shards       None, or in the sharded format every rank's shard file digest (shard_files.py)
    engine       the engine's own state (tandem.DDP's bucket order) or None; absent from
                 checkpoints of older versions, which still load
    scheduler    scheduler.state_dict() or None
    scaler       grad scaler's state_dict() or None
    sampler      the sampler's state, its position = batches handed out x batch_size
    rng          every rank's RNG states, in rank order (each rank restores its own)
    trainer      world size, epoch, step, batch in the epoch, batch size, accumulation,
                 every rank's running loss sums of the epoch, epoch and run time
    history      the per-epoch records (metrics.jsonl is rewritten from them)

Why each piece is needed for a resumed run to end bitwise equal to the uninterrupted one:

- checkpoints are taken only at optimizer-step boundaries (the Trainer agrees on requests only
  there), so no gradient accumulation is cut in half; the step count, the same on every rank,
  decides the boundaries;
- the sampler position is the Trainer's own count of batches consumed, not the sampler's (a
  DataLoader draws indices ahead of the batch it yields);
- each rank restores its own RNG states just before training goes on, and the loaders own
  their generators (:mod:`tandem.train.loaders`), so no iterator made after the resume draws
  from the generator that dropout draws from;
- the epoch's running loss sums are saved per rank, so even the reported losses repeat;
- tandem.DDP's buckets, learnt from the run's first backward, are put back before the first
  forward: a fresh engine would start with one bucket, and with three or more ranks Gloo's sum
  of an element rounds differently when the bucket boundaries around it move.

Every function here is called on every rank at the same point, and every error is raised on
every rank: rank 0's verdicts (a run directory it cannot write, a checkpoint it cannot read or
write) travel to the others before anyone raises, and the checks made on the loaded state use
data every rank has, so they fail everywhere alike.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.train.checkpoint import (
    CHECKPOINTS_DIR,
    CheckpointError,
    checkpoint_name,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from tandem.train.collective import from_rank0, gather_objects
from tandem.train.metrics_log import write_metrics
from tandem.train.model_state import capture, engine_state, restore
from tandem.train.rng import capture_rng_state
from tandem.train.shard_files import prune_shards, read_shard, write_shard

if TYPE_CHECKING:
    from tandem.train.trainer import Trainer


def check_writable(run_dir: Path, is_main: bool) -> None:
    """Raise ValueError on every rank unless rank 0 can create and write ``run_dir``.

    Checked before training: a run that cannot save should fail now, not at its first
    checkpoint hours later. Only rank 0 writes there, so only its view of the path counts.
    """
    verdict = None
    if is_main:
        probe = run_dir / f".tandem-write-check-{os.getpid()}"
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            verdict = f"run_dir {str(run_dir)!r} cannot be written on rank 0: {e}"
    verdict = from_rank0(verdict)
    if verdict is not None:
        raise ValueError(verdict)


def _sampler_state(trainer: Trainer) -> dict[str, Any]:
    # The one rule for where the sampler stands: the batches the Trainer has consumed. The
    # sampler's own count runs ahead by whatever the DataLoader had prefetched.
    position = min(trainer.batch * trainer.batch_size, len(trainer.sampler))
    return {**trainer.sampler.state_dict(), "epoch": trainer.epoch, "position": position}


def save(trainer: Trainer) -> Path:
    """Gather every rank's local state, write the checkpoint on rank 0; its path on every rank.

    Raises:
        OSError, ValueError: rank 0 could not write the checkpoint (raised on every rank).
    """
    main, shard = capture(trainer.module, trainer.optimizer, sharded=trainer.sharded_checkpoints)
    mine: dict[str, Any] = {"rng": capture_rng_state(), "epoch_loss": list(trainer.epoch_loss)}
    ckpt_dir = trainer.run_dir / CHECKPOINTS_DIR
    name = checkpoint_name(trainer.epoch, trainer.step)
    if shard is not None:
        try:
            mine["shard"] = (None, write_shard(shard, ckpt_dir, name, trainer.world.rank))
        except OSError as e:
            mine["shard"] = ("OSError", f"rank {trainer.world.rank} could not save its shard: {e}")
    ranks = gather_objects(mine)
    failed = [r["shard"][1] for r in ranks if "shard" in r and r["shard"][0] is not None]
    if failed:
        # Every rank has the same gathered list: the same error everywhere, nothing committed.
        raise OSError("; ".join(failed))
    verdict: tuple[str | None, Any] = (None, None)
    if trainer.world.is_main:
        state = {
            "model": main["model"],
            "optimizer": main["optimizer"],
            "shards": None if shard is None else {"sha256": [r["shard"][1] for r in ranks]},
            "engine": engine_state(trainer.model),
            "scheduler": None if trainer.scheduler is None else trainer.scheduler.state_dict(),
            "scaler": None if trainer.scaler is None else trainer.scaler.state_dict(),
            "sampler": _sampler_state(trainer),
            "rng": [r["rng"] for r in ranks],
            "trainer": {
                "world_size": trainer.world.world_size,
                "epoch": trainer.epoch,
                "step": trainer.step,
                "batch": trainer.batch,
                "batch_size": trainer.batch_size,
                "grad_accum_steps": trainer.grad_accum_steps,
                "epoch_loss": [r["epoch_loss"] for r in ranks],
                "epoch_seconds": trainer.epoch_seconds,
                "elapsed": trainer.elapsed_seconds(),
            },
            "history": list(trainer.history),
        }
        try:
            path = save_checkpoint(
                state,
                trainer.run_dir,
                epoch=trainer.epoch,
                step=trainer.step,
                keep=trainer.keep_checkpoints,
            )
            verdict = (None, (str(path), [p.stem for p in list_checkpoints(ckpt_dir)]))
        except (OSError, ValueError) as e:
            verdict = (type(e).__name__, f"rank 0 could not save a checkpoint: {e}")
    error, payload = from_rank0(verdict)
    if shard is not None:
        # After a failed save too: its shards are then garbage.
        prune_shards(ckpt_dir, set(payload[1]) if error is None else set(), trainer.world.rank)
    if error is not None:
        raise (OSError if error != "ValueError" else ValueError)(payload)
    return Path(payload[0])


def resume(trainer: Trainer, resume: str | Path) -> None:
    """Load the checkpoint ``resume`` names on rank 0, send it to every rank, restore from it.

    ``"latest"`` is the newest checkpoint of the run directory, or nothing (a fresh start); a
    path must hold a checkpoint. Rank 0 reads the file because it is the rank that wrote it:
    the others may run on nodes that do not share its file system.
    """
    verdict: tuple[str | None, Any] = (None, None)
    if trainer.world.is_main:
        try:
            verdict = (None, _load(trainer.run_dir, resume))
        except CheckpointError as e:
            verdict = (
                f"{e} To resume from another checkpoint pass Trainer(..., resume=PATH).",
                None,
            )
    error, payload = from_rank0(verdict)
    if error is not None:
        raise CheckpointError(error)
    if payload is not None:
        _restore(trainer, payload)


def _read_own_shard(trainer: Trainer, state: dict[str, Any], path: Path) -> dict[str, Any] | None:
    """This rank's shard of a sharded checkpoint (None for a full one); errors on every rank."""
    shards = state.get("shards")
    if shards is None:
        return None
    shard, problem = None, None
    try:
        rank = trainer.world.rank
        shard = read_shard(path.parent, path.stem, rank, shards["sha256"][rank])
    except CheckpointError as e:
        problem = str(e)
    problems = [p for p in gather_objects(problem) if p is not None]
    if problems:
        raise CheckpointError(f"checkpoint {path}: " + "; ".join(problems))
    return shard


def _load(run_dir: Path, resume: str | Path) -> dict[str, Any] | None:
    optional = resume == "latest"
    where = run_dir if optional else Path(resume)
    file = latest_checkpoint(where) if where.is_dir() else where
    if file is None:
        if optional:
            return None
        raise CheckpointError(f"no checkpoints in {where} to resume from")
    return {**load_checkpoint(file), "path": str(file)}


def _restore(trainer: Trainer, payload: dict[str, Any]) -> None:
    state, path = payload["state"], payload["path"]
    saved = state["trainer"]
    world_size = trainer.world.world_size
    if saved["world_size"] != world_size:
        # The sampler's position and the RNG states are per rank of the saved world: with
        # another number of ranks neither means anything, and the run could not be the same.
        raise ValueError(
            f"checkpoint {path} was written by a run of {saved['world_size']} process(es); "
            f"this run has {world_size}. Resume with {saved['world_size']} processes, or "
            "start a new run (resume=None) from its weights"
        )
    if saved["batch"]:
        for name in ("batch_size", "grad_accum_steps"):
            if saved[name] != getattr(trainer, name):
                raise ValueError(
                    f"checkpoint {path} was written mid-epoch with {name}={saved[name]}; this "
                    f"run has {name}={getattr(trainer, name)}, which would split the rest of "
                    "the epoch differently. Resume with the same value, or from a checkpoint "
                    "written at an epoch's end"
                )
    for name in ("scheduler", "scaler"):
        if (state[name] is None) != (getattr(trainer, name) is None):
            has = "has" if state[name] is not None else "has no"
            raise ValueError(
                f"checkpoint {path} {has} {name} state, and this Trainer was given "
                f"{name}={getattr(trainer, name)!r}: pass the same kind of {name} as the run had"
            )
    shard = _read_own_shard(trainer, state, Path(path))
    restore(trainer.module, trainer.optimizer, state, shard)
    if trainer.scheduler is not None:
        trainer.scheduler.load_state_dict(state["scheduler"])
    if trainer.scaler is not None:
        trainer.scaler.load_state_dict(state["scaler"])
    trainer.sampler.load_state_dict(state["sampler"])
    rank = trainer.world.rank
    trainer.epoch, trainer.step, trainer.batch = saved["epoch"], saved["step"], saved["batch"]
    trainer.epoch_loss = list(saved["epoch_loss"][rank])
    trainer.epoch_seconds, trainer.elapsed = saved["epoch_seconds"], saved["elapsed"]
    trainer.history = list(state["history"])
    trainer.last_checkpoint = Path(path)
    trainer._rng_to_restore = state["rng"][rank]
    # The engine is built after this (it broadcasts the loaded parameters): the Trainer
    # restores its state then, before the first forward.
    trainer._engine_to_restore = state.get("engine")
    if trainer.world.is_main:
        # Drop the lines of epochs after the checkpoint (a resume from an older one).
        write_metrics(trainer.run_dir, trainer.history)
        print(
            f"resumed from {path}: epoch {saved['epoch'] + 1}, batch {saved['batch']}, "
            f"step {saved['step']}",
            flush=True,
        )
