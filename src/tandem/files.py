"""Files that are either whole or absent: atomic writes, directory fsyncs, streamed digests.

Checkpoints and staged data sets both need "write a temporary file in the same directory,
fsync it, rename it over the final name, fsync the directory" and a hash of what is on disk.

Example::

    write_atomic(run_dir / "latest", b"ckpt-e0003-s00000120.pt")
    digest = file_digest(path, "sha256")
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

_CHUNK = 4 << 20


def file_digest(path: Path, algorithm: str) -> str:
    """Hex digest of the file's bytes as read back from disk, streamed in chunks."""
    digest = hashlib.new(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_temp(directory: Path, name: str, write: Callable[[IO[bytes]], object]) -> Path:
    """A new file in ``directory`` holding what ``write`` wrote, flushed and fsynced.

    ``write``'s return value is ignored (``lambda f: f.write(data)`` returns a count).
    """
    # Same directory as the final name: os.replace is atomic only within one file system.
    # The leading dot and .tmp suffix keep it out of listings of the real files.
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        unlink_quietly(Path(tmp))
        raise
    return Path(tmp)


def rename_into_place(tmp: Path, final: Path) -> None:
    """``os.replace(tmp, final)``; on failure the temporary file is removed."""
    try:
        os.replace(tmp, final)
    except BaseException:
        unlink_quietly(tmp)
        raise


def fsync_dir(directory: Path) -> None:
    """Make the directory's entries (renames) durable."""
    # A rename lives in the directory's entries: without this a power loss can forget it even
    # though the file's bytes were synced. Windows cannot open a directory to fsync it.
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``: readers see the old file or the new one, never a part."""
    rename_into_place(write_temp(path.parent, path.name, lambda f: f.write(data)), path)
    fsync_dir(path.parent)


def unlink_quietly(path: Path) -> None:
    """Remove ``path`` if it can be removed; ignore it otherwise."""
    with contextlib.suppress(OSError):
        os.unlink(path)
