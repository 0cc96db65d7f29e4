"""A data set in one LMDB file: convert once, then read from every rank and DataLoader worker.

Many small files on a shared file system are slow to open from hundreds of processes; one LMDB
file is memory-mapped, read without locks and without copying through a server. The file holds:

    8-byte big-endian index  ->  the sample, encoded by :mod:`tandem.data.lmdb_codec` (no pickle)
    b"__len__"               ->  the number of samples, in ASCII decimal
    b"__format__"            ->  FORMAT, so that a future layout is recognised and refused

Big-endian fixed-width keys sort in index order, so LMDB's B-tree is filled by appends, and the
metadata keys (7 and 10 bytes) can never equal a sample key (8 bytes).

Neither torch nor numpy is imported at module import: the ``tandem lmdb`` command line
(:mod:`tandem.cli.lmdb`) imports this module and starts in milliseconds.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from tandem._optional import require
from tandem.data.lmdb_codec import decode_sample, encode_sample
from tandem.files import fsync_dir, rename_into_place

FORMAT = b"tandem-lmdb/1"
LEN_KEY = b"__len__"
FORMAT_KEY = b"__format__"
KEY_BYTES = 8

# A first guess, doubled whenever LMDB reports the map full. On Linux the map is only reserved
# address space: the file grows with what is written, not with map_size.
DEFAULT_MAP_SIZE = 64 << 20


def _key(index: int) -> bytes:
    return index.to_bytes(KEY_BYTES, "big")


def convert_to_lmdb(
    dataset: Any,
    path: str | os.PathLike[str],
    *,
    map_size: int | None = None,
    progress: bool = True,
    commit_every: int = 1000,
) -> Path:
    """Write every sample of a map-style data set into one LMDB file at ``path``.

    The file is written next to ``path`` under a temporary name and renamed into place at the
    end, so a conversion that fails (or is killed) leaves no file at ``path``, and an existing
    file there is replaced only by a complete one. (A killed conversion leaves its temporary
    ``.NAME.PID.tmp`` behind; one that raises removes it.)

    Args:
        dataset: anything with ``__len__`` and ``__getitem__(i)`` for ``i`` in ``range(len)``;
            samples are tensors, numpy arrays and scalars, Python numbers, strings, bytes and
            None, nested in tuples, lists and dicts (see :mod:`tandem.data.lmdb_codec`).
        path: the LMDB file to write (a single file, not a directory).
        map_size: the first LMDB map size in bytes (default 64 MiB); it is doubled as often as
            the data needs, so this only saves a few retries.
        progress: show a tqdm progress bar on stderr (``pip install "tandem[progress]"``).
        commit_every: samples per write transaction: larger is faster, smaller retries less
            when the map grows.

    Returns:
        ``path``, as a :class:`~pathlib.Path`.

    Raises:
        ImportError: lmdb is not installed (``pip install "tandem[lmdb]"``), or tqdm with
            ``progress=True``.
        ValueError: ``dataset`` has no length, ``path`` is a directory, a sample holds a type
            that cannot be stored (the message names the sample and where in it), or
            ``map_size``/``commit_every`` is not positive.

    Example::

        convert_to_lmdb(torchvision.datasets.MNIST("data", download=True), "mnist.lmdb")
        ds = LMDBDataset("mnist.lmdb")
    """
    lmdb = require("lmdb", extra="lmdb")

    path = Path(path)
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise ValueError(
            f"convert_to_lmdb needs a map-style data set (__len__ and __getitem__), "
            f"got a {type(dataset).__qualname__}"
        )
    if path.is_dir():
        raise ValueError(f"{path} is a directory; convert_to_lmdb writes a single file")
    if commit_every < 1:
        raise ValueError(f"commit_every={commit_every} must be >= 1")
    if map_size is not None and map_size < 1:
        raise ValueError(f"map_size={map_size} must be > 0 bytes")
    length = len(dataset)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    # No fsync per commit: the file is only trusted after the sync and rename at the end.
    env = lmdb.open(
        str(tmp),
        map_size=map_size or DEFAULT_MAP_SIZE,
        subdir=False,
        lock=False,
        sync=False,
        metasync=False,
        mode=0o644,
    )
    try:
        pending: list[tuple[bytes, bytes]] = []
        with _progress_bar(length, path.name, progress) as bar:
            for index in range(length):
                try:
                    pending.append((_key(index), encode_sample(dataset[index])))
                except ValueError as exc:
                    raise ValueError(f"sample {index} of {length}: {exc}") from exc
                bar.update()
                if len(pending) >= commit_every:
                    _put_all(env, pending)
                    pending = []
            pending += [(LEN_KEY, str(length).encode()), (FORMAT_KEY, FORMAT)]
            _put_all(env, pending)
        env.sync(True)
        env.close()
        rename_into_place(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        env.close()
        tmp.unlink(missing_ok=True)
        raise
    return path


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass


def _progress_bar(total: int, desc: str, enabled: bool) -> AbstractContextManager[Any]:
    """tqdm's bar on stderr; with ``enabled`` False, one that shows nothing and needs no tqdm."""
    if not enabled:
        return nullcontext(_NoBar())
    tqdm = require("tqdm", extra="progress").tqdm
    return tqdm(total=total, unit="sample", desc=desc, file=sys.stderr)


def _put_all(env: Any, items: list[tuple[bytes, bytes]]) -> None:
    """Write ``items`` in one transaction, growing the map until they fit."""
    lmdb = require("lmdb", extra="lmdb")

    while True:
        try:
            with env.begin(write=True) as txn:
                for key, value in items:
                    txn.put(key, value)
            return
        except lmdb.MapFullError:
            # The transaction was aborted by the `with`; the map may only be resized with no
            # transaction open. At least double it, and make room for this batch twice over
            # (B-tree pages and overflow pages round every value up).
            size = env.info()["map_size"]
            batch = sum(len(k) + len(v) for k, v in items)
            env.set_mapsize(max(2 * size, size + 2 * batch))


# One environment per file per process. LMDB forbids opening a file twice in one process
# (py-lmdb refuses the second open), so every LMDBDataset on a file shares it; and a forked child
# must not use its parent's, so an entry from another pid is closed (harmless: without the lock
# file there are no locks or reader slots to release) and replaced. Keyed by (st_dev, st_ino):
# a file replaced at the same path by a new conversion is another file.
_ENVS: dict[tuple[int, int], tuple[int, Any]] = {}
_ENVS_LOCK = threading.Lock()


def _new_lock_after_fork() -> None:
    # A fork while another thread held the lock would leave it held forever in the child.
    global _ENVS_LOCK
    _ENVS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_after_fork)


def _data_file(path: Path, subdir: bool) -> Path:
    return path / "data.mdb" if subdir else path


def _identity(path: Path, subdir: bool) -> tuple[int, int]:
    st = _data_file(path, subdir).stat()
    return st.st_dev, st.st_ino


def _open_env(path: Path, subdir: bool) -> Any:
    lmdb = require("lmdb", extra="lmdb")

    try:
        return lmdb.open(
            str(path),
            subdir=subdir,
            readonly=True,
            lock=False,
            readahead=False,
            meminit=False,
            create=False,
        )
    except lmdb.Error as exc:
        raise ValueError(f"cannot open {path} as an LMDB file: {exc}") from exc


def _own_env(key: tuple[int, int]) -> Any:
    """This process's open environment of the file ``key``, or None. Call with _ENVS_LOCK."""
    entry = _ENVS.get(key)
    if entry is not None and entry[0] != os.getpid():
        # The parent's, inherited through fork. Closed, not dropped: py-lmdb keeps the file
        # marked "open in this process" until then, and would refuse to open it again.
        entry[1].close()
        del _ENVS[key]
        entry = None
    return entry[1] if entry is not None else None


def _shared_env(path: Path, subdir: bool, key: tuple[int, int]) -> Any:
    """This process's environment of the file ``key``, opened on first use."""
    with _ENVS_LOCK:
        env = _own_env(key)
        if env is not None:
            return env
        env = _open_env(path, subdir)
        if _identity(path, subdir) != key:
            env.close()
            raise ValueError(
                f"{path} was replaced since this LMDBDataset was created; create a new one"
            )
        _ENVS[key] = (os.getpid(), env)
        return env


class LMDBDataset:
    """Read a data set that :func:`convert_to_lmdb` wrote, from any number of processes.

    The file is opened on first access in each process, read-only and without LMDB's lock
    file, so readers never write to the file system and any number read at once. A forked
    DataLoader worker opens its own environment instead of using its parent's; a pickled copy
    (spawned workers) carries only the path. All LMDBDataset objects on one file in one
    process share one environment. Writing to the file while it is read is not supported:
    convert into a new file, which replaces the old one atomically (data sets created on the
    old file keep reading it in processes that opened it; others raise ValueError).

    Args:
        path: the LMDB file (or an LMDB directory holding ``data.mdb``).
        transform: applied to each decoded sample, e.g. a torchvision transform.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ImportError: lmdb is not installed (``pip install "tandem[lmdb]"``).
        ValueError: ``path`` is not an LMDB file, or not one :func:`convert_to_lmdb` wrote.

    Example::

        ds = LMDBDataset("train.lmdb", transform=lambda s: (s["image"].float() / 255, s["label"]))
        loader = DataLoader(ds, batch_size=64, num_workers=8,
                            sampler=tandem.data.DistributedSampler(ds))
    """

    def __init__(
        self, path: str | os.PathLike[str], transform: Callable[[Any], Any] | None = None
    ) -> None:
        self.path = Path(path)
        self.transform = transform
        if not self.path.exists():
            raise FileNotFoundError(f"LMDB data set {self.path} does not exist")
        self._subdir = self.path.is_dir()
        try:
            self._key = _identity(self.path, self._subdir)
        except FileNotFoundError:
            raise ValueError(f"{self.path} is a directory without an LMDB data.mdb") from None
        with _ENVS_LOCK:
            shared = _own_env(self._key)
        # Without an environment in this process, one is opened for the metadata only and
        # closed: the object is usually built in the parent and forked or pickled to workers.
        env = shared or _open_env(self.path, self._subdir)
        try:
            with env.begin() as txn:
                version, length = txn.get(FORMAT_KEY), txn.get(LEN_KEY)
        finally:
            if shared is None:
                env.close()
        if version != FORMAT or length is None:
            raise ValueError(
                f"{self.path} is an LMDB file but not a tandem data set: format key "
                f"{version!r}, expected {FORMAT!r} (write it with convert_to_lmdb)"
            )
        self._len = int(length)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> Any:
        import operator

        i = operator.index(index)
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"index {index} out of range for {self._len} samples in {self.path}")
        env = _shared_env(self.path, self._subdir, self._key)
        sample = self._read(env, i)
        return self.transform(sample) if self.transform is not None else sample

    def _read(self, env: Any, i: int) -> Any:
        lmdb = require("lmdb", extra="lmdb")

        try:
            with env.begin(buffers=True) as txn:
                data = txn.get(_key(i))
                if data is None:
                    raise ValueError(f"no key for sample {i} although __len__ is {self._len}")
                # decode copies out of the memory map: the buffer may end with the transaction.
                return decode_sample(data)
        except (lmdb.Error, ValueError) as exc:
            raise ValueError(f"{self.path} is corrupt: sample {i}: {exc}") from exc

    def close(self) -> None:
        """Close this process's environment of the file (for every LMDBDataset on it; the next
        access opens it again)."""
        with _ENVS_LOCK:
            entry = _ENVS.pop(self._key, None)
        if entry is not None:
            entry[1].close()

    def __repr__(self) -> str:
        return f"LMDBDataset({str(self.path)!r}, {self._len} samples)"
