"""Checkpoints written in the background: the files of a synchronous save, and never half of one.

Proves, in one process:

- ``tandem.checkpoint.save(..., async_=True)`` returns while the write is still held up (its
  handle not done, no file), having copied the state into the writer's staging memory (one copy
  of every distinct tensor: its bytes counted), and the checkpoint it commits equals a
  synchronous save of the same state (a model with a tied weight and a BatchNorm, AdamW's
  state, RNG, plain values in lists and tensors), though every live tensor, value and generator
  changed right after the call; the tied weight is still one tensor in the file;
- :class:`Staging`, by property test over nested dicts, lists and tuples of tensors (several
  shapes and dtypes, strided views, the same tensor twice) and plain values: the copy equals
  the state with its container types, shares no memory with it, copies memory used twice once
  (and only that); the bytes held are one copy of the distinct tensors; a second copy of the
  changed state lands in the same buffers;
- at most one save in flight: a save, and a load, made while one is being written wait for it
  and log a warning naming it;
- errors: a write refused by the disk is raised by ``wait()`` as an OSError naming the
  checkpoint; if nothing waits, by the next save, which writes nothing; a state that
  ``weights_only`` loading would refuse is a ValueError at ``wait()``; a bad ``async_`` is a
  ValueError; a save given up (recovery in memory re-forms the world) never commits, and the
  next save copies into new memory; a failure nothing waited for is printed at exit;
- a script that exits with a save in flight leaves that checkpoint committed.

On 2 ranks (Gloo, real processes):

- ``Trainer(checkpoint_async=True)`` writes the checkpoints ``Trainer(checkpoint_async=False)``
  writes (every step, through a SIGTERM's stop), equal but for wall-clock
  times (model, optimizer, every rank's RNG states, the run's state; shard files' contents),
  full and sharded formats; the stop waits for the write in flight and prints that it
  committed, before the stop's line;
- rank 1's shard, or rank 0's file, failing in the background is the same OSError on both
  ranks, naming that rank; nothing is committed; the next save commits and loads;
- crash consistency: a run killed by SIGKILL at 20 seeded random operations of its background
  write (a file written up to a random write call, a temporary file made, an fsync, a rename,
  an unlink, a collective of the writers; on rank 0, rank 1, or both: the job), in the full
  and the sharded format, each time resumed from ``latest`` by fresh processes: every
  checkpoint listed (committed) loads whole, its checksum and every shard's digest verified,
  and equals the uninterrupted run's checkpoint of that step; ``latest`` names the new
  checkpoint or the one before it; a rank that lives says "committed" only if ``latest`` names
  the new one, and otherwise raises an error naming the checkpoint; the resume starts at
  ``latest``'s step; the kills fell before and after commits, in writes, fsyncs, renames and
  collectives; a last save leaves nothing but committed checkpoints beside ``latest``. A
  mutant that moves ``latest`` before the checkpoint's commit fails it.
"""

from __future__ import annotations

import contextlib
import errno
import io
import itertools
import json
import logging
import multiprocessing as mp
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import TensorDataset

import tandem
import tandem.checkpoint as ckpt
import tandem.checkpoint.phases as phases
import tandem.checkpoint.sealed as sealed
import tests.harness
from tandem.checkpoint import async_save
from tandem.checkpoint.async_save import WRITER, Staging
from tandem.checkpoint.run_dir import latest_checkpoint, list_checkpoints, load_checkpoint
from tandem.checkpoint.sealed import read_verified
from tandem.checkpoint.shards import read_shard
from tests.checkpoint import async_kill_worker
from tests.checkpoint.test_checkpoint import assert_same

KINDS = ("full", "sharded")


# -- one process ------------------------------------------------------------------------------


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """The background writer stops before each main file until the event is set (a save in
    the caller does not); at the end the event is set and a save left in flight finished."""
    release = threading.Event()
    real = sealed.write_committed

    def write_committed(payload: Any, path: Path) -> str:
        if threading.current_thread().name == async_save.THREAD_NAME:
            assert release.wait(60), "the test never released the writer"
        return real(payload, path)

    monkeypatch.setattr(sealed, "write_committed", write_committed)
    yield release
    release.set()
    with contextlib.suppress(Exception):
        WRITER.settle("the test's end")


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.norm = nn.BatchNorm1d(4)
        self.out = nn.Linear(4, 5, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.embed(x)))


def _trained_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.tensor([1, 2, 3])).sum().backward()
    opt.step()
    values = {"step": 7, "losses": [0.5, torch.tensor([1.0, 2.0])], "mask": torch.ones(3) > 0}
    return {"model": model, "optimizer": opt, "rng": ckpt.RNG(), **values}


def _finishes(handle: ckpt.AsyncSave) -> bool:
    """Whether the handle's write finishes within a minute (without waiting on it)."""
    for _ in range(6000):
        if handle.done():
            return True
        time.sleep(0.01)
    return False


def test_the_async_file_is_the_synchronous_one_though_the_state_changes_at_once(tmp_path, held):
    state = _trained_state()
    tensors = _tensors([state["model"].state_dict(), state["optimizer"].state_dict(),
                        ckpt.RNG().rank_state_dict(), state["losses"], state["mask"]])  # fmt: skip
    synchronous = ckpt.save(state, tmp_path / "sync.pt")
    handle = ckpt.save(state, tmp_path / "async.pt", async_=True)
    assert not handle.done() and not (tmp_path / "async.pt").exists()
    # The copy: one of every distinct tensor of the state, in the writer's staging memory.
    assert WRITER.staging.nbytes == sum({_place(t): t.nbytes for t in tensors}.values())
    # Training goes on at once: every live tensor and value changes under the writer.
    with torch.no_grad():
        for t in [*state["model"].parameters(), *state["model"].buffers()]:
            t.add_(1)
        for t in state["optimizer"].state[state["model"].out.weight].values():
            t.add_(1)
    state["losses"][1].mul_(3)
    state["losses"].append(9.0)
    state["mask"].logical_not_()
    state["step"] = 8
    torch.rand(3)  # the generators move on too
    held.set()
    assert handle.wait() == tmp_path / "async.pt" and handle.done()
    a, b = read_verified(synchronous), read_verified(handle.path)
    assert_same(a, b)
    weights = b["objects"]["model"]["state"]["model"]
    assert weights["out.weight"].data_ptr() == weights["embed.weight"].data_ptr()  # still tied


def _trees() -> st.SearchStrategy[tuple[list[torch.Tensor], Any]]:
    """A pool of tensors and a nested state whose leaves are them, views of them, or plain."""
    dtypes = st.sampled_from([torch.float32, torch.float64, torch.int64, torch.bool])
    shapes = st.lists(st.integers(1, 4), min_size=0, max_size=3)
    pool = st.lists(st.tuples(shapes, dtypes), min_size=1, max_size=4)

    def tree(specs: list[tuple[list[int], torch.dtype]]) -> st.SearchStrategy[Any]:
        tensors = [torch.arange(int(torch.tensor(s).prod()) if s else 1).reshape(s).to(d)
                   for s, d in specs]  # fmt: skip
        leaf = st.one_of(
            st.integers(0, len(tensors) - 1).map(lambda i: tensors[i]),
            st.integers(0, len(tensors) - 1).map(lambda i: tensors[i].reshape(-1)[::2]),
            st.integers(-3, 3) | st.text(max_size=3) | st.none(),
        )
        nested = st.recursive(
            leaf,
            lambda inner: (
                st.lists(inner, max_size=3)
                | st.lists(inner, max_size=3).map(tuple)
                | st.dictionaries(st.text(max_size=2), inner, max_size=3)
            ),
            max_leaves=8,
        )
        return st.tuples(st.just(tensors), st.dictionaries(st.text(max_size=2), nested))

    return pool.flatmap(tree)


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        tree = list(tree.values())
    return [t for item in tree for t in _tensors(item)] if isinstance(tree, list | tuple) else []


def _place(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())


@given(_trees())
@settings(max_examples=60, deadline=None)
def test_staging_copies_any_state_into_one_reused_copy(pool_and_state):
    pool, state = pool_and_state
    staging = Staging()
    copied = staging.copy(state)
    assert_same(copied, state)
    sources, staged = _tensors(state), _tensors(copied)
    owned = {t.untyped_storage().data_ptr() for t in pool}
    assert not owned & {t.untyped_storage().data_ptr() for t in staged}  # nothing shared
    # The same memory twice (a tied weight) is one copy; one copy of each distinct tensor.
    for (a, x), (b, y) in itertools.combinations(zip(sources, staged, strict=True), 2):
        assert (x is y) == (_place(a) == _place(b))
    distinct = {_place(t): t.nbytes for t in sources}
    assert staging.nbytes == sum(distinct.values())
    # A state of the same shapes goes into the same memory; other shapes into new memory.
    first = {id(t): t.data_ptr() for t in staged}
    for t in pool:
        t.add_(1) if t.dtype != torch.bool else t.logical_not_()
    again = staging.copy(state)
    assert_same(again, state)
    assert [t.data_ptr() for t in _tensors(again)] == [first[id(t)] for t in staged]
    assert staging.nbytes == sum(distinct.values())


def test_one_save_in_flight_a_second_save_or_a_load_waits_for_it(tmp_path, held, caplog):
    state = _trained_state()
    first = ckpt.save(state, tmp_path / "first.pt", async_=True)
    threading.Timer(0.2, held.set).start()  # the second save is blocked until then
    with caplog.at_level(logging.WARNING, logger="tandem.checkpoint.async_save"):
        second = ckpt.save(state, tmp_path / "second.pt", async_=True)
    assert first.done() and first.wait() == tmp_path / "first.pt"
    assert "waited" in caplog.text and str(tmp_path / "first.pt") in caplog.text
    held.clear()
    threading.Timer(0.2, held.set).start()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tandem.checkpoint.async_save"):
        ckpt.load(state, tmp_path / "first.pt")
    assert second.done() and str(tmp_path / "second.pt") in caplog.text
    assert_same(read_verified(second.path)["objects"], read_verified(first.path)["objects"])


def test_a_failed_background_write_is_raised_by_wait_or_by_the_next_save(tmp_path, monkeypatch):
    def full_disk(payload: Any, path: Path) -> str:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(sealed, "write_committed", full_disk)
    state = _trained_state()
    handle = ckpt.save(state, tmp_path / "a.pt", async_=True)
    with pytest.raises(OSError, match=r"a\.pt, written in the background, was not .*No space"):
        handle.wait()
    failed = ckpt.save(state, tmp_path / "b.pt", async_=True)  # nothing waits for it
    assert _finishes(failed)
    monkeypatch.undo()
    with pytest.raises(OSError, match=r"b\.pt, written in the background, was not committed"):
        ckpt.save(state, tmp_path / "c.pt", async_=True)  # raises b's, and writes nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert ckpt.save(state, tmp_path / "d.pt", async_=True).wait().exists()  # then goes on


def test_bad_values_and_arguments(tmp_path):
    class Holds:  # a state weights_only loading would refuse: found by the write
        def state_dict(self) -> dict[str, Any]:
            return {"thing": Tied}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    handle = ckpt.save({"x": Holds()}, tmp_path / "x.pt", async_=True)
    with pytest.raises(ValueError, match="weights_only"):
        handle.wait()
    with pytest.raises(ValueError, match="async_ must be True or False, not 'yes'"):
        ckpt.save({"step": 1}, tmp_path / "y.pt", async_="yes")  # type: ignore[call-overload]


def test_a_save_given_up_never_commits(tmp_path, monkeypatch):
    release, real = threading.Event(), ckpt.write_entries

    def held(*args: Any) -> Any:  # before the commit
        assert release.wait(60), "the test never released the writer"
        return real(*args)

    monkeypatch.setattr(ckpt, "write_entries", held)
    handle = ckpt.save(_trained_state(), tmp_path / "a.pt", async_=True)
    staging = WRITER.staging
    WRITER.abandon()
    release.set()
    assert _finishes(handle)
    assert not (tmp_path / "a.pt").exists() and WRITER.in_flight is None
    ckpt.save(_trained_state(), tmp_path / "b.pt", async_=True).wait()
    assert WRITER.staging is not staging  # the given-up thread kept its own copy


def test_a_failure_nobody_waited_for_is_printed_at_exit(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sealed, "write_committed", lambda payload, path: 1 / 0)
    ckpt.save({"step": 1}, tmp_path / "a.pt", async_=True)
    async_save._at_exit()
    printed = capsys.readouterr().err
    assert "a.pt, written in the background, was not committed: ZeroDivisionError: " in printed


@pytest.mark.timeout(120)
def test_the_exit_of_a_script_waits_for_the_save_in_flight(tmp_path):
    script = f"""
        import atexit, threading
        import tandem.checkpoint as ckpt, tandem.checkpoint.sealed as sealed
        release, real = threading.Event(), sealed.write_committed
        def held(payload, path):
            release.wait()
            return real(payload, path)
        sealed.write_committed = held
        handle = ckpt.save({{"step": 3}}, {str(tmp_path / "a.pt")!r}, async_=True)
        assert not handle.done()
        atexit.register(release.set)  # runs first, then tandem's wait for the save in flight
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], timeout=110)
    assert done.returncode == 0
    assert read_verified(tmp_path / "a.pt")["objects"]["step"]["state"] == 3


# -- two ranks -------------------------------------------------------------------------------

X = torch.randn(26, 6, generator=torch.Generator().manual_seed(0))
Y = (X[:, 0] > 0).long() + (X[:, 1] > 0.3).long()
_TIMES = {"epoch_seconds", "elapsed", "seconds", "epoch_s", "elapsed_s", "samples_per_s"}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))


class _StopsAt(tandem.Trainer):
    """SIGTERM to rank 1 during step 4: saved after step 5, then stopped."""

    def _run_batch(self, *args: Any, **kwargs: Any) -> None:
        super()._run_batch(*args, **kwargs)
        if self.step == 3 and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGTERM)


def _train(run_dir: Path, fmt: str, in_background: bool) -> tuple[str, Any]:
    rank = dist.get_rank()
    for seed in (torch.manual_seed, random.seed, np.random.seed):
        seed(10 + rank)  # the same draws in both runs
    if fmt == "sharded":
        opt: Any = lambda p: tandem.ShardedOptimizer(p, torch.optim.AdamW, lr=0.01)  # noqa: E731
    else:
        opt = lambda p: torch.optim.AdamW(p, lr=0.01)  # noqa: E731
    trainer = _StopsAt(
        _net(), opt, TensorDataset(X, Y), loss_fn=F.cross_entropy, max_epochs=3,
        save_every_steps=1, batch_size=3, run_dir=run_dir, keep_checkpoints=20,
        checkpoint_format=fmt, checkpoint_async=in_background, progress=False, log_every=None,
    )  # fmt: skip
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        summary = trainer.train()
    return printed.getvalue(), summary.checkpoint


def _fail_rank(rank: int, module: Any, name: str) -> Callable[[], None]:
    """Make ``module.name`` raise a full disk's OSError on ``rank``; the undo."""
    real = getattr(module, name)

    def full_disk(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    if dist.get_rank() == rank:
        setattr(module, name, full_disk)
    return lambda: setattr(module, name, real)


def _errors(tmp: Path) -> dict[str, Any]:
    """A background write failing on one rank: the same error on both, nothing committed."""
    model = tandem.DDP(_net())
    state = {"model": model, "optimizer": tandem.ShardedOptimizer(model.parameters(),
             torch.optim.AdamW, lr=0.01), "rng": ckpt.RNG()}  # fmt: skip
    seen: dict[str, Any] = {}
    undo = _fail_rank(1, phases, "write_shard")  # rank 1's shard file
    handle = ckpt.save(state, tmp / "a.pt", kind="sharded", async_=True)
    try:
        handle.wait()
    except OSError as e:
        seen["shard"] = str(e)
    undo()
    undo = _fail_rank(0, sealed, "write_committed")  # rank 0's file, and nothing waits
    failed = ckpt.save(state, tmp / "b.pt", kind="sharded", async_=True)
    while not failed.done():
        time.sleep(0.01)
    undo()
    try:
        ckpt.save(state, tmp / "c.pt", async_=True)
    except OSError as e:
        seen["main"] = str(e)
    dist.barrier()
    seen["files"] = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
    dist.barrier()
    ckpt.save(state, tmp / "d.pt", kind="sharded", async_=True).wait()
    ckpt.load(state, tmp / "d.pt")
    return seen


def _two_ranks(tmp: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for fmt in KINDS:
        for in_background in (False, True):
            run_dir = Path(tmp) / f"{fmt}-{in_background}"
            results[fmt, in_background] = _train(run_dir, fmt, in_background)
    errors = Path(tmp) / "errors"
    errors.mkdir(exist_ok=True)
    results["errors"] = _errors(errors)
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("two-ranks")
    return tmp, tests.harness.run_ranks(_two_ranks, 2, args=(str(tmp),), timeout=240)


def _timeless(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _timeless(v) for k, v in tree.items() if k not in _TIMES}
    if isinstance(tree, list | tuple):
        return type(tree)(_timeless(v) for v in tree)
    return tree


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", KINDS)
def test_the_trainer_writes_in_the_background_what_it_writes_in_the_loop(two_ranks, fmt):
    tmp, results = two_ranks
    synchronous, in_background = tmp / f"{fmt}-False", tmp / f"{fmt}-True"
    names = [p.name for p in list_checkpoints(synchronous)]
    assert len(names) == 5 and names == [p.name for p in list_checkpoints(in_background)]
    for name in names:
        a = _whole(synchronous / "checkpoints" / name)
        b = _whole(in_background / "checkpoints" / name)
        assert_same(_timeless(a), _timeless(b), name)
    printed, last = results[0][fmt, True]
    assert last == latest_checkpoint(in_background) == in_background / "checkpoints" / names[-1]
    assert f"checkpoint {last} committed (written in the background)" in printed
    assert re.search(r"stopped by SIGTERM at epoch \d step 5 .*; checkpoint ", printed)
    assert printed.index("committed (written") < printed.index("stopped by")  # waited first
    assert "committed" not in results[0][fmt, False][0]  # a synchronous save says nothing


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_failed_background_write_is_the_same_error_on_every_rank(two_ranks):
    tmp, results = two_ranks
    errors = [r["errors"] for r in results]
    assert errors[0]["shard"] == errors[1]["shard"]
    assert re.search(r"a\.pt, written in the background, was not committed: rank 1 could not "
                     r"save its shard: .*No space left", errors[0]["shard"])  # fmt: skip
    assert errors[0]["main"] == errors[1]["main"]
    assert re.search(r"b\.pt, written in the background, was not committed: rank 0 could not "
                     r"save checkpoint .*No space left", errors[0]["main"])  # fmt: skip
    # Nothing committed: no checkpoint file (the shard files written are not one).
    assert all(name.startswith("shards/") for name in errors[0]["files"]), errors
    assert read_verified(tmp / "errors" / "d.pt")["kind"] == "sharded"


# -- the kills ---------------------------------------------------------------------------------

KILLS = 20
ORACLE_STEPS = 2 + KILLS + 1  # two saves to count the writes, the kills, a last clean save


@contextlib.contextmanager
def _ranks() -> Iterator[Callable[..., list[int | str]]]:
    """``start(function, out, timeout, **args)``: two ranks of ``async_kill_worker.function``,
    forked by one server process (it imports tandem.DDP's torch once); their exit codes."""
    ours, theirs = mp.Pipe()
    context = mp.get_context("forkserver")  # the harness's: torch and tandem imported already
    server = context.Process(target=async_kill_worker.serve, args=(theirs,), daemon=True)
    server.start()

    def start(function: str, out: Path, timeout: float = 120, **args: Any) -> list[int | str]:
        out.mkdir()
        ours.send((function, {"out": str(out), **args}, timeout))
        codes = ours.recv()
        if "hung" in codes:
            stacks = [(out / f"stack{r}.txt").read_text() for r in (0, 1)]
            pytest.fail(f"{function} {args}: exit codes {codes}; stacks:\n{stacks}")
        return codes

    try:
        yield start
    finally:
        ours.send(None)
        server.join(10)
        server.kill()


def _point(
    start: Callable[..., list[int | str]],
    out: Path,
    run_dir: Path,
    kind: str,
    trigger: int = 0,
    victims: str = "self",
    kill_at: int | None = None,
    write_at: int = 1,
) -> tuple[list[int | str], list[dict[str, Any] | None]]:
    """Two fresh ranks resume ``run_dir``, train a step, save it in the background; rank
    ``trigger`` dies at its ``kill_at``-th operation (at the ``write_at``-th write call of a
    file). Their exit codes and reports."""  # fmt: skip
    codes = start("run", out, run_dir=str(run_dir), kind=kind, trigger=trigger, victims=victims,
                  kill_at=kill_at, write_at=write_at)  # fmt: skip
    reports = [
        json.loads(f.read_text()) if (f := out / f"rank{r}.json").exists() else None for r in (0, 1)
    ]
    return codes, reports


def _whole(path: Path) -> dict[str, Any]:
    """A Trainer-layout checkpoint read as a resume reads it: its checksum and every shard file's
    digest verified; the shards' contents in place of their digests."""
    saved = load_checkpoint(path)
    shards = saved["state"].pop("shards")
    if shards is not None:
        saved["state"]["shard files"] = [
            read_shard(path.parent, path.stem, r, digest)
            for r, digest in enumerate(shards["sha256"])
        ]
    return saved


def _check_committed(run_dir: Path, oracle: Path) -> dict[int, Path]:
    """Every listed checkpoint loads whole and equals the uninterrupted run's of its step."""
    found = {}
    for path in list_checkpoints(run_dir):
        saved = _whole(path)
        kind = "sharded" if "shard files" in saved["state"] else "full"
        assert_same(saved, _whole(oracle / kind / "checkpoints" / path.name), path.name)
        found[saved["step"]] = path
    return found


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_kill_at_any_point_of_the_background_write_never_leaves_a_half_checkpoint(tmp_path):
    oracle, run_dir = tmp_path / "oracle", tmp_path / "run"
    with _ranks() as start:
        start("uninterrupted", tmp_path / "uninterrupted", 300, run_dir=str(oracle),
              steps=ORACLE_STEPS)  # fmt: skip
        _kills(start, tmp_path, oracle, run_dir)


def _kills(start: Callable[..., list[int | str]], tmp: Path, oracle: Path, run_dir: Path) -> None:
    # One save of each kind, not killed: how many operations each rank's writer does.
    ops: dict[str, list[int]] = {}
    for step, kind in enumerate(KINDS, start=1):
        codes, reports = _point(start, tmp / f"count-{kind}", run_dir, kind)
        assert codes == [0, 0] and all(r and "committed" in r for r in reports), reports
        assert [r["resumed"] for r in reports] == [step - 1] * 2
        ops[kind] = [r["ops"] for r in reports]
    assert ops["sharded"][1] > ops["full"][1] > 0  # rank 1 writes files only when sharded
    step = len(KINDS)
    chosen = random.Random(29)
    outcomes, killed_at = [], []
    for i in range(KILLS):
        kind, trigger = chosen.choice(KINDS), chosen.randrange(2)
        victims = chosen.choice(["self", "both"])
        kill_at, write_at = chosen.randint(1, ops[kind][trigger]), chosen.randint(1, 40)
        where = f"kill {i}: {kind}, rank {trigger} ({victims}) at operation {kill_at}"
        codes, reports = _point(start, tmp / f"kill-{i}", run_dir, kind, trigger, victims,
                                kill_at, write_at)  # fmt: skip
        killed_at.append((tmp / f"kill-{i}" / "killed at").read_text())
        dead = [trigger] if victims == "self" else [0, 1]
        assert [codes[r] for r in dead] == [-signal.SIGKILL] * len(dead), (where, codes)
        living = [r for r in reports if r is not None]
        assert len(living) == 2 - len(dead), (where, reports)
        assert all(r["resumed"] == step for r in living), (where, step, living)
        committed = _check_committed(run_dir, oracle)
        latest = latest_checkpoint(run_dir)
        assert latest is not None and latest in committed.values(), where
        now = load_checkpoint(latest)["step"]
        assert now in (step, step + 1), (where, now)
        for report in living:
            # A rank that lives says what became of the save: committed only if it was.
            if "committed" in report:
                assert Path(report["committed"]) == latest and now == step + 1, (where, report)
            else:
                assert "written in the background" in report["error"], (where, report)
                assert "committed" in report["error"], (where, report)
        outcomes.append(now - step)
        step = now
    # The kills landed before and after the commit, in every kind of operation.
    assert 0 < sum(outcomes) < KILLS, outcomes
    assert {"write", "fsync", "replace", "all_gather"} <= set(killed_at), killed_at
    # A last save, not killed, resumes from the newest complete checkpoint and tidies up.
    codes, reports = _point(start, tmp / "last", run_dir, "sharded")
    assert codes == [0, 0] and [r["resumed"] for r in reports] == [step] * 2, reports
    committed = _check_committed(run_dir, oracle)
    assert latest_checkpoint(run_dir) == committed[step + 1]
    names = {p.name for p in (run_dir / "checkpoints").iterdir()}
    expected = {name for p in committed.values() for name in (p.name, f"{p.name}.sha256")}
    assert names == expected | {"latest", "shards"}, names - expected


_EXITS = textwrap.dedent(
    """
    import sys
    import torch
    from torch import nn
    import tandem.checkpoint

    model = nn.Linear(512, 512)
    for step in range(3):
        handle = tandem.checkpoint.save({"model": model, "step": step}, f"{sys.argv[1]}/{step}.pt",
                                        async_=True)
        if sys.argv[2] == "wait":
            handle.wait()
    print("LEFT", flush=True)
    """
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["wait", "exit"])
def test_a_script_ends_cleanly_after_background_saves(tmp_path, how):
    # A writer thread still winding down when the interpreter finalized was stopped inside
    # torch's C++ code: the process aborted ("terminate called without an active exception",
    # exit -6) in 5 runs of 6, though every checkpoint had committed. Three runs.
    for run in range(3):
        folder = tmp_path / str(run)
        done = subprocess.run(
            [sys.executable, "-c", _EXITS, str(folder), how],
            capture_output=True, text=True, timeout=100,
        )  # fmt: skip
        assert done.returncode == 0 and "LEFT" in done.stdout, (done.returncode, done.stderr)
        state = {"model": nn.Linear(512, 512), "step": None}
        tandem.checkpoint.load(state, folder / "2.pt")
        assert state["step"] == 2
