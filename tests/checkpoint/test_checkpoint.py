"""tandem.checkpoint.run_dir: what is saved comes back exactly, and nothing else can.

Proves: a real model (with buffers), AdamW after steps, LR schedulers (OneCycleLR,
SequentialLR), a GradScaler, a sampler state and RNG states round-trip with equal values and
equal container types, and load into fresh objects; every way of naming a checkpoint (run dir,
checkpoints dir, ``latest``, the file) loads the same one; the sidecar is a valid ``sha256sum``
line. Writes go temp file -> fsync -> rename -> directory fsync for the checkpoint, then the
sidecar, then ``latest``, and pruning only after that. A failure at each of those steps (and a
process killed outright between them) leaves ``latest`` naming the previous checkpoint, which
still loads, and no temporary or half-committed file listed (the rollback or the next save
removes them). Keep-k keeps the newest k by (epoch, step) as numbers and never the one
``latest`` names. A flipped byte, a truncation or a missing sidecar is a CheckpointError naming
the file and the earlier checkpoint, which still loads by path; a pickle with a malicious
``__reduce__`` is refused on load and on save without the code running (the same file does run
it under ``weights_only=False``, so the test is not vacuous); a newer format version, a bad
pointer, bad arguments and an unwritable run dir are clear errors.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import textwrap
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.checkpoint import run_dir as ck
from tandem.checkpoint.rng import capture_rng_state
from tandem.checkpoint.run_dir import (
    FORMAT_VERSION,
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from tandem.data.sampler import DistributedSampler


def assert_same(a: Any, b: Any, where: str = "state") -> None:
    """Equal values and equal container types, all the way down (tuple stays tuple)."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def training_state() -> tuple[dict[str, Any], tuple[Any, ...]]:
    """State dicts of objects that have taken a few real steps, and the objects."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    one_cycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=20)
    opt2 = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sequential = torch.optim.lr_scheduler.SequentialLR(
        opt2,
        [
            torch.optim.lr_scheduler.LinearLR(opt2, start_factor=0.1, total_iters=2),
            torch.optim.lr_scheduler.CosineAnnealingLR(opt2, T_max=5),
        ],
        milestones=[2],
    )
    scaler = torch.amp.GradScaler("cpu")
    sampler = DistributedSampler(range(10), num_replicas=2, rank=0, seed=3)
    for _ in range(3):
        loss = model(torch.randn(5, 4)).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt2.step()
        opt.zero_grad()
        opt2.zero_grad()
        one_cycle.step()
        sequential.step()
    next(iter(sampler))
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "optimizer2": opt2.state_dict(),
        "scheduler": one_cycle.state_dict(),
        "scheduler2": sequential.state_dict(),
        "scaler": scaler.state_dict(),
        "sampler": sampler.state_dict(),
        "rng": [capture_rng_state()],
        "misc": {"tuple": (1, 2.5, "x", None, True), "empty": [], "od": OrderedDict(a=1)},
    }
    return state, (model, opt, one_cycle, opt2, sequential, scaler)


def dir_names(run_dir: Path) -> list[str]:
    return sorted(os.listdir(run_dir / "checkpoints"))


def committed_names(*names: str) -> list[str]:
    return sorted([*names, *(n + ".sha256" for n in names), "latest"])


NAME1 = "ckpt-e0001-s00000010.pt"
NAME2 = "ckpt-e0002-s00000020.pt"


def test_real_training_state_round_trips_exactly(tmp_path: Path) -> None:
    state, objects = training_state()
    assert state["scaler"], "the CPU GradScaler must be enabled for this test to mean anything"
    path = save_checkpoint(state, tmp_path, epoch=2, step=30)
    loaded = load_checkpoint(path)
    assert set(loaded) == {"format_version", "epoch", "step", "state"}
    assert (loaded["format_version"], loaded["epoch"], loaded["step"]) == (FORMAT_VERSION, 2, 30)
    assert_same(state, loaded["state"])

    # And the loaded dicts are accepted by fresh objects of the same kinds.
    model, opt, one_cycle, opt2, sequential, scaler = objects
    got = loaded["state"]
    model.load_state_dict(got["model"])
    opt.load_state_dict(got["optimizer"])
    one_cycle.load_state_dict(got["scheduler"])
    opt2.load_state_dict(got["optimizer2"])
    sequential.load_state_dict(got["scheduler2"])
    fresh_scaler = torch.amp.GradScaler("cpu")
    fresh_scaler.load_state_dict(got["scaler"])
    assert fresh_scaler.get_scale() == scaler.get_scale()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_and_cuda_grad_scaler_load_on_cpu(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 3).cuda()
    opt = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cuda")
    scaler.scale(model(torch.randn(2, 3, device="cuda")).sum()).backward()
    scaler.step(opt)
    scaler.update()
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()}
    loaded = load_checkpoint(save_checkpoint(state, tmp_path, epoch=0, step=1))["state"]
    assert loaded["model"]["weight"].device.type == "cpu"
    assert torch.equal(loaded["model"]["weight"], state["model"]["weight"].cpu())
    assert loaded["scaler"] == state["scaler"]


def test_layout_sidecar_pointer_and_every_way_to_name_a_checkpoint(tmp_path: Path) -> None:
    path = save_checkpoint({"x": torch.arange(5)}, tmp_path, epoch=1, step=10)
    assert path == tmp_path / "checkpoints" / NAME1
    assert dir_names(tmp_path) == committed_names(NAME1)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert (path.parent / (NAME1 + ".sha256")).read_text() == f"{digest}  {NAME1}\n"
    assert json.loads((path.parent / "latest").read_text())["checkpoint"] == NAME1
    for name_it in (
        tmp_path,
        str(tmp_path),
        tmp_path / "checkpoints",
        path.parent / "latest",
        path,
    ):
        assert torch.equal(load_checkpoint(name_it)["state"]["x"], torch.arange(5)), name_it
    assert latest_checkpoint(tmp_path) == path
    assert latest_checkpoint(tmp_path / "checkpoints") == path


def test_list_orders_by_epoch_and_step_as_numbers(tmp_path: Path) -> None:
    # 10000 sorts before 9999 as text; the list must not.
    for epoch, step in [(10_000, 5), (9_999, 123_456_789), (9_999, 7)]:
        save_checkpoint({}, tmp_path, epoch=epoch, step=step, keep=10)
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == [
        "ckpt-e9999-s00000007.pt",
        "ckpt-e9999-s123456789.pt",
        "ckpt-e10000-s00000005.pt",
    ]
    assert list_checkpoints(tmp_path / "nowhere") == []
    assert latest_checkpoint(tmp_path / "nowhere") is None


def test_keeps_the_newest_k(tmp_path: Path) -> None:
    for i in range(1, 6):
        save_checkpoint({"i": i}, tmp_path, epoch=i, step=i * 10, keep=2)
        assert len(list_checkpoints(tmp_path)) == min(i, 2)
    kept = ["ckpt-e0004-s00000040.pt", "ckpt-e0005-s00000050.pt"]
    assert dir_names(tmp_path) == committed_names(*kept)
    assert load_checkpoint(tmp_path)["state"] == {"i": 5}


def test_never_prunes_the_checkpoint_latest_names(tmp_path: Path) -> None:
    # A run resumed from an earlier checkpoint saves names that sort before newer ones.
    save_checkpoint({"t": "old"}, tmp_path, epoch=5, step=50, keep=1)
    path = save_checkpoint({"t": "resumed"}, tmp_path, epoch=1, step=10, keep=1)
    assert path.exists() and latest_checkpoint(tmp_path) == path
    assert load_checkpoint(tmp_path)["state"] == {"t": "resumed"}


def test_saving_the_same_step_again_replaces_it(tmp_path: Path) -> None:
    save_checkpoint({"v": 1}, tmp_path, epoch=1, step=10)
    save_checkpoint({"v": 2}, tmp_path, epoch=1, step=10)
    assert dir_names(tmp_path) == committed_names(NAME1)
    assert load_checkpoint(tmp_path)["state"] == {"v": 2}


def test_order_of_operations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_checkpoint({"v": 1}, tmp_path, epoch=1, step=10, keep=1)
    events: list[str] = []
    real_replace, real_fsync, real_unlink = os.replace, os.fsync, os.unlink

    def replace(src: Any, dst: Any) -> None:
        events.append(f"replace {Path(dst).name}")
        real_replace(src, dst)

    def fsync(fd: int) -> None:
        events.append("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def unlink(path: Any) -> None:
        events.append(f"unlink {Path(path).name}")
        real_unlink(path)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "unlink", unlink)
    save_checkpoint({"v": 2}, tmp_path, epoch=2, step=20, keep=1)
    # The sidecar of the new name is removed first, in case it existed (a no-op here).
    assert events == [
        "fsync file",
        f"unlink {NAME2}.sha256",
        f"replace {NAME2}",
        "fsync dir",
        "fsync file",
        f"replace {NAME2}.sha256",
        "fsync dir",
        "fsync file",
        "replace latest",
        "fsync dir",
        f"unlink {NAME1}.sha256",
        f"unlink {NAME1}",
    ]


def _fail_on(monkeypatch: pytest.MonkeyPatch, target: str) -> None:
    """Make the save of NAME2 fail at one step, as a full disk or I/O error would."""
    if target == "write":
        real_save = torch.save

        def partial_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            f.write(b"PK\x03\x04 half a checkpoint")
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(torch, "save", partial_save)
        assert real_save is not partial_save
        return
    real_replace = os.replace

    def replace(src: Any, dst: Any) -> None:
        if Path(dst).name == target:
            raise OSError(5, "Input/output error")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)


@pytest.mark.parametrize("target", ["write", NAME2, NAME2 + ".sha256", "latest"])
def test_a_failed_save_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str
) -> None:
    first = save_checkpoint({"v": 1}, tmp_path, epoch=1, step=10)
    with monkeypatch.context() as m:
        _fail_on(m, target)
        with pytest.raises(OSError) as info:
            save_checkpoint({"v": 2}, tmp_path, epoch=2, step=20)
    assert str(tmp_path / "checkpoints" / NAME2) in str(info.value)
    assert dir_names(tmp_path) == committed_names(NAME1), "no temp or half-committed files"
    assert list_checkpoints(tmp_path) == [first]
    assert latest_checkpoint(tmp_path) == first
    assert load_checkpoint(tmp_path)["state"] == {"v": 1}
    # And the next save works normally.
    save_checkpoint({"v": 3}, tmp_path, epoch=3, step=30)
    assert load_checkpoint(tmp_path)["state"] == {"v": 3}


def test_a_failure_after_latest_is_renamed_keeps_the_new_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once `latest` names the new checkpoint, no error may delete it (no rollback)."""
    save_checkpoint({"v": 1}, tmp_path, epoch=1, step=10)
    real_replace, real_fsync = os.replace, os.fsync
    renamed: list[str] = []

    def replace(src: Any, dst: Any) -> None:
        renamed.append(Path(dst).name)
        real_replace(src, dst)

    def fsync(fd: int) -> None:
        if renamed[-1:] == ["latest"] and stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(5, "Input/output error")
        real_fsync(fd)

    with monkeypatch.context() as m:
        m.setattr(os, "replace", replace)
        m.setattr(os, "fsync", fsync)
        with pytest.raises(OSError, match="cannot save checkpoint"):
            save_checkpoint({"v": 2}, tmp_path, epoch=2, step=20)
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / NAME2
    assert load_checkpoint(tmp_path)["state"] == {"v": 2}


@pytest.mark.parametrize("die_before", [NAME2 + ".sha256", "latest"])
def test_a_killed_process_leaves_the_previous_checkpoint(tmp_path: Path, die_before: str) -> None:
    """No rollback code runs when the process dies: the layout itself must keep `latest` right."""
    save_checkpoint({"v": 1}, tmp_path, epoch=1, step=10)
    script = f"""
        import os, sys
        from tandem.checkpoint.run_dir import save_checkpoint
        real = os.replace
        def replace(src, dst):
            if os.path.basename(dst) == {die_before!r}:
                os._exit(17)  # dies with the temp file written, before its rename
            real(src, dst)
        os.replace = replace
        save_checkpoint({{"v": 2}}, sys.argv[1], epoch=2, step=20)
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), str(tmp_path)], timeout=60
    )
    assert done.returncode == 17
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / NAME1
    assert load_checkpoint(tmp_path)["state"] == {"v": 1}
    if die_before == NAME2 + ".sha256":
        assert [p.name for p in list_checkpoints(tmp_path)] == [NAME1], "uncommitted is unlisted"
    leftovers = set(dir_names(tmp_path)) - set(committed_names(NAME1, NAME2))
    assert leftovers and all(n.endswith(".tmp") for n in leftovers), leftovers
    # The next save cleans up what the dead one left.
    save_checkpoint({"v": 3}, tmp_path, epoch=3, step=30, keep=5)
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert dir_names(tmp_path) == committed_names(*names)
    assert load_checkpoint(tmp_path)["state"] == {"v": 3}


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0xFF
    elif how == "truncate":
        del data[len(data) // 2 :]
    if how == "no sidecar":
        (path.parent / (path.name + ".sha256")).unlink()
    else:
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["flip", "truncate", "no sidecar"])
def test_a_damaged_checkpoint_is_a_clear_error_and_the_previous_one_loads(
    tmp_path: Path, how: str
) -> None:
    first = save_checkpoint({"w": torch.ones(1000)}, tmp_path, epoch=1, step=10)
    second = save_checkpoint({"w": torch.zeros(1000)}, tmp_path, epoch=2, step=20)
    _damage(second, how)
    for name_it in (tmp_path, second):
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(name_it)
        message = str(info.value)
        assert str(second) in message
        assert f"load_checkpoint({str(first)!r})" in message, message
    assert torch.equal(load_checkpoint(first)["state"]["w"], torch.ones(1000))


def test_only_checkpoint_damaged_says_there_is_no_other(tmp_path: Path) -> None:
    path = save_checkpoint({"w": torch.ones(10)}, tmp_path, epoch=1, step=10)
    _damage(path, "flip")
    with pytest.raises(CheckpointError, match="No other checkpoints"):
        load_checkpoint(tmp_path)


class Malicious:
    """Unpickling this calls open(marker, "w"): a stand-in for arbitrary code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def _forge(path: Path, payload: dict[str, Any]) -> None:
    """A checkpoint written by someone else, with a sidecar that matches it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(payload, path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    (path.parent / (path.name + ".sha256")).write_text(f"{digest}  {path.name}\n")


def test_malicious_pickle_is_refused_without_running(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "run" / "checkpoints" / NAME1
    _forge(path, {"format_version": 1, "epoch": 1, "step": 10, "state": {"x": Malicious(marker)}})
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path / "run")
    assert str(path) in str(info.value) and "open" in str(info.value)
    assert not marker.exists()
    # The same bytes do run the code when loaded without weights_only: the test is not vacuous.
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_saving_state_that_could_not_be_loaded_is_refused(tmp_path: Path) -> None:
    save_checkpoint({"v": 1}, tmp_path, epoch=1, step=10)
    marker = tmp_path / "pwned"
    with pytest.raises(ValueError, match="weights_only") as info:
        save_checkpoint({"x": Malicious(marker)}, tmp_path, epoch=2, step=20)
    assert NAME2 in str(info.value)
    assert not marker.exists()
    assert dir_names(tmp_path) == committed_names(NAME1)


def test_newer_format_version_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as m:
        m.setattr(ck, "FORMAT_VERSION", FORMAT_VERSION + 1)
        path = save_checkpoint({}, tmp_path, epoch=1, step=10)
    with pytest.raises(
        CheckpointError, match=f"format version {FORMAT_VERSION + 1}.*newer"
    ) as info:
        load_checkpoint(tmp_path)
    assert str(path) in str(info.value)


def test_not_a_tandem_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "checkpoints" / NAME1
    _forge(path, {"model": torch.ones(2)})
    with pytest.raises(CheckpointError, match="not a tandem checkpoint"):
        load_checkpoint(path)


def test_missing_run_and_bad_pointer(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoints in"):
        load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist") as info:
        load_checkpoint(tmp_path / "nope.pt")
    assert str(tmp_path / "nope.pt") in str(info.value)
    save_checkpoint({}, tmp_path, epoch=1, step=10)
    pointer = tmp_path / "checkpoints" / "latest"
    pointer.write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable") as info:
        load_checkpoint(tmp_path)
    assert str(pointer) in str(info.value) and NAME1 in str(info.value)
    pointer.write_text(json.dumps({"checkpoint": "../../etc/passwd"}))
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        latest_checkpoint(tmp_path)
    pointer.unlink()  # no pointer at all: the newest committed checkpoint
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / NAME1


def test_unwritable_run_dir_names_it(tmp_path: Path) -> None:
    # Running as root, permissions do not stop writes; a regular file in the path does.
    blocker = tmp_path / "file.txt"
    blocker.write_text("")
    with pytest.raises(OSError) as info:
        save_checkpoint({}, blocker / "run", epoch=0, step=0)
    assert str(blocker / "run" / "checkpoints") in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"epoch": -1, "step": 0}, "epoch must be an int >= 0, got -1"),
        ({"epoch": 0, "step": 1.5}, "step must be an int >= 0, got 1.5"),
        ({"epoch": True, "step": 0}, "epoch must be an int >= 0, got True"),
        ({"epoch": 0, "step": 0, "keep": 0}, "keep must be an int >= 1, got 0"),
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        save_checkpoint({}, tmp_path, **kwargs)
    with pytest.raises(ValueError, match="state must be a dict, got list"):
        save_checkpoint([], tmp_path, epoch=0, step=0)  # type: ignore[arg-type]
    assert not (tmp_path / "checkpoints").exists()
