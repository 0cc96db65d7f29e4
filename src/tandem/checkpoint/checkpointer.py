"""The run's checkpointer: an engine and a dict of stateful objects, saved and loaded together.

It knows nothing of the Trainer. A checkpoint (written by
:func:`tandem.checkpoint.run_dir.save_checkpoint`, rank 0 only) holds::

    model        the engine's model: the unwrapped module's state_dict (gathered when sharded)
    optimizer    the engine's optimizer state (a plain optimizer's, gathered when sharded)
    engine       the engine's own state (tandem.DDP's bucket order) or None
    shards       None, or in the sharded format every rank's shard file digest (shard_files.py)
    <name>       for every stateful object: its state_dict(), or None for an object not given;
                 with "ranks": every rank's rank_state_dict(), in rank order, if it has one

The work on the objects is ``tandem.checkpoint``'s (:mod:`tandem.checkpoint.phases` over
the entries of :mod:`tandem.checkpoint.entries`): the engine is one entry (its ``model``,
``optimizer`` and ``engine`` parts at the top of the layout above), each object a stateful
entry; gathering, the shard files, the checks made before anything loads, resharding and the
per-rank states are done once for both. What is the checkpointer's own: this layout (the same
``format_version`` as ever, so older checkpoints still resume), the run directory's names,
``latest`` and retention, and the note for ``tandem run``.

A checkpoint resumes at another world size: the model and optimizer of the full format load at
any world size as they are; in the sharded format each rank reads the saved shards that overlap
its own and cuts them anew (:func:`tandem.checkpoint.shards.reshard`), which needs those files
visible to it (a shared file system); per-rank states go to the object's
``load_rank_state_dicts(states, rank)``, which maps them (RunState: see its module doc).

For a Trainer the objects are ``trainer`` (:class:`tandem.train.run_state.RunState`: epoch,
step, sampler position, history, and per rank the RNG states and loss sums), ``scheduler`` and
``scaler``. See :mod:`tandem.parallel.engine` for the model and optimizer formats.

Every function here is called on every rank at the same point, and every error is raised on
every rank: rank 0's verdicts (a run directory it cannot write, a checkpoint it cannot read or
write) travel to the others before anyone raises, and what one rank finds while loading (a
shard file it cannot read, an object refusing its state) is gathered and raised on all.

Example::

    ckpt = Checkpointer(run_dir, keep=3, kind="full")
    objects = {"trainer": run_state, "scheduler": scheduler, "scaler": None}
    path = ckpt.save(engine, objects, epoch=3, step=1200)
    ckpt.resume(engine, objects, "latest")    # None when the run has no checkpoint yet
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Protocol

from tandem import _dist
from tandem._dist import from_rank0
from tandem._profile import span
from tandem.checkpoint.async_save import WRITER, Meeting
from tandem.checkpoint.entries import EngineEntry, Entry, StatefulEntry
from tandem.checkpoint.phases import (
    Collected,
    ShardFiles,
    check,
    collect_entries,
    load_into,
    settle,
    write_entries,
)
from tandem.checkpoint.run_dir import (
    CHECKPOINTS_DIR,
    CheckpointError,
    checkpoint_name,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from tandem.checkpoint.shards import prune_shards
from tandem.files import write_atomic
from tandem.parallel.engine import Engine, Kind

log = logging.getLogger(__name__)

_ENGINE_KEYS = ("model", "optimizer", "engine")
# The engine's entry; its parts sit at the top of the layout, beside "shards".
_ENGINE = "engine"
_RESERVED = (*_ENGINE_KEYS, "shards")


class Stateful(Protocol):
    """What the checkpointer saves: torch's ``state_dict()`` / ``load_state_dict()`` pair.

    An object may also have ``rank_state_dict()`` / ``load_rank_state_dict(state)`` for a part
    that differs per rank (RNG states): every rank's is saved, and each rank gets its own back.
    With ``load_rank_state_dicts(states, rank)`` instead it gets every saved rank's, and may be
    resumed at another world size (it decides how the states map onto the new ranks).
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
        async_: write in the background (:mod:`tandem.checkpoint.async_save`): :meth:`save`
            returns once the state is copied; :meth:`wait` for the commit.
    """

    def __init__(
        self, run_dir: str | Path, *, keep: int = 3, kind: Kind = "full", async_: bool = False
    ) -> None:
        if not isinstance(async_, bool):
            raise ValueError(
                f"async_ (the Trainer's checkpoint_async) must be True or False, not {async_!r}"
            )
        self.run_dir = Path(run_dir)
        self.keep = keep
        self.kind = kind
        self.async_ = async_
        self.rank = _dist.group_rank()

    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / CHECKPOINTS_DIR

    def save(
        self, engine: Engine, objects: dict[str, Stateful | None], *, epoch: int, step: int
    ) -> Path:
        """Gather every rank's state, write the checkpoint on rank 0; its path on every rank.

        Under ``tandem run`` rank 0 also notes the commit for the launcher's exit summary
        (:func:`report_commit`). With ``async_`` the path is the one the checkpoint will have:
        the write goes on in the background, after a save in flight was waited for.

        Raises:
            OSError, ValueError: a rank could not write (raised on every rank, nothing
                committed); with ``async_``, by the next save, :meth:`wait` or :meth:`resume`.
        """
        WRITER.settle("a checkpoint save")
        started = time.time()
        name = checkpoint_name(epoch, step)
        collected = collect_entries(_entries(engine, objects), self.kind)
        write = functools.partial(self._write, name, list(objects), epoch, step, started)
        if not self.async_:
            return write(collected, Meeting())
        path = self.ckpt_dir / f"{name}.pt"
        return WRITER.start(path, collected, write, self.rank, time.monotonic()).path

    def wait(self) -> Path | None:
        """Wait for the save in flight (``async_``); its path once committed, None if none.

        Raises:
            OSError, ValueError, CheckpointError, RuntimeError: that save failed (on every rank).
        """
        handle = WRITER.in_flight
        return None if handle is None else handle.wait()

    def abandon(self) -> None:
        """Give up the save in flight: the world it reports in was re-formed (recovery in
        memory). ``latest`` stays where it was unless that save had committed already."""
        WRITER.abandon()

    def _write(
        self,
        name: str,
        keys: list[str],
        epoch: int,
        step: int,
        started: float,
        collected: Collected,
        meeting: Meeting,
    ) -> Path:
        """The files of :meth:`save`: each rank's shards, then rank 0's checkpoint, which
        commits, and ``latest``; in the caller or in the background writer."""
        files = ShardFiles(self.ckpt_dir, name, single=_ENGINE)
        saved = write_entries(collected, files, self.rank, meeting.gather)
        verdict: tuple[str | None, Any] = (None, None)
        if self.rank == 0:
            state: dict[str, Any] = dict(saved.states[_ENGINE])
            state["shards"] = None if saved.digests is None else {"sha256": saved.digests}
            for key in keys:
                state[key] = None if key not in saved.states else dict(saved.states[key])
                if key in saved.ranks:
                    state[key]["ranks"] = saved.ranks[key]
            try:
                with span("tandem.train.checkpoint_write", name), meeting.commit():
                    path = save_checkpoint(
                        state, self.run_dir, epoch=epoch, step=step, keep=self.keep
                    )
                verdict = (None, (str(path), [p.stem for p in list_checkpoints(self.ckpt_dir)]))
            except (OSError, ValueError) as e:
                verdict = (type(e).__name__, f"rank 0 could not save a checkpoint: {e}")
        if self.rank == 0 and verdict[0] is None:
            report_commit(Path(verdict[1][0]), epoch=epoch, step=step, started=started)
        error, payload = meeting.gather(verdict)[0]
        if saved.digests is not None:
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
        WRITER.settle("resuming")
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
        entries = _entries(engine, objects)
        records = _records(_upgrade(payload["state"]), objects, path)
        files = ShardFiles(path.parent, path.stem, single=_ENGINE)
        # Everything checked on every rank before anything loads (checkpoint_steps).
        shard: dict[str, Any] | None = None
        local: Exception | None = None
        try:
            shard = check(path, records, entries, files, self.rank)
        except (ValueError, CheckpointError) as e:
            local = e
        settle(local)
        local = None
        try:
            load_into({}, path, records, entries, shard, self.rank)
        except Exception as e:
            local = e
        settle(local)
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


def _entries(engine: Engine, objects: dict[str, Stateful | None]) -> list[Entry]:
    """The engine's entry, then one per object given (None: the run has no such object)."""
    clash = [key for key in objects if key in _RESERVED]
    if clash:
        raise ValueError(f"objects may not be named {clash}: the checkpoint's layout uses them")
    entries: list[Entry] = [EngineEntry(_ENGINE, engine)]
    entries[0].what = "the engine (model and optimizer)"
    entries += [StatefulEntry(k, obj) for k, obj in objects.items() if obj is not None]
    return entries


def _records(
    state: dict[str, Any], objects: dict[str, Stateful | None], path: Path
) -> dict[str, Any]:
    """The Trainer layout's ``state`` as ``tandem.checkpoint``'s records (checkpoint_steps).

    Raises:
        ValueError: the checkpoint holds an object's state and the run was given None for it,
            or the reverse (the same on every rank: every rank has the same ``state``).
    """
    for key, obj in objects.items():
        if (state.get(key) is None) != (obj is None):
            holds = "holds" if state.get(key) is not None else "holds no"
            raise ValueError(
                f"checkpoint {path}: {holds} {key} state, and this run was given {key}={obj!r}: "
                f"pass the same kind of {key} as the run had"
            )
    engine = {key: state.get(key) for key in _ENGINE_KEYS}
    records = {_ENGINE: {"type": "engine", "state": engine, "ranks": None}}
    for key, obj in objects.items():
        if obj is not None:
            saved = dict(state[key])
            ranks = saved.pop("ranks", None)
            records[key] = {"type": "stateful", "state": saved, "ranks": ranks}
    return {"objects": records, "shards": state.get("shards")}


def report_commit(path: Path, *, epoch: int, step: int, started: float) -> Path | None:
    """Note for ``tandem run`` that the checkpoint ``path`` is committed; the note's path.

    ``tandem run`` gives its workers ``TANDEM_REPORT_DIR``; rank 0 writes there, atomically,
    ``tandem-checkpoint-<TORCHELASTIC_RUN_ID>.json``: ``path``, ``epoch``, ``step`` and the
    wall-clock times the save ``started`` and was ``committed``, one file per run, replaced at
    every commit. When the job is stopped by a signal or fails, the launcher's exit summary
    names the checkpoint and how to resume (``tandem.launch.supervisor.committed_checkpoint``
    reads the note). Without ``TANDEM_REPORT_DIR`` nothing is written (None). A note that
    cannot be written is only logged: the checkpoint is committed all the same.

    Example::

        report_commit(Path("runs/x/checkpoints/ckpt-e0003-s00001200.pt"), epoch=3,
                      step=1200, started=time.time() - 2.0)
    """
    where = os.environ.get("TANDEM_REPORT_DIR")
    if not where:
        return None
    # The launcher names the file by its run id (a hex token); anything else is made safe.
    run_id = re.sub(r"[^\w.-]", "_", os.environ.get("TORCHELASTIC_RUN_ID", "none"))
    note = Path(where) / f"tandem-checkpoint-{run_id}.json"
    record = {
        "path": str(path),
        "epoch": epoch,
        "step": step,
        "started": started,
        "committed": time.time(),
    }
    try:
        write_atomic(note, (json.dumps(record) + "\n").encode())
    except OSError as e:
        log.warning("checkpoint %s committed, but the note for tandem run failed: %s", path, e)
        return None
    return note


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
