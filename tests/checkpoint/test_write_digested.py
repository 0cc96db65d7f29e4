"""Checkpoint files hashed as they are written: the same digest, the same bytes, never half a file.

Proves, in one process (and in child processes killed mid-write):

- :class:`tandem.files.DigestingFile`, by property test over file sizes (0 to 3 chunks and
  odd remainders), chunk sizes (1 byte to several KiB) and the ways the bytes are cut into
  write calls: the file holds exactly the bytes written, and the digest equals sha256 of the
  file read back from disk and of the bytes themselves;
- a checkpoint file, a shard file and a Trainer checkpoint written by the new path are byte
  for byte the files the old path wrote (``torch.save`` into a plain file, then the file read
  back to hash it), with the same sidecar: checkpoints written before load as they did, and
  the sidecar's digest is that of the disk's bytes;
- a torn chunk: a write refused half-way through a chunk (the disk full) raises an OSError
  naming the file, leaves no temporary file and commits nothing (no sidecar, ``latest``
  unchanged); a committed file one of whose chunks is changed or cut on disk afterwards is
  refused by the load as corrupt or truncated;
- a shard's directory removed by another rank's prune of uncommitted shards (still tidying
  after the previous background save) just before this rank's temporary file is in it: made
  again, and the shard written; a directory that keeps going raises, naming the file;
- a kill mid-write: a process SIGKILLed half-way through a chunk of its checkpoint's write
  (a synchronous Trainer save, and ``tandem.checkpoint.save(..., async_=True)``) leaves no
  loadable incomplete checkpoint: the Trainer's ``latest`` still names the previous one, which
  loads and equals what was saved; the half file is not listed and the next save removes it;
  the background save's file has no sidecar and refuses to load;
- pacing (:func:`tandem.files.paced`): a paced write takes at least its bytes over its rate,
  other threads are not paced, a background save is paced by ``WRITER.bytes_per_s``, and a
  rate that is not positive is a ValueError naming it.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import IO, Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tandem.checkpoint as ckpt
from tandem import files
from tandem.checkpoint import run_dir, shards
from tandem.checkpoint.async_save import WRITER
from tandem.checkpoint.run_dir import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    sidecar_of,
)
from tandem.checkpoint.sealed import read_verified, write_checkpoint_file
from tandem.files import DigestingFile, file_digest, paced, write_temp_digested

SRC = Path(__file__).resolve().parents[2] / "src"


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "w": torch.randn(300, 70),  # 84 000 bytes: many chunks of the sizes below
        "b": torch.arange(5, dtype=torch.int64),
        "half": torch.randn(33).half(),
        "plain": {"step": 3, "name": "x", "list": [1.5, None]},
    }


def _old_write(directory: Path, name: str, write: Any, algorithm: str = "sha256") -> Any:
    """The write before this one: torch.save into a plain file, then the file read back."""
    tmp = files.write_temp(directory, name, write)
    return tmp, file_digest(tmp, algorithm)


# -- the digest -------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(0, 3 * 4096 + 17),
    chunk=st.sampled_from([1, 7, 512, 4096, 4097, 65536]),
    cuts=st.lists(st.integers(0, 3 * 4096 + 17), max_size=6),
    seed=st.integers(0, 2**16),
)
def test_the_digest_of_a_chunked_write_is_that_of_the_file_read_back(
    tmp_path_factory, size, chunk, cuts, seed
):
    data = torch.randint(
        0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )
    raw = data.numpy().tobytes()
    bounds = sorted({0, size, *(c for c in cuts if c <= size)})
    directory = tmp_path_factory.mktemp("digest")

    def write(f: IO[bytes]) -> None:
        for a, b in itertools.pairwise(bounds):  # the bytes in write calls of several sizes
            assert f.write(memoryview(raw)[a:b]) == b - a
        f.write(b"")

    with files.paced(None):
        digesting: list[DigestingFile] = []

        def wrapped(f: IO[bytes]) -> None:
            digesting.append(DigestingFile(f, "sha256", chunk=chunk))
            write(digesting[0])  # type: ignore[arg-type]

        tmp = files.write_temp(directory, "f", wrapped)
    assert tmp.read_bytes() == raw
    assert digesting[0].written == size
    assert digesting[0].hexdigest() == file_digest(tmp, "sha256") == hashlib.sha256(raw).hexdigest()
    tmp2, digest = write_temp_digested(directory, "g", write)
    assert tmp2.read_bytes() == raw and digest == hashlib.sha256(raw).hexdigest()


def test_the_files_are_those_the_read_back_write_made_with_the_same_sidecars(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "WRITE_CHUNK", 4096)  # many chunks of a small state
    made: dict[str, list[bytes]] = {}
    for how in ("new", "old"):
        if how == "old":
            monkeypatch.setattr(run_dir, "write_temp_digested", _old_write)
            monkeypatch.setattr(shards, "write_temp_digested", _old_write)
        where = tmp_path / how
        api = where / "api.pt"
        write_checkpoint_file({"format": "tandem.checkpoint/1", "objects": _state()}, api)
        trainer = save_checkpoint(_state(), where / "run", epoch=1, step=2)
        digest = shards.write_shard(_state(), where, "ckpt-e0001-s00000002", 1)
        shard = shards.shard_path(where, "ckpt-e0001-s00000002", 1)
        assert digest == file_digest(shard, "sha256")
        for path in (api, trainer):  # the sidecar records the disk's bytes
            assert sidecar_of(path).read_text().split()[0] == file_digest(path, "sha256")
        made[how] = [
            p.read_bytes() for p in (api, sidecar_of(api), trainer, sidecar_of(trainer), shard)
        ]
        made[how].append(digest.encode())
    assert made["new"] == made["old"]
    # Either loads with today's reader (the old files are checkpoints already written).
    assert torch.equal(read_verified(tmp_path / "old" / "api.pt")["objects"]["w"], _state()["w"])
    assert load_checkpoint(tmp_path / "new" / "run")["state"]["plain"] == _state()["plain"]


# -- a torn chunk -----------------------------------------------------------------------------


class _FullDisk:
    """A file whose ``fail_at``-th write call takes half its bytes, then fails (ENOSPC)."""

    def __init__(self, file: IO[bytes], fail_at: int) -> None:
        self._file, self._fail_at, self.calls = file, fail_at, 0

    def write(self, data: Any) -> int:
        self.calls += 1
        if self.calls == self._fail_at:
            view = memoryview(data).cast("B")
            self._file.write(view[: len(view) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        return self._file.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)

    def __enter__(self) -> _FullDisk:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()


@pytest.mark.parametrize("fail_at", [3, 12])  # torch's first records; a chunk of the tensor
def test_a_write_torn_in_a_chunk_raises_and_commits_nothing(tmp_path, monkeypatch, fail_at):
    monkeypatch.setattr(files, "WRITE_CHUNK", 4096)
    run = tmp_path / "run"
    first = save_checkpoint(_state(), run, epoch=0, step=1)
    fdopen = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda *a, **k: _FullDisk(fdopen(*a, **k), fail_at))
    with pytest.raises(OSError, match=r"cannot save checkpoint .*ckpt-e0000-s00000002\.pt") as e:
        save_checkpoint(_state(), run, epoch=0, step=2)
    assert e.value.errno == errno.ENOSPC
    with pytest.raises(OSError, match=r"cannot save shard .*rank00000\.pt"):
        shards.write_shard(_state(), tmp_path, "s", 0)
    monkeypatch.setattr(os, "fdopen", fdopen)
    ckpt_dir = run / "checkpoints"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == [
        first.name,
        sidecar_of(first).name,
        "latest",
    ]
    assert list((tmp_path / "shards" / "s").iterdir()) == []  # no temporary file left
    assert latest_checkpoint(run) == first and list_checkpoints(run) == [first]


def test_a_shard_is_written_though_another_rank_prunes_its_empty_directory(tmp_path, monkeypatch):
    """Two ranks saving in the background: rank 1, still pruning after save N, sees save N+1's
    directory that rank 0 just made, uncommitted and empty, and removes it before rank 0's
    temporary file is in it (seen once in the full suite as ENOENT on that file)."""
    real = shards.write_temp_digested
    calls: list[bool] = []

    def pruned_first(directory, name, write, *args, **kwargs):
        calls.append(directory.is_dir())
        if len(calls) == 1:
            shards.prune_shards(tmp_path, committed=set(), rank=1)
            assert not directory.exists()  # the race, made to happen
        return real(directory, name, write, *args, **kwargs)

    monkeypatch.setattr(shards, "write_temp_digested", pruned_first)
    digest = shards.write_shard(_state(), tmp_path, "ckpt-e0000-s00000009", 0)
    assert calls == [True, True]  # made again, written once
    read = shards.read_shard(tmp_path, "ckpt-e0000-s00000009", 0, digest)
    assert torch.equal(read["w"], _state()["w"])

    def always_pruned(directory, name, write, *args, **kwargs):
        shards.prune_shards(tmp_path, committed=set(), rank=1)
        return real(directory, name, write, *args, **kwargs)

    monkeypatch.setattr(shards, "write_temp_digested", always_pruned)
    with pytest.raises(OSError, match=r"cannot save shard .*s00000010.*rank00000\.pt"):
        shards.write_shard(_state(), tmp_path, "ckpt-e0000-s00000010", 0)  # bounded: no loop


@pytest.mark.parametrize("change", ["a byte of a chunk", "the last chunk cut"])
def test_a_chunk_changed_on_disk_after_the_commit_is_refused(tmp_path, monkeypatch, change):
    monkeypatch.setattr(files, "WRITE_CHUNK", 4096)
    path = save_checkpoint(_state(), tmp_path, epoch=0, step=1)
    raw = bytearray(path.read_bytes())
    if change == "a byte of a chunk":
        raw[len(raw) // 2] ^= 0x01  # inside the tensor's bytes
    else:
        del raw[-1000:]
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="is corrupt or truncated"):
        load_checkpoint(path)


# -- a kill mid-write -------------------------------------------------------------------------

_KILLED = textwrap.dedent(
    """
    import os, signal, sys, torch
    from pathlib import Path
    import tandem.checkpoint as ckpt
    from tandem import files
    from tandem.checkpoint.run_dir import save_checkpoint

    how, where, kill_at = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    files.WRITE_CHUNK = 4096
    torch.manual_seed(0)
    first, second = {"w": torch.randn(300, 70)}, {"w": torch.randn(300, 70)}
    torch.save(first, where / "first.pt")
    if how == "trainer":
        save_checkpoint(first, where / "run", epoch=0, step=1)
    fdopen, calls = os.fdopen, [0]

    class Dying:
        def __init__(self, f):
            self._f = f
        def write(self, data):
            calls[0] += 1
            if calls[0] == kill_at:  # half of this chunk reaches the disk, then the kill
                view = memoryview(data).cast("B")
                self._f.write(view[: len(view) // 2])
                self._f.flush()
                os.fsync(self._f.fileno())
                os.kill(os.getpid(), signal.SIGKILL)
            return self._f.write(data)
        def __getattr__(self, name):
            return getattr(self._f, name)
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            self._f.close()

    os.fdopen = lambda *a, **k: Dying(fdopen(*a, **k))
    if how == "trainer":
        save_checkpoint(second, where / "run", epoch=0, step=2)
    else:
        ckpt.save({"w": second["w"]}, where / "api.pt", async_=True).wait()
    print("not killed", calls[0], flush=True)
    """
)


def test_a_kill_half_way_through_a_chunk_leaves_no_loadable_half_checkpoint(tmp_path):
    runs = {}
    for how, kill_at in (("trainer", 17), ("async", 9)):  # inside the tensor's 21 chunks
        where = tmp_path / how
        where.mkdir()
        runs[how] = subprocess.Popen(
            [sys.executable, "-c", _KILLED, how, str(where), str(kill_at)],
            env={**os.environ, "PYTHONPATH": str(SRC)}, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
    for how, child in runs.items():
        out, _ = child.communicate(timeout=120)
        assert child.returncode == -9, f"{how}: {out}"
    first = torch.load(tmp_path / "trainer" / "first.pt")
    # The Trainer's layout: the half file is not listed, latest names the first, which loads.
    run = tmp_path / "trainer" / "run"
    leftovers = [p for p in (run / "checkpoints").iterdir() if p.name.endswith(".tmp")]
    assert leftovers and all(p.stat().st_size > 0 for p in leftovers)
    assert [p.name for p in list_checkpoints(run)] == ["ckpt-e0000-s00000001.pt"]
    assert torch.equal(load_checkpoint(run)["state"]["w"], first["w"])
    save_checkpoint(first, run, epoch=0, step=3)  # the next save tidies the half file away
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.endswith(".tmp")]
    # The background save: nothing at its name, or a file without a sidecar; neither loads.
    api = tmp_path / "async" / "api.pt"
    assert not sidecar_of(api).exists()
    with pytest.raises(CheckpointError):
        read_verified(api)


# -- pacing -----------------------------------------------------------------------------------


def test_a_paced_write_keeps_to_its_rate_in_its_own_thread_only(tmp_path):
    data = bytes(8 << 20)
    began = time.monotonic()
    with paced(20e6):  # 8 MiB at 20 MB/s: 0.42 s at least
        write_temp_digested(tmp_path, "a", lambda f: f.write(data))
        elsewhere: list[float] = []

        def other() -> None:  # another thread, inside the same `with`: its own pace (none)
            begun = time.monotonic()
            write_temp_digested(tmp_path, "b", lambda f: f.write(data))
            elsewhere.append(time.monotonic() - begun)

        thread = threading.Thread(target=other)
        thread.start()
        thread.join(60)
    assert time.monotonic() - began >= len(data) / 20e6 * 0.99
    assert elsewhere and elsewhere[0] < len(data) / 20e6 * 0.5
    for bad in (0, -1.0, float("nan")):
        with (
            pytest.raises(ValueError, match=f"bytes_per_s must be > 0 or None, got {bad}"),
            paced(bad),
        ):
            pass


def test_a_background_save_is_paced_by_the_writers_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(WRITER, "bytes_per_s", 20e6)
    state = {"w": torch.zeros(2 << 20)}  # 8 MiB
    handle = ckpt.save(state, tmp_path / "a.pt", async_=True)
    handle.wait()
    assert handle.written_s is not None and handle.written_s >= 8 * 2**20 / 20e6 * 0.99
    loaded = {"w": torch.ones(2 << 20)}
    ckpt.load(loaded, tmp_path / "a.pt")
    assert torch.equal(loaded["w"], state["w"])
