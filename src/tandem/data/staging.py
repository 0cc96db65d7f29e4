"""Copy a data set to node-local disk once per node, and reuse the copy while it is identical.

Reading a data set from a shared file system in every epoch, from every rank of every node, is
what makes that file system slow for everybody; one copy per node to local scratch (NVMe,
``/tmp``, ``$SLURM_TMPDIR``) costs one read. Local rank 0 of each node copies; the other
processes on the node wait for it and then read the same copy.

Next to the copy ``dest_dir/NAME`` lies its manifest ``dest_dir/.NAME.tandem-stage.json``: every
file's relative path, size, modification time and BLAKE2b hash. The copy is written under a
temporary name, its hashes are checked against those read from the source, it is renamed into
place, and only then is the manifest written: a copy without a manifest (interrupted, or being
written) is never taken for a complete one, and is redone.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from tandem.files import file_digest, fsync_dir, write_atomic

MANIFEST_VERSION = 1
_CHUNK = 4 << 20
_HASH = "blake2b"  # the manifest's content hash; the copy loop hashes with the same


def stage_local(
    src: str | os.PathLike[str],
    dest_dir: str | os.PathLike[str],
    *,
    local_rank: int | None = None,
    local_world_size: int | None = None,
    group: Any = None,
    timeout: float = 3600.0,
    quick: bool = False,
) -> Path:
    """Copy ``src`` (a file or a directory tree) into ``dest_dir`` once per node; return the copy.

    Local rank 0 compares the source with the manifest of an existing copy and copies only when
    they differ (or there is no complete copy); the other local ranks wait for it.

    - With ``torch.distributed`` initialized, **every rank of** ``group`` (default: all ranks)
      must call ``stage_local``: they meet in a collective after local rank 0 has copied, and if
      any of them failed (a local rank 0's copy, a bad argument), every rank raises instead of
      hanging.
    - Without a process group, the other local ranks poll for a manifest that matches the
      source (by sizes and modification times) and the copy's files, for ``timeout`` seconds.
    - One process on the node copies and returns.

    ``dest_dir`` must be local to the node (or at least not shared with another node's local
    rank 0, which would copy into it at the same time).

    Args:
        src: the file or directory to stage.
        dest_dir: the node-local directory that receives ``src``'s copy, under ``src``'s name.
        local_rank: this process's rank on its node (default: from torchrun, SLURM or OpenMPI
            variables, else 0).
        local_world_size: processes on this node (default: from the same variables, else 1).
        group: the process group to meet in (default: the default group). Every member calls.
        timeout: seconds the other local ranks wait without a process group.
        quick: trust sizes and modification times: a source file that matches the manifest in
            both is not read again to hash it (rsync's quick check). By default every source
            file is hashed, so a change that kept size and time is caught too.

    Returns:
        The local copy, ``Path(dest_dir) / Path(src).name``.

    Raises:
        FileNotFoundError: ``src`` does not exist.
        ValueError: ``src`` is the copy itself, or ``local_rank`` is outside
            ``[0, local_world_size)``.
        RuntimeError: the copy does not match the source after copying, or (with a process
            group) another rank of the group failed: every rank raises, none waits forever.
        TimeoutError: without a process group, local rank 0 did not finish within ``timeout``.

    Example::

        tandem.init()
        data = tandem.data.stage_local("/shared/imagenet.lmdb", os.environ["SLURM_TMPDIR"])
        ds = tandem.data.LMDBDataset(data)
    """
    src, dest_dir = Path(src), Path(dest_dir)
    target = dest_dir / src.name
    distributed = _group_initialized()
    # With a process group every rank must reach the collective in _agree, even after its own
    # failure (a bad argument, a failed copy): otherwise the others would wait there forever.
    error: BaseException | None = None
    try:
        local_rank, local_world_size = _local_placement(local_rank, local_world_size)
        if not src.exists():
            raise FileNotFoundError(f"stage_local: source {src} does not exist")
        if target.resolve() == src.resolve():
            raise ValueError(f"stage_local: source {src} is already at its destination {target}")
        if local_rank == 0:
            _stage(src, target, quick)
        elif not distributed:
            _wait_for_copy(src, target, local_rank, timeout)
    except BaseException as exc:
        if not distributed:
            raise
        error = exc
    if distributed:
        _agree(src, group, failed=error is not None)
        if error is not None:
            raise error
    return target


def _local_placement(local_rank: int | None, local_world_size: int | None) -> tuple[int, int]:
    if local_rank is None or local_world_size is None:
        from tandem.job.placement import placement_from_env

        placement = placement_from_env(os.environ)
        local_rank = placement.local_rank if local_rank is None else local_rank
        if local_world_size is None:
            local_world_size = placement.local_world_size
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"local_rank {local_rank} not in [0, {local_world_size})")
    return local_rank, local_world_size


def _group_initialized() -> bool:
    # Checked without importing torch: a process that never imported it has no group.
    import sys

    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def _agree(src: Path, group: Any, failed: bool) -> None:
    """A barrier that also tells every rank which ranks failed to stage."""
    import torch
    import torch.distributed as dist

    from tandem._dist import backend_device, group_rank, group_size

    flags = torch.zeros(group_size(group), dtype=torch.int32, device=backend_device(group))
    flags[group_rank(group)] = int(failed)
    dist.all_reduce(flags, group=group)
    failed_ranks = flags.nonzero().flatten().tolist()
    if failed_ranks and not failed:
        raise RuntimeError(
            f"stage_local({src}) failed on rank(s) {failed_ranks} of the group (see their "
            "errors), so the local copy cannot be trusted"
        )


# ---- local rank 0: compare, copy, verify ------------------------------------------------------


def _manifest_path(target: Path) -> Path:
    return target.with_name(f".{target.name}.tandem-stage.json")


def _stage(src: Path, target: Path, quick: bool) -> None:
    manifest_path = _manifest_path(target)
    old = _read_manifest(manifest_path)
    if old is not None and _copy_intact(target, old):
        current = _manifest(src, old if quick else None)
        if current["dirs"] == old["dirs"] and not _differences(old, current):
            if current["entries"] != old["entries"]:
                # Same content, new modification times (a touch, a fresh checkout): record
                # them, since the waiting ranks match the manifest on times.
                write_atomic(manifest_path, _dump(current))
            return
    # The manifest goes first: from here on the old copy is incomplete to everybody.
    manifest_path.unlink(missing_ok=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    _remove(tmp)
    try:
        manifest = _copy(src, tmp)
        copied = _manifest(tmp, None)
        mismatched = _differences(manifest, copied)
        if mismatched:
            raise RuntimeError(
                f"stage_local: the copy of {src} in {tmp} differs from the source after copying "
                f"(files {mismatched[:5]}); is the source changing, or the disk failing?"
            )
        _remove(target)
        os.replace(tmp, target)  # a directory: files.rename_into_place is for files
        fsync_dir(target.parent)
    except BaseException:
        _remove(tmp)
        raise
    write_atomic(manifest_path, _dump(manifest))


def _dump(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, indent=1).encode()


def _files(root: Path) -> tuple[list[str], list[str]]:
    """Relative directory and file paths under ``root``, sorted; a file is ``["."]`` itself
    (pathlib drops the ".": ``root / "."`` is ``root``)."""
    if not root.is_dir():
        return [], ["."]
    dirs, files = [], []
    for parent, dirnames, filenames in os.walk(root, followlinks=True):
        rel = Path(parent).relative_to(root)
        dirs += [(rel / d).as_posix() for d in dirnames]
        files += [(rel / f).as_posix() for f in filenames]
    return sorted(dirs), sorted(files)


def _manifest(root: Path, previous: dict[str, Any] | None) -> dict[str, Any]:
    """Describe ``root``; with ``previous``, files whose size and mtime match it keep its hash."""
    known = {e[0]: e for e in previous["entries"]} if previous else {}
    dirs, files = _files(root)
    entries = []
    for rel in files:
        stat = (root / rel).stat()
        old = known.get(rel)
        if old is not None and old[1:3] == [stat.st_size, stat.st_mtime_ns]:
            entries.append(old)
        else:
            entries.append(
                [rel, stat.st_size, stat.st_mtime_ns, file_digest(root / rel, "blake2b")]
            )
    return {"version": MANIFEST_VERSION, "source": str(root), "dirs": dirs, "entries": entries}


def _copy(src: Path, tmp: Path) -> dict[str, Any]:
    """Copy ``src`` to ``tmp``, hashing what is read: the source is read once, not twice."""
    dirs, files = _files(src)
    if src.is_dir():
        tmp.mkdir(parents=True)
    for rel in dirs:
        (tmp / rel).mkdir(parents=True, exist_ok=True)
    entries = []
    for rel in files:
        source, dest = src / rel, tmp / rel
        stat = source.stat()  # before reading: a file changing during the copy looks changed
        digest = hashlib.new(_HASH)
        with open(source, "rb") as fin, open(dest, "wb") as fout:
            while chunk := fin.read(_CHUNK):
                digest.update(chunk)
                fout.write(chunk)
            fout.flush()
            os.fsync(fout.fileno())
        shutil.copymode(source, dest)
        entries.append([rel, stat.st_size, stat.st_mtime_ns, digest.hexdigest()])
    return {"version": MANIFEST_VERSION, "source": str(src), "dirs": dirs, "entries": entries}


def _differences(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """Relative paths whose size or hash differ (modification times of a copy always do)."""
    want = {e[0]: (e[1], e[3]) for e in expected["entries"]}
    have = {e[0]: (e[1], e[3]) for e in actual["entries"]}
    return sorted(rel for rel in want.keys() | have.keys() if want.get(rel) != have.get(rel))


def _copy_intact(target: Path, manifest: dict[str, Any]) -> bool:
    """The copy has every file of its manifest at its size (cheap: no reading)."""
    for rel, size, *_ in manifest["entries"]:
        try:
            if (target / rel).stat().st_size != size:
                return False
        except OSError:
            return False
    return all((target / d).is_dir() for d in manifest["dirs"])


def _read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("version") != MANIFEST_VERSION:
        return None
    return manifest


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


# ---- the other local ranks, without a process group -------------------------------------------


def _wait_for_copy(src: Path, target: Path, local_rank: int, timeout: float) -> None:
    """Poll until a manifest describes ``src`` as it is now and the copy is intact.

    Matching on sizes and modification times, not hashes, keeps the waiting ranks from reading
    the source. Local rank 0 replaces a copy only if its manifest does not describe the source
    (or, without ``quick``, a hash differs although size and time match: rare, and the reason to
    prefer calling this with a process group).
    """
    manifest_path = _manifest_path(target)
    deadline = time.monotonic() + timeout
    pause = 0.01
    while True:
        manifest = _read_manifest(manifest_path)
        if manifest is not None and _describes(manifest, src) and _copy_intact(target, manifest):
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"stage_local: local rank {local_rank} waited {timeout:g} s for local rank 0 "
                f"to copy {src} to {target} (no matching manifest {manifest_path}); is local "
                "rank 0 calling stage_local with the same arguments?"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.5)


def _describes(manifest: dict[str, Any], src: Path) -> bool:
    dirs, files = _files(src)
    if dirs != manifest["dirs"] or files != [e[0] for e in manifest["entries"]]:
        return False
    for rel, size, mtime_ns, _ in manifest["entries"]:
        try:
            stat = (src / rel).stat()
        except OSError:
            return False
        if (stat.st_size, stat.st_mtime_ns) != (size, mtime_ns):
            return False
    return True
