"""One file per rank for sharded checkpoints, committed by rank 0's checkpoint file.

Layout beside the checkpoints of :mod:`tandem.checkpoint.run_dir`::

    checkpoints/ckpt-e0003-s00001200.pt                 rank 0's file: records every shard's sha256
    checkpoints/shards/ckpt-e0003-s00001200/rank00001.pt   rank 1's shards

Every rank writes its own file atomically (temporary file, fsync, rename, directory fsync) and
reports its digest; only when all ranks succeeded does rank 0 write its checkpoint, holding the
digests, so a checkpoint is never committed with a shard missing. A rank reads back only its
own file, checked against that digest: nodes need not share a file system, as long as each
rank comes back on the node that holds its file.

At another world size (:func:`reshard`) a rank reads the files of the saved ranks whose shards
overlap its new one, each checked against its digest, and cuts its shard from them: those
files must be visible to it (a shared file system).

Example::

    digest = write_shard(state, ckpt_dir, "ckpt-e0003-s00001200", rank)
    state = read_shard(ckpt_dir, "ckpt-e0003-s00001200", rank, digest)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tandem.checkpoint.run_dir import CheckpointError
from tandem.files import file_digest, fsync_dir, rename_into_place, unlink_quietly, write_temp
from tandem.parallel.engine import Engine, ShardedEngine
from tandem.parallel.fsdp import reshard as fsdp_reshard
from tandem.parallel.fsdp.layout import FsdpLayout
from tandem.parallel.zero import ShardedOptimizer

SHARDS_DIR = "shards"


def shard_path(ckpt_dir: Path, checkpoint: str, rank: int) -> Path:
    """Where ``rank``'s file of the checkpoint named ``checkpoint`` (no suffix) lives."""
    return ckpt_dir / SHARDS_DIR / checkpoint / f"rank{rank:05d}.pt"


def write_shard(state: dict[str, Any], ckpt_dir: Path, checkpoint: str, rank: int) -> str:
    """Write ``rank``'s shard of ``checkpoint`` atomically; its sha256 hex digest.

    Raises:
        OSError: the file system refused a write (the message names the file).
    """
    path = shard_path(ckpt_dir, checkpoint, rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = write_temp(path.parent, path.name, lambda f: torch.save(state, f))
        try:
            digest = file_digest(tmp, "sha256")
            rename_into_place(tmp, path)
        except BaseException:
            unlink_quietly(tmp)
            raise
        fsync_dir(path.parent)
    except OSError as e:
        raise OSError(e.errno, f"cannot save shard {path}: {e.strerror or e}", e.filename) from e
    return digest


def read_shard(ckpt_dir: Path, checkpoint: str, rank: int, sha256: str) -> dict[str, Any]:
    """Load ``rank``'s shard of ``checkpoint`` after checking it against ``sha256``.

    Raises:
        CheckpointError: the file is missing, corrupt, truncated or not plain data.
    """
    path = shard_path(ckpt_dir, checkpoint, rank)
    if not path.is_file():
        raise CheckpointError(
            f"rank {rank}'s shard {path} of checkpoint {checkpoint} does not exist: a sharded "
            "checkpoint is read by each rank from its own node; resume every rank where its "
            "shard file is"
        )
    actual = file_digest(path, "sha256")
    if actual != sha256:
        raise CheckpointError(
            f"rank {rank}'s shard {path} is corrupt or truncated: it hashes to sha256 {actual}, "
            f"the checkpoint records {sha256}"
        )
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:
        raise CheckpointError(f"rank {rank}'s shard {path} cannot be read: {e}") from e


def prune_shards(ckpt_dir: Path, committed: set[str], rank: int) -> None:
    """Delete ``rank``'s files of checkpoints not in ``committed`` (names without suffix).

    Each rank deletes its own files, so that shards on a node's private disk go too; a
    directory left empty is removed by whichever rank empties it. Failures are ignored: the
    files are unreachable garbage, not state.
    """
    root = ckpt_dir / SHARDS_DIR
    if not root.is_dir():
        return
    for directory in root.iterdir():
        if directory.name in committed or not directory.is_dir():
            continue
        mine = f"rank{rank:05d}.pt"
        # The file, and temporaries of a save that crashed.
        for entry in directory.glob(f"*{mine}*"):
            temporary = entry.name.startswith(f".{mine}.") and entry.suffix == ".tmp"
            if entry.name == mine or temporary:
                unlink_quietly(entry)
        # Fails while other ranks' files remain, or when another rank removed it first.
        with contextlib.suppress(OSError):
            os.rmdir(directory)


def cached_reader(read: Callable[[int], dict[str, Any]]) -> Callable[[int], dict[str, Any]]:
    """``read``, reading each saved rank's file once however many objects need it."""
    files: dict[int, dict[str, Any]] = {}

    def once(rank: int) -> dict[str, Any]:
        if rank not in files:
            files[rank] = read(rank)
        return files[rank]

    return once


def reshard_model(
    layout: FsdpLayout, saved_world_size: int, read: Callable[[int], dict[str, Any]]
) -> dict[str, Any]:
    """This rank's FSDP ``sharded_state_dict()``, cut from the ``"model"`` parts ``read(q)``
    gives of the saved ranks that overlap this one (:mod:`tandem.parallel.fsdp.reshard`)."""
    files = {q: read(q) for q in fsdp_reshard.source_ranks(layout, saved_world_size)}
    return fsdp_reshard.reshard_sharded_state_dict(layout, _parts(files, "model"))


def reshard_optimizer(
    optimizer: torch.optim.Optimizer,
    layout: FsdpLayout | None,
    saved_world_size: int,
    read: Callable[[int], dict[str, Any]],
) -> dict[str, Any]:
    """This rank's ``optimizer.state_dict()``, cut from the ``"optimizer"`` parts ``read(q)``
    gives: an optimizer over the shards of the FSDP model of ``layout`` (element-wise state cut
    like the shards), or a ShardedOptimizer (``layout`` None: the state of the parameters this
    rank owns now, from their old owners)."""
    if layout is not None:
        files = {q: read(q) for q in fsdp_reshard.source_ranks(layout, saved_world_size)}
        return fsdp_reshard.reshard_optim_state_dict(
            layout, optimizer, _parts(files, "optimizer"), saved_world_size
        )
    if not isinstance(optimizer, ShardedOptimizer):
        raise ValueError(
            f"the checkpoint holds a sharded optimizer state, and this optimizer "
            f"{type(optimizer).__name__} is not sharded: load it with the set-up that wrote it "
            "(a tandem.ShardedOptimizer, or an optimizer over a tandem.FullyShardedDataParallel "
            "model's shards), or save a full checkpoint"
        )
    files = {q: read(q) for q in optimizer.source_ranks(saved_world_size)}
    return optimizer.reshard_state_dicts(_parts(files, "optimizer"))


def reshard(
    engine: Engine, saved_world_size: int, read: Callable[[int], dict[str, Any]]
) -> dict[str, Any]:
    """This rank's shard for ``engine``, cut from the files of a run of another world size.

    ``read(rank)`` returns a saved rank's shard file (:func:`read_shard`); only the ranks whose
    shards overlap this rank's are read, each once. The result is what
    ``engine.state_dict("sharded")`` would give here as ``"shard"``, so
    ``engine.load_state_dict`` takes it unchanged:

    - FullyShardedDataParallel: every unit's flat shard and the optimizer's element-wise state
      cut anew (:func:`reshard_model`, :func:`reshard_optimizer`);
    - ShardedOptimizer: the state of the parameters this rank owns now, from their old owners
      (:meth:`tandem.parallel.zero.ShardedOptimizer.reshard_state_dicts`).

    Raises:
        CheckpointError: a file ``read`` needs is missing or corrupt.
        ValueError: the files do not fit this engine (another model, another kind of engine).

    Example::

        shard = reshard(engine, 2, lambda q: read_shard(ckpt_dir, name, q, digests[q]))
        engine.load_state_dict({**main_file_parts, "shard": shard})
    """
    read = cached_reader(read)
    if isinstance(engine, ShardedEngine):
        layout = engine.fsdp.layout
        return {
            "model": reshard_model(layout, saved_world_size, read),
            "optimizer": reshard_optimizer(engine.optimizer, layout, saved_world_size, read),
        }
    optimizer = engine.optimizer
    if isinstance(optimizer, ShardedOptimizer):
        for q in optimizer.source_ranks(saved_world_size):
            if "model" in read(q):
                raise ValueError(
                    "the shard files hold FSDP model shards; this model is not a "
                    "tandem.FullyShardedDataParallel"
                )
    return {"optimizer": reshard_optimizer(optimizer, None, saved_world_size, read)}


def _parts(files: dict[int, dict[str, Any]], part: str) -> dict[int, Any]:
    """Every file's ``part``; ValueError naming the file that lacks it."""
    for q, f in files.items():
        if not isinstance(f, dict) or part not in f:
            held = sorted(f) if isinstance(f, dict) else type(f).__name__
            raise ValueError(
                f"saved rank {q}'s shard holds no {part!r} part (it holds {held}): it was "
                f"written by another set-up (a ShardedOptimizer run holds no FSDP model shards)"
            )
    return {q: f[part] for q, f in files.items()}
