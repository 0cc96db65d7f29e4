"""stage_local on two real ranks of one node: one copy, one path, and no hang on failure.

Proves: with a Gloo process group of two ranks on one node, only local rank 0 copies (each
copy appends its rank to a log), both ranks return the same path, and both read content equal
to the source once stage_local returns; a second call, in a node-local group the ranks created,
copies nothing; when local rank 0 fails to copy, rank 0 raises its own error and rank 1 raises
one naming rank 0 instead of waiting forever.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.harness import RankFailure, run_ranks

pytestmark = pytest.mark.distributed


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _stage_and_read(src: str, dest: str, log: str, own_group: bool) -> tuple[str, dict]:
    import torch.distributed as dist

    import tandem.data.staging as staging

    real = staging._copy

    def logged(source, tmp):
        with open(log, "a") as f:
            f.write(f"{dist.get_rank()}\n")
        return real(source, tmp)

    staging._copy = logged
    group = dist.new_group([0, 1]) if own_group else None
    out = staging.stage_local(src, dest, group=group)
    return str(out), _tree(out)


def _fail_on_rank0(src: str, dest: str) -> str:
    import tandem.data.staging as staging

    def failing(source, tmp):
        raise OSError(f"no space left on device while copying {source}")

    staging._copy = failing
    return str(staging.stage_local(src, dest))


@pytest.fixture
def src(tmp_path):
    root = tmp_path / "shared" / "dataset"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a.bin").write_bytes(os.urandom(1 << 20))
    (root / "b.txt").write_text("hello")
    return root


def test_only_local_rank0_copies_and_every_rank_gets_the_copy(src, tmp_path):
    dest, log = tmp_path / "node-local", tmp_path / "copies.log"
    results = run_ranks(_stage_and_read, 2, args=(str(src), str(dest), str(log), False))
    assert [path for path, _ in results] == [str(dest / "dataset")] * 2
    assert all(tree == _tree(src) for _, tree in results)
    assert log.read_text().split() == ["0"]

    results = run_ranks(_stage_and_read, 2, args=(str(src), str(dest), str(log), True))
    assert [path for path, _ in results] == [str(dest / "dataset")] * 2
    assert all(tree == _tree(src) for _, tree in results)
    assert log.read_text().split() == ["0"]  # identical copy: nobody copied again


def test_failure_of_local_rank0_is_raised_on_every_rank(src, tmp_path):
    with pytest.raises(RankFailure) as failure:
        run_ranks(_fail_on_rank0, 2, args=(str(src), str(tmp_path / "node-local")), timeout=30)
    report = str(failure.value)
    assert "rank 0 raised" in report and "no space left on device" in report
    assert "rank 1 raised" in report and "failed on rank(s) [0] of the group" in report
