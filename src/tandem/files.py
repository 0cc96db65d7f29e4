"""Files that are either whole or absent: atomic writes, directory fsyncs, streamed digests.

Checkpoints and staged data sets both need "write a temporary file in the same directory,
fsync it, rename it over the final name, fsync the directory" and a hash of what is on disk.

A large file whose digest is wanted is hashed as it is written (:func:`write_temp_digested`):
each chunk of the bytes handed to ``write`` is hashed, then written, while it is still in the
CPU's cache, so the bytes cross memory once instead of again when the file is read back to hash
it. The two digests are the same: the file holds exactly the bytes written, in order (a write
either takes all of its bytes or raises). A thread may also ask its writes to be paced
(:func:`paced`): a bound on the bytes per second it copies, so that a background write leaves
the memory bandwidth to the work beside it.

Example::

    write_atomic(run_dir / "latest", b"ckpt-e0003-s00000120.pt")
    digest = file_digest(path, "sha256")
    tmp, digest = write_temp_digested(directory, "ckpt.pt", lambda f: torch.save(state, f))
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import IO

_CHUNK = 4 << 20

#: The bytes :class:`DigestingFile` hashes and writes at a time: small enough to stay in the
#: CPU's cache between the hash reading them and the write copying them into the page cache.
WRITE_CHUNK = 1 << 20

# The pace (bytes per second) of this thread's digested writes; None: as fast as they go.
_PACE: ContextVar[float | None] = ContextVar("tandem_files_pace", default=None)


def file_digest(path: Path, algorithm: str) -> str:
    """Hex digest of the file's bytes as read back from disk, streamed in chunks."""
    digest = hashlib.new(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def paced(bytes_per_s: float | None) -> Iterator[None]:
    """Within it, this thread's :func:`write_temp_digested` writes at most ``bytes_per_s``
    (on average from the file's first byte; None: no bound). Other threads are not affected.

    Example::

        with paced(200e6):                     # a background write: 200 MB/s at most
            tmp, digest = write_temp_digested(directory, "a.pt", write)
    """
    if bytes_per_s is not None and not bytes_per_s > 0:
        raise ValueError(f"bytes_per_s must be > 0 or None, got {bytes_per_s!r}")
    token = _PACE.set(bytes_per_s)
    try:
        yield
    finally:
        _PACE.reset(token)


class DigestingFile:
    """A file being written whose bytes are hashed as they are written, chunk by chunk.

    Only ``write`` and ``flush`` are offered: a seek would make the digest differ from the
    file's bytes, so a writer that needs one fails at once (AttributeError) rather than
    producing a wrong digest.

    Example::

        with open(path, "wb") as raw:
            f = DigestingFile(raw, "sha256")
            torch.save(state, f)
        assert f.hexdigest() == file_digest(path, "sha256")
    """

    def __init__(
        self,
        file: IO[bytes],
        algorithm: str,
        chunk: int | None = None,
        bytes_per_s: float | None = None,
    ) -> None:
        chunk = WRITE_CHUNK if chunk is None else chunk
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1 byte, got {chunk}")
        self._file = file
        self._digest = hashlib.new(algorithm)
        self._chunk = chunk
        self._rate = bytes_per_s
        self._began = time.monotonic()
        self.written = 0  # bytes handed to the file so far
        self.failed: OSError | None = None  # the file's refusal of a write, if it refused one

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), self._chunk):
            piece = view[start : start + self._chunk]
            # Hash first, then write: the write's copy then reads the piece from the cache.
            self._digest.update(piece)
            try:
                self._file.write(piece)
            except OSError as e:
                self.failed = e
                raise
            self.written += len(piece)
            if self._rate is not None:
                self._pace()
        return len(view)

    def _pace(self) -> None:
        assert self._rate is not None
        # Sleep until the average rate is back at the bound: the write's copies come in short
        # bursts with gaps between, so the work beside it never loses the memory bus for long.
        ahead = self.written / self._rate - (time.monotonic() - self._began)
        if ahead > 0:
            time.sleep(ahead)

    def flush(self) -> None:
        self._file.flush()

    def hexdigest(self) -> str:
        """The hex digest of every byte written so far."""
        return self._digest.hexdigest()


def write_temp_digested(
    directory: Path, name: str, write: Callable[[IO[bytes]], object], algorithm: str = "sha256"
) -> tuple[Path, str]:
    """:func:`write_temp`, with the digest of the file's bytes, hashed as they were written.

    ``write`` gets a :class:`DigestingFile` (``write`` and ``flush`` only), paced if this
    thread asked for it (:func:`paced`). The digest equals :func:`file_digest` of the file.
    A write the file refused (the disk full) is raised as that OSError.

    Example::

        tmp, digest = write_temp_digested(directory, "ckpt.pt", lambda f: torch.save(state, f))
        rename_into_place(tmp, directory / "ckpt.pt")
    """
    digested: list[DigestingFile] = []

    def counted(f: IO[bytes]) -> None:
        digesting = DigestingFile(f, algorithm, bytes_per_s=_PACE.get())
        digested.append(digesting)
        write(digesting)  # type: ignore[arg-type]  # a file that only writes and flushes

    try:
        tmp = write_temp(directory, name, counted)
    except Exception:
        failed = digested[0].failed if digested else None
        if failed is not None:
            # The disk's refusal, not what it leads to: torch.save, unwinding, finishes its
            # zip file anyway and fails on that ("unexpected pos"), hiding ENOSPC behind it.
            raise failed  # noqa: B904 (the writer's error, chained to the one it caused)
        raise
    return tmp, digested[0].hexdigest()


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
