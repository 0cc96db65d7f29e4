"""stage_local copies once, reuses an identical copy, and never trusts an incomplete one.

Proves, in one process (the waiting local rank is a thread): a directory tree (nested and empty
directories, binary files) and a single file are copied byte for byte with a manifest; a second
call copies nothing (same inodes and times); a source whose content changed is copied again even
when its size and modification time were kept (unless ``quick`` trusts them), while a touched
but unchanged source is not; a copy without its manifest (interrupted) or with a file missing
is redone; a copy that differs from the source after copying is refused and removed; a waiting
local rank returns only once a matching manifest is there, and times out with the paths in the
message otherwise.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

import tandem.data.staging as staging
from tandem.data.staging import stage_local


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for a directory)."""
    if root.is_file():
        return {".": root.read_bytes()}
    return {
        p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture
def src(tmp_path):
    root = tmp_path / "shared" / "dataset"
    (root / "train" / "a").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "train" / "a" / "x.bin").write_bytes(os.urandom(5 << 20))  # > one 4 MiB chunk
    (root / "train" / "y.txt").write_text("label\n1\n")
    (root / "meta.json").write_bytes(b"{}")
    (root / "zero").write_bytes(b"")
    return root


@pytest.fixture
def copies(monkeypatch):
    """The sources copied, in order."""
    calls: list[Path] = []
    real = staging._copy

    def counting(source, tmp):
        calls.append(source)
        return real(source, tmp)

    monkeypatch.setattr(staging, "_copy", counting)
    return calls


def _stage(src, dest, **kwargs):
    return stage_local(src, dest, local_rank=0, local_world_size=1, **kwargs)


def test_copies_tree_and_writes_manifest(src, tmp_path, copies):
    out = _stage(src, tmp_path / "local")
    assert out == tmp_path / "local" / "dataset"
    assert _tree(out) == _tree(src)
    assert (tmp_path / "local" / ".dataset.tandem-stage.json").is_file()
    assert sorted(p.name for p in (tmp_path / "local").iterdir()) == [
        ".dataset.tandem-stage.json",
        "dataset",
    ]  # no temporary left
    assert copies == [src]


def test_copies_single_file(tmp_path, copies):
    f = tmp_path / "data.lmdb"
    f.write_bytes(os.urandom(1000))
    out = _stage(f, tmp_path / "local")
    assert out.read_bytes() == f.read_bytes()
    _stage(f, tmp_path / "local")
    assert copies == [f]


def test_identical_copy_is_not_copied_again(src, tmp_path, copies):
    out = _stage(src, tmp_path / "local")
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.rglob("*")}
    assert _stage(src, tmp_path / "local") == out
    assert _stage(src, tmp_path / "local", quick=True) == out
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.rglob("*")} == before
    assert copies == [src]


def _rewrite_keeping_size_and_time(path: Path) -> None:
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_changed_source_is_copied_again_even_with_same_size_and_time(src, tmp_path, copies):
    out = _stage(src, tmp_path / "local")
    _rewrite_keeping_size_and_time(src / "train" / "y.txt")
    _stage(src, tmp_path / "local", quick=True)  # quick trusts size and time: no copy
    assert copies == [src]
    _stage(src, tmp_path / "local")  # the default hashes: a copy
    assert copies == [src, src]
    assert _tree(out) == _tree(src)

    (src / "meta.json").write_bytes(b'{"v": 2}')  # size changed: quick sees it too
    (src / "new.txt").write_text("new")
    _stage(src, tmp_path / "local", quick=True)
    assert len(copies) == 3 and _tree(out) == _tree(src)


def test_touched_but_unchanged_source_is_not_copied(src, tmp_path, copies):
    _stage(src, tmp_path / "local")
    os.utime(src / "meta.json", ns=(0, 10**18))
    _stage(src, tmp_path / "local")
    assert copies == [src]
    # The manifest now records the new time, which the waiting ranks compare with.
    manifest = staging._read_manifest(tmp_path / "local" / ".dataset.tandem-stage.json")
    assert staging._describes(manifest, src)


def test_interrupted_copy_is_redone(src, tmp_path, copies):
    out = _stage(src, tmp_path / "local")
    # An interruption before the manifest: the copy is there, maybe partial, no manifest.
    (tmp_path / "local" / ".dataset.tandem-stage.json").unlink()
    (out / "train" / "a" / "x.bin").write_bytes(b"partial")
    _stage(src, tmp_path / "local")
    assert copies == [src, src]
    assert _tree(out) == _tree(src)


def test_copy_with_missing_file_is_redone(src, tmp_path, copies):
    out = _stage(src, tmp_path / "local")
    (out / "train" / "y.txt").unlink()
    _stage(src, tmp_path / "local", quick=True)
    assert copies == [src, src]
    assert _tree(out) == _tree(src)


def test_copy_that_differs_after_copying_is_refused(src, tmp_path, monkeypatch):
    real = staging._copy

    def corrupting(source, tmp):
        manifest = real(source, tmp)
        with open(tmp / "train" / "y.txt", "r+b") as f:  # a bit flipped on the way to disk
            f.write(b"L")
        return manifest

    monkeypatch.setattr(staging, "_copy", corrupting)
    with pytest.raises(RuntimeError, match=r"differs from the source.*train/y\.txt"):
        _stage(src, tmp_path / "local")
    assert list((tmp_path / "local").iterdir()) == []  # no copy, no manifest, no temporary


def test_waiting_rank_returns_after_rank0_copied(src, tmp_path):
    result = {}

    def rank1():
        result["path"] = stage_local(
            src, tmp_path / "local", local_rank=1, local_world_size=2, timeout=30
        )
        result["seen"] = _tree(result["path"])

    waiter = threading.Thread(target=rank1)
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive()  # nothing to find yet
    out = _stage(src, tmp_path / "local")
    waiter.join(30)
    assert result["path"] == out and result["seen"] == _tree(src)


def test_waiting_rank_ignores_manifest_of_another_source_version(src, tmp_path):
    _stage(src, tmp_path / "local")
    (src / "meta.json").write_bytes(b"changed")  # rank 0 would copy again: do not read the old
    with pytest.raises(TimeoutError, match=f"local rank 1 waited 0.3 s .* copy {src} to"):
        stage_local(src, tmp_path / "local", local_rank=1, local_world_size=2, timeout=0.3)


def test_mistakes_carry_the_values(src, tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        _stage(tmp_path / "nope", tmp_path / "local")
    with pytest.raises(ValueError, match=r"local_rank 2 not in \[0, 2\)"):
        stage_local(src, tmp_path / "local", local_rank=2, local_world_size=2)
    with pytest.raises(ValueError, match="already at its destination"):
        _stage(src, src.parent)


def test_placement_defaults_to_launcher_environment(src, tmp_path, monkeypatch):
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    # Local rank 1 by the environment: it waits (and times out, with nobody copying).
    with pytest.raises(TimeoutError, match="local rank 1"):
        stage_local(src, tmp_path / "local", timeout=0.1)
