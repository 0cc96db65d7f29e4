"""The run's checkpointer: an engine and a dict of stateful objects, saved and loaded together.

It knows nothing of the Trainer. A checkpoint (written by
:func:`tandem.train.checkpoint.save_checkpoint`, rank 0 only) holds::

    model        the engine's model: the unwrapped module's state_dict (gathered when sharded)
    optimizer    the engine's optimizer state (a plain optimizer's, gathered when sharded)
    engine       the engine's own state (tandem.DDP's bucket order) or None
    shards       None, or in the sharded format every rank's shard file digest (shard_files.py)
    <name>       for every stateful object: its state_dict(), or None for an object not given;
                 with "ranks": every rank's rank_state_dict(), in rank order, if it has one

For a Trainer the objects are ``trainer`` (:class:`tandem.train.run_state.RunState`: epoch,
step, sampler position, history, and per rank the RNG states and loss sums), ``scheduler`` and
``scaler``. See :mod:`tandem.parallel.engine` for the model and optimizer formats.

Every function here is called on every rank at the same point, and every error is raised on
every rank: rank 0's verdicts (a run directory it cannot write, a checkpoint it cannot read or
write) travel to the others before anyone raises, and the checks made on the loaded state use
data every rank has, so they fail everywhere alike.

Example::

    ckpt = Checkpointer(run_dir, keep=3, kind="full")
    objects = {"trainer": run_state, "scheduler": scheduler, "scaler": None}
    path = ckpt.save(engine, objects, epoch=3, step=1200)
    ckpt.resume(engine, objects, "latest")    # None when the run has no checkpoint yet
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Protocol

from tandem import _dist
from tandem.parallel.engine import Engine, Kind
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
from tandem.train.shard_files import prune_shards, read_shard, write_shard

log = logging.getLogger(__name__)

_ENGINE_KEYS = ("model", "optimizer", "engine")


class Stateful(Protocol):
    """What the checkpointer saves: torch's ``state_dict()`` / ``load_state_dict()`` pair.

    An object may also have ``rank_state_dict()`` / ``load_rank_state_dict(state)`` for a part
    that differs per rank (RNG states): every rank's is saved, and each rank gets its own back.
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def check_writable(run_dir: Path) -> None:
    """Raise ValueError on every rank unless rank 0 can create and write ``run_dir``.

    Checked before training: a run that cannot save should fail now, not at its first
    checkpoint hours later. Only rank 0 writes there, so only its view of the path counts.
    """
    verdict = None
    if _dist.group_rank() == 0:
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


class Checkpointer:
    """Saves and resumes a run in ``run_dir/checkpoints`` (every method is a collective).

    Args:
        run_dir: the run's directory.
        keep: how many checkpoints to keep.
        kind: ``"full"`` (rank 0 writes one file) or ``"sharded"`` (each rank also writes its
            own shards; see :mod:`tandem.parallel.engine`).
    """

    def __init__(self, run_dir: str | Path, *, keep: int = 3, kind: Kind = "full") -> None:
        self.run_dir = Path(run_dir)
        self.keep = keep
        self.kind = kind
        self.rank = _dist.group_rank()

    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / CHECKPOINTS_DIR

    def save(
        self, engine: Engine, objects: dict[str, Stateful | None], *, epoch: int, step: int
    ) -> Path:
        """Gather every rank's state, write the checkpoint on rank 0; its path on every rank.

        Raises:
            OSError, ValueError: a rank could not write (raised on every rank, nothing
                committed).
        """
        parts = engine.state_dict(self.kind)
        shard = parts["shard"]
        mine: dict[str, Any] = {
            name: obj.rank_state_dict()
            for name, obj in objects.items()
            if obj is not None and hasattr(obj, "rank_state_dict")
        }
        name = checkpoint_name(epoch, step)
        report: tuple[str | None, str | None] = (None, None)
        if shard is not None:
            try:
                report = (None, write_shard(shard, self.ckpt_dir, name, self.rank))
            except OSError as e:
                report = ("OSError", f"rank {self.rank} could not save its shard: {e}")
        everyone = gather_objects({"ranks": mine, "shard": report})
        failed = [r["shard"][1] for r in everyone if r["shard"][0] is not None]
        if failed:
            # Every rank has the same gathered list: the same error everywhere, nothing committed.
            raise OSError("; ".join(failed))
        verdict: tuple[str | None, Any] = (None, None)
        if self.rank == 0:
            state: dict[str, Any] = {key: parts[key] for key in _ENGINE_KEYS}
            state["shards"] = (
                None if shard is None else {"sha256": [r["shard"][1] for r in everyone]}
            )
            for key, obj in objects.items():
                state[key] = None if obj is None else obj.state_dict()
                if key in mine:
                    state[key]["ranks"] = [r["ranks"][key] for r in everyone]
            try:
                path = save_checkpoint(state, self.run_dir, epoch=epoch, step=step, keep=self.keep)
                verdict = (None, (str(path), [p.stem for p in list_checkpoints(self.ckpt_dir)]))
            except (OSError, ValueError) as e:
                verdict = (type(e).__name__, f"rank 0 could not save a checkpoint: {e}")
        error, payload = from_rank0(verdict)
        if shard is not None:
            # After a failed save too: its shards are then garbage.
            committed = set(payload[1]) if error is None else set()
            prune_shards(self.ckpt_dir, committed, self.rank)
        if error is not None:
            raise (OSError if error != "ValueError" else ValueError)(payload)
        log.debug("checkpoint %s committed (%s kind, epoch %d, step %d)", payload[0], self.kind,
                  epoch, step)  # fmt: skip
        return Path(payload[0])

    def resume(
        self, engine: Engine, objects: dict[str, Stateful | None], resume: str | Path
    ) -> Path | None:
        """Load the checkpoint ``resume`` names into ``engine`` and ``objects``; its path.

        ``"latest"`` is the newest checkpoint of the run directory, or nothing (None: a fresh
        start); a path must hold a checkpoint. Rank 0 reads the file because it is the rank
        that wrote it: the others may run on nodes that do not share its file system.

        Raises:
            CheckpointError: the checkpoint is missing, corrupt or truncated.
            ValueError: it does not fit this run (the message names the file and what differs).
        """
        verdict: tuple[str | None, Any] = (None, None)
        if self.rank == 0:
            try:
                verdict = (None, self._read(resume))
            except CheckpointError as e:
                verdict = (
                    f"{e} To resume from another checkpoint pass Trainer(..., resume=PATH).",
                    None,
                )
        error, payload = from_rank0(verdict)
        if error is not None:
            raise CheckpointError(error)
        if payload is None:
            return None
        path = Path(payload["path"])
        state = _upgrade(payload["state"])
        try:
            self._load_objects(objects, state)
        except ValueError as e:
            raise ValueError(f"checkpoint {path}: {e}") from e
        shard = self._read_own_shard(state, path)
        engine.load_state_dict({**{k: state.get(k) for k in _ENGINE_KEYS}, "shard": shard})
        log.debug("resumed from %s", path)
        return path

    def _read(self, resume: str | Path) -> dict[str, Any] | None:
        optional = resume == "latest"
        where = self.run_dir if optional else Path(resume)
        file = latest_checkpoint(where) if where.is_dir() else where
        if file is None:
            if optional:
                return None
            raise CheckpointError(f"no checkpoints in {where} to resume from")
        return {**load_checkpoint(file), "path": str(file)}

    def _load_objects(self, objects: dict[str, Stateful | None], state: dict[str, Any]) -> None:
        for key, obj in objects.items():
            if (state.get(key) is None) != (obj is None):
                holds = "holds" if state.get(key) is not None else "holds no"
                raise ValueError(
                    f"{holds} {key} state, and this run was given {key}={obj!r}: pass the same "
                    f"kind of {key} as the run had"
                )
        for key, obj in objects.items():
            if obj is None:
                continue
            saved = dict(state[key])
            ranks = saved.pop("ranks", None)
            obj.load_state_dict(saved)
            if ranks is not None:
                obj.load_rank_state_dict(ranks[self.rank])  # type: ignore[attr-defined]

    def _read_own_shard(self, state: dict[str, Any], path: Path) -> dict[str, Any] | None:
        """This rank's shard of a sharded checkpoint (None for a full one); errors everywhere."""
        shards = state.get("shards")
        if shards is None:
            return None
        shard, problem = None, None
        try:
            shard = read_shard(path.parent, path.stem, self.rank, shards["sha256"][self.rank])
        except CheckpointError as e:
            problem = str(e)
        problems = [p for p in gather_objects(problem) if p is not None]
        if problems:
            raise CheckpointError(f"checkpoint {path}: " + "; ".join(problems))
        return shard


def _upgrade(state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint of tandem 0.1's first layout (run state spread over the top level)."""
    trainer = state.get("trainer")
    if trainer is None or "ranks" in trainer:
        return state
    ranks = [
        {"rng": rng, "epoch_loss": loss}
        for rng, loss in zip(state["rng"], trainer["epoch_loss"], strict=True)
    ]
    upgraded = {k: v for k, v in trainer.items() if k != "epoch_loss"}
    upgraded.update(sampler=state["sampler"], history=state["history"], ranks=ranks)
    return {**state, "trainer": upgraded}
