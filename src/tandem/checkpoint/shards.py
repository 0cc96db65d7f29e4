"""One file per rank for sharded checkpoints, committed by rank 0's checkpoint file.

Layout beside the checkpoints of :mod:`tandem.checkpoint.run_dir`::

    checkpoints/ckpt-e0003-s00001200.pt                 rank 0's file: records every shard's sha256
    checkpoints/shards/ckpt-e0003-s00001200/rank00001.pt   rank 1's shards

Every rank writes its own file atomically (temporary file, fsync, rename, directory fsync) and
reports its digest; only when all ranks succeeded does rank 0 write its checkpoint, holding the
digests, so a checkpoint is never committed with a shard missing. A rank reads back only its
own file, checked against that digest: nodes need not share a file system, as long as each
rank comes back on the node that holds its file.

At another world size (:meth:`tandem.parallel.engine.Engine.reshard`) a rank reads the files
of the saved ranks whose shards overlap its new one, each checked against its digest, and cuts
its shard from them: those files must be visible to it (a shared file system).

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
from tandem.files import (
    file_digest,
    fsync_dir,
    rename_into_place,
    unlink_quietly,
    write_temp_digested,
)

SHARDS_DIR = "shards"


def shard_path(ckpt_dir: Path, checkpoint: str, rank: int) -> Path:
    """Where ``rank``'s file of the checkpoint named ``checkpoint`` (no suffix) lives."""
    return ckpt_dir / SHARDS_DIR / checkpoint / f"rank{rank:05d}.pt"


_CREATE_ATTEMPTS = 5


def write_shard(state: dict[str, Any], ckpt_dir: Path, checkpoint: str, rank: int) -> str:
    """Write ``rank``'s shard of ``checkpoint`` atomically; its sha256 hex digest.

    Raises:
        OSError: the file system refused a write (the message names the file).
    """
    path = shard_path(ckpt_dir, checkpoint, rank)
    try:
        for attempt in range(_CREATE_ATTEMPTS):
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                # Hashed as written, as a checkpoint file is (run_dir.write_committed says why).
                tmp, digest = write_temp_digested(
                    path.parent, path.name, lambda f: torch.save(state, f)
                )
                break
            except FileNotFoundError:
                # Another rank's prune_shards, still tidying after the previous save (in the
                # background), removed this checkpoint's directory while it was empty: made
                # again. Once our temporary file is in it, no rmdir can take it.
                if path.parent.is_dir() or attempt == _CREATE_ATTEMPTS - 1:
                    raise
        try:
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
