"""Checkpoints that can be trusted: written atomically, checksummed, loaded without running code.

Layout of ``run_dir/checkpoints/``::

    ckpt-e0003-s00001200.pt          torch.save({"format_version", "epoch", "step", "state"})
    ckpt-e0003-s00001200.pt.sha256   "<sha256 hex>  ckpt-e0003-s00001200.pt" (sha256sum -c reads it)
    latest                           {"checkpoint": "ckpt-e0003-s00001200.pt", ...}

A save is committed in three steps, each a temporary file in the same directory, flushed,
fsynced, renamed over its final name (``os.replace`` is atomic on one file system) and followed
by an fsync of the directory so the rename itself survives a power loss:

1. the checkpoint file;
2. its ``.sha256`` sidecar: a checkpoint without one is an unfinished save and is not listed;
3. the ``latest`` pointer, last, so it only ever names a checkpoint that is whole on disk.

Then checkpoints beyond the newest ``keep`` are deleted (sidecar first), with leftovers of
crashed saves. A crash at any point leaves ``latest`` naming the previous good checkpoint.

Loading verifies the sidecar's checksum before unpickling anything and unpickles with
``torch.load(..., weights_only=True)`` (tensors and plain data only: a tampered file cannot run
code). Saving refuses a state that such loading would reject: the mistake shows at once.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from tandem.files import (
    file_digest,
    fsync_dir,
    rename_into_place,
    unlink_quietly,
    write_atomic,
    write_temp,
    write_temp_digested,
)

FORMAT_VERSION: int = 1

CHECKPOINTS_DIR = "checkpoints"
LATEST = "latest"
_SIDECAR = ".sha256"
_NAME = re.compile(r"ckpt-e(\d+)-s(\d+)\.pt")
_PAYLOAD_KEYS = ("format_version", "epoch", "step", "state")


def checkpoint_name(epoch: int, step: int) -> str:
    """The name, without ``.pt``, of the checkpoint of ``epoch`` and ``step``.

    Example::

        >>> checkpoint_name(3, 1200)
        'ckpt-e0003-s00001200'
    """
    return f"ckpt-e{epoch:04d}-s{step:08d}"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be loaded; the message names the file and what is wrong with it."""


def save_checkpoint(
    state: dict[str, Any], run_dir: str | Path, *, epoch: int, step: int, keep: int = 3
) -> Path:
    """Write ``state`` as ``run_dir/checkpoints/ckpt-e{epoch:04d}-s{step:08d}.pt`` atomically.

    One rank only (no communication). The order of writes is the module doc's; then all but the
    newest ``keep`` are deleted. Saving the same epoch and step again replaces that checkpoint.

    Args:
        state: nested dicts, lists and tuples of tensors, ints, floats, bools, strings and None
            (``state_dict()``s); tensors are loaded onto the CPU.
        run_dir: the run's directory; created if missing.
        epoch: epoch number, ``>= 0``.
        step: global step number, ``>= 0``.
        keep: how many checkpoints to keep, ``>= 1``.

    Returns:
        The path of the checkpoint written.

    Raises:
        ValueError: bad arguments, or ``state`` holds an object that ``weights_only`` loading
            would refuse (nothing is written then).
        OSError: the file system refused a write; the message names the file or directory.

    Example::

        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        save_checkpoint(state, "runs/exp1", epoch=3, step=1200, keep=3)
    """
    _check_args(state, epoch, step, keep)
    ckpt_dir = Path(run_dir) / CHECKPOINTS_DIR
    name = checkpoint_name(epoch, step) + ".pt"
    path = ckpt_dir / name
    payload = {"format_version": FORMAT_VERSION, "epoch": epoch, "step": step, "state": state}
    try:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        # Steps 1 and 2: the checkpoint and its sidecar.
        digest = write_committed(payload, path)
        record = {"checkpoint": name, "epoch": epoch, "step": step, "sha256": digest}
        pointer = (json.dumps(record) + "\n").encode()
        try:
            # Step 3: the pointer, last. Its directory fsync is outside the rollback: once
            # renamed, `latest` may name the new checkpoint, which must then stay.
            pointer_tmp = write_temp(ckpt_dir, LATEST, lambda f: f.write(pointer))
            rename_into_place(pointer_tmp, ckpt_dir / LATEST)
        except BaseException:
            # `latest` was not renamed, so it names the previous checkpoint; the new one, whole
            # or not, would only confuse the next save's pruning.
            unlink_quietly(sidecar_of(path))
            unlink_quietly(path)
            raise
        fsync_dir(ckpt_dir)
    except OSError as e:
        raise _with_context(e, f"cannot save checkpoint {path}") from e
    _prune(ckpt_dir, keep, pinned=path)
    return path


def write_committed(payload: dict[str, Any], path: Path) -> str:
    """Steps 1 and 2 of every save (Trainer's and ``tandem.checkpoint``'s): ``path``, then its
    sidecar, which commits it; the file's sha256. One saved over is uncommitted first (its
    sidecar goes before the rename); on any failure neither file is left.

    Raises:
        ValueError: ``payload`` holds what ``weights_only`` loading refuses (nothing written).
        OSError: the file system refused a write.

    Example::

        digest = write_committed({"format": "tandem.checkpoint/1", ...}, Path("ckpt/a.pt"))
    """
    sidecar = sidecar_of(path)
    # Hashed as written (one pass over the bytes), not read back after the fsync: that read
    # came from the page cache, the same memory the write had just filled, so it checked
    # nothing the write's own bytes do not; the disk's copy is what load verifies.
    tmp, digest = write_temp_digested(path.parent, path.name, lambda f: torch.save(payload, f))
    try:
        check_loadable(tmp, path)
        unlink_quietly(sidecar)
    except BaseException:
        unlink_quietly(tmp)
        raise
    try:
        rename_into_place(tmp, path)
        fsync_dir(path.parent)
        write_atomic(sidecar, f"{digest}  {path.name}\n".encode())
    except BaseException:
        unlink_quietly(sidecar)
        unlink_quietly(path)
        raise
    return digest


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Verify and load a checkpoint; no pickled code can run.

    Args:
        path: a run directory (its ``checkpoints/latest`` is followed), a checkpoints directory,
            its ``latest`` file, or a checkpoint file.

    Returns:
        ``{"format_version", "epoch", "step", "state"}``, tensors on the CPU.

    Raises:
        CheckpointError: no checkpoint there, a missing or mismatched checksum (a corrupt or
            truncated file), objects that ``weights_only`` loading refuses, or a format
            version newer than this tandem reads; named, with the checkpoints beside it.

    Example::

        ckpt = load_checkpoint("runs/exp1")
        model.load_state_dict(ckpt["state"]["model"])
    """
    file = _resolve(Path(path))
    payload = read_sealed(file, _others_hint(file))
    _check_payload(file, payload)
    return {key: payload[key] for key in _PAYLOAD_KEYS}


def read_sealed(file: Path, hint: str = "") -> Any:
    """The payload of a committed file, once its sidecar's checksum matched; no pickled code runs.

    Both on-disk formats (the Trainer's checkpoints and :func:`tandem.checkpoint.save`'s files)
    are read here. ``hint`` ends each error message (for example the checkpoints beside it).

    Raises:
        CheckpointError: a missing or mismatched checksum, objects that ``weights_only``
            loading refuses, or a file torch cannot read.

    Example::

        payload = read_sealed(Path("runs/exp1/checkpoints/ckpt-e0001-s00000100.pt"))
    """
    verify_checksum(file)
    try:
        return torch.load(file, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"checkpoint {file} holds objects other than tensors and plain data; refused to "
            f"unpickle them, since that could run code ({first_line(e)}).{hint}"
        ) from e
    except Exception as e:
        raise CheckpointError(f"checkpoint {file} cannot be read: {e}{hint}") from e


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """The committed checkpoints of a run (those with a sidecar), oldest first.

    Ordered by (epoch, step) as numbers. Temporary files and checkpoints of saves that did not
    finish are not listed.

    Args:
        run_dir: a run directory or its ``checkpoints`` directory; missing means none.

    Example::

        for path in list_checkpoints("runs/exp1"):
            print(path.name)
    """
    ckpt_dir = _checkpoints_dir(Path(run_dir))
    if not ckpt_dir.is_dir():
        return []
    keyed = [(_key(e.name), e) for e in ckpt_dir.iterdir() if sidecar_of(e).is_file()]
    return [e for _, e in sorted((k, e) for k, e in keyed if k is not None)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint ``latest`` names, or the newest listed one if there is no pointer.

    The path is returned even if that file has gone missing, so that loading it reports the
    problem instead of a run silently starting from scratch.

    Args:
        run_dir: a run directory or its ``checkpoints`` directory.

    Returns:
        The checkpoint's path, or None when the run has no checkpoints.

    Raises:
        CheckpointError: the ``latest`` file is unreadable or malformed.

    Example::

        if (path := latest_checkpoint(run_dir)) is not None:
            state = load_checkpoint(path)["state"]
    """
    ckpt_dir = _checkpoints_dir(Path(run_dir))
    pointer = ckpt_dir / LATEST
    if not pointer.exists():
        listed = list_checkpoints(ckpt_dir)
        return listed[-1] if listed else None
    try:
        name = json.loads(pointer.read_text())["checkpoint"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"checkpoint pointer {pointer} is unreadable ({e!r}); pass a checkpoint file to "
            f"load_checkpoint instead. Committed checkpoints: {_names(list_checkpoints(ckpt_dir))}"
        ) from e
    # The pointer names a file in its own directory; anything else is not ours to follow.
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise CheckpointError(f"checkpoint pointer {pointer} names {name!r}, not a checkpoint")
    return ckpt_dir / name


def _check_args(state: Any, epoch: Any, step: Any, keep: Any) -> None:
    if not isinstance(state, dict):
        raise ValueError(f"state must be a dict, got {type(state).__name__}")
    for label, value, least in (("epoch", epoch, 0), ("step", step, 0), ("keep", keep, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{label} must be an int >= {least}, got {value!r}")


def _checkpoints_dir(path: Path) -> Path:
    return path / CHECKPOINTS_DIR if (path / CHECKPOINTS_DIR).is_dir() else path


def sidecar_of(path: Path) -> Path:
    """The checksum file that commits ``path``: ``<path>.sha256``."""
    return path.with_name(path.name + _SIDECAR)


def _resolve(path: Path) -> Path:
    if path.is_dir():
        found = latest_checkpoint(path)
        if found is None:
            raise CheckpointError(f"no checkpoints in {_checkpoints_dir(path)}")
        path = found
    elif path.name == LATEST and path.is_file():
        found = latest_checkpoint(path.parent)
        assert found is not None  # the pointer exists, so a name or an error came back
        path = found
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist.{_others_hint(path)}")
    return path


def verify_checksum(file: Path) -> None:
    """CheckpointError unless ``file`` hashes to what its sidecar records."""
    sidecar = sidecar_of(file)
    try:
        expected = sidecar.read_text().split()[0].lower()
    except (OSError, IndexError) as e:
        raise CheckpointError(
            f"checkpoint {file} has no readable checksum file {sidecar.name} ({e!r}); its save "
            f"did not finish or the file was copied without it.{_others_hint(file)}"
        ) from e
    actual = file_digest(file, "sha256")
    if actual != expected:
        raise CheckpointError(
            f"checkpoint {file} is corrupt or truncated: its {file.stat().st_size} bytes hash to "
            f"sha256 {actual}, {sidecar.name} records {expected}.{_others_hint(file)}"
        )


def _check_payload(file: Path, payload: Any) -> None:
    if not isinstance(payload, dict) or any(k not in payload for k in _PAYLOAD_KEYS):
        keys = sorted(map(str, payload)) if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointError(
            f"checkpoint {file} is not a tandem checkpoint: expected keys {list(_PAYLOAD_KEYS)}, "
            f"found {keys}"
        )
    version = payload["format_version"]
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CheckpointError(f"checkpoint {file} has an invalid format_version {version!r}")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {file} has format version {version}, written by a newer tandem; this "
            f"one reads versions up to {FORMAT_VERSION}: upgrade tandem to load it"
        )


def _others_hint(file: Path) -> str:
    """Which other checkpoints sit beside ``file``, and how to load the best of them."""
    others = [p for p in list_checkpoints(file.parent) if p.name != file.name]
    if not others:
        return f" No other checkpoints in {file.parent}."
    key = _key(file.name)
    earlier = [p for p in others if key is None or (_key(p.name) or (-1, -1)) < key]
    best = (earlier or others)[-1]
    return (
        f" Other checkpoints in {file.parent}: {_names(others)}; load one by its path, e.g. "
        f"load_checkpoint({str(best)!r})."
    )


def _key(name: str) -> tuple[int, int] | None:
    """(epoch, step) of a checkpoint's file name, None for any other name."""
    match = _NAME.fullmatch(name)
    return (int(match[1]), int(match[2])) if match else None


def _names(paths: list[Path]) -> str:
    return ", ".join(p.name for p in paths) or "none"


def check_loadable(tmp: Path, path: Path) -> None:
    """ValueError unless ``weights_only`` loading takes ``tmp`` (to be saved as ``path``)."""
    # The loader's own rule is the test: mmap keeps this cheap, tensors are not read.
    try:
        loaded = torch.load(tmp, weights_only=True, mmap=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        raise ValueError(
            f"state for checkpoint {path} holds an object that torch.load(weights_only=True) "
            f"refuses, so it could never be loaded: {first_line(e)}. Store plain data (e.g. "
            "a state_dict() or a tensor) or register the class with "
            "torch.serialization.add_safe_globals"
        ) from e
    del loaded  # drop the mapping before the file is renamed


def _prune(ckpt_dir: Path, keep: int, pinned: Path) -> None:
    """Delete all but the newest ``keep`` checkpoints, and leftovers of crashed saves (our
    temporary files, files without a sidecar, sidecars without a file: one process saves into a
    run directory at a time, so none is a save in progress). ``pinned``, which ``latest`` now
    names, stays even if older ones sort after it (a run resumed from an earlier checkpoint).
    Failures only warn: the new checkpoint is committed, training should not die over them."""
    listed = list_checkpoints(ckpt_dir)
    doomed = [p for p in listed[: max(len(listed) - keep, 0)] if p != pinned]
    try:
        for path in doomed:
            os.unlink(sidecar_of(path))  # uncommit first, so a crash here leaves no half pair
            os.unlink(path)
        committed = {p.name for p in listed}
        for entry in ckpt_dir.iterdir():
            name = entry.name
            uncommitted = _key(name) and name not in committed
            stem = name.removesuffix(_SIDECAR)
            orphan_sidecar = stem != name and _key(stem) and not (ckpt_dir / stem).exists()
            temp = name.startswith((".ckpt-", f".{LATEST}.")) and name.endswith(".tmp")
            if uncommitted or orphan_sidecar or temp:
                os.unlink(entry)
    except OSError as e:
        warnings.warn(f"could not delete old checkpoint files in {ckpt_dir}: {e}", stacklevel=3)


def _with_context(e: OSError, what: str) -> OSError:
    """The same kind of OSError (errno kept, so ENOSPC stays ENOSPC), saying what we were doing."""
    try:
        if e.errno is not None:
            return type(e)(e.errno, f"{what}: {e.strerror}", e.filename)
        return type(e)(f"{what}: {e}")
    except TypeError:  # a subclass with its own constructor
        return OSError(f"{what}: {e}")


def first_line(e: BaseException) -> str:
    """The line of an unpickling error that names what was refused."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return next((line for line in lines if "Unsupported" in line), lines[0] if lines else repr(e))
