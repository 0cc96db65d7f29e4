"""DCP checkpoints written in the background (``save(..., format="dcp", async_=True)``).

The oracle is the synchronous DCP save of the same state (itself checked against torch's own
DCP in test_dcp.py, test_dcp_sharded.py and test_dcp_zero.py), over Gloo in real processes.
Proven:

- **async == sync, though the training goes on at once**: a tandem.DDP model with a
  ShardedOptimizer (written per owner) and a tandem FSDP model with AdamW (each rank its
  slices), after 3 steps, saved synchronously and then in the background, the training taking
  a step and changing every parameter in place right after the call returns: every data file
  is the synchronous one byte for byte, and the metadata's entries, flattening map and storage
  places are the same.
- **the exit waits**: a script that saves in the background and exits at once (one process)
  leaves a complete checkpoint of the state at the call.
- **one save in flight, either format**: a DCP save started while a tandem-format save is
  being written, and the reverse, starts only once the other has committed.
- **errors**: a write that fails on one rank fails ``wait()`` on every rank with that rank's
  error, naming the checkpoint, and leaves no ``.metadata``; nobody waiting, the next save
  raises it on every rank. Bad input is a ValueError on every rank, the same message, before
  anything is written: ``kind="sharded"``, per-rank state (RNG), ranks that pass different
  ``async_`` or different ``kind``.
- **a kill never leaves a checkpoint that loads**: two ranks saving in the background over an
  older checkpoint are SIGKILLed (one rank, or both) at chosen operations of the background
  write (a half-written data file or ``.metadata``, an fsync, the rename that commits, DCP's
  collectives, the removal of the old ``.metadata``): unless ``.metadata`` was renamed into
  place, neither ``tandem.checkpoint.load`` nor torch's ``dcp.load`` accepts the directory, and
  the newest complete checkpoint resumes, bit for bit; if it was, it holds the state of the
  call, bit for bit.
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystem

import tandem
import tandem.checkpoint
from tandem.checkpoint.async_save import THREAD_NAME
from tandem.checkpoint.dcp import is_dcp, read_dcp_weights, save_dcp
from tandem.parallel.zero import ShardedOptimizer
from tests import models
from tests.harness import run_ranks
from tests.parallel.fsdp.models import FSDP, ScaledMLP, batch, mse, seeded

pytestmark = pytest.mark.distributed

STEPS = 3
UNITS = ("inp", "mid", "out")


def _zero(seed: int) -> tuple[Any, Any]:
    model = tandem.DDP(models.mlp(seed=seed))
    return model, ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.01)


def _fsdp(seed: int) -> tuple[Any, Any]:
    net = seeded(ScaledMLP, seed=seed)
    picked = {id(net.get_submodule(n)) for n in UNITS}
    model = FSDP(net, stage=3, auto_wrap=lambda m: id(m) in picked)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _step(model: Any, opt: Any, step: int) -> None:
    rank, ws = dist.get_rank(), dist.get_world_size()
    opt.zero_grad()
    if isinstance(model, FSDP):
        mse(model, *batch(step, rank, ws)).backward()
    else:
        x, y = models.batch(step, rank, 4, (10,))
        F.cross_entropy(model(x), y).backward()
    opt.step()


def _files(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.iterdir()) if f.name != ".metadata"}


def _same_metadata(a: Path, b: Path) -> bool:
    ma, mb = (dcp.FileSystemReader(str(p)).read_metadata() for p in (a, b))
    return (
        ma.state_dict_metadata == mb.state_dict_metadata
        and ma.planner_data == mb.planner_data
        and ma.storage_data == mb.storage_data
    )


@contextlib.contextmanager
def _failing_write(fail: bool) -> Iterator[None]:
    """DCP's file writer raises on this rank while it lasts (when ``fail``)."""
    writer = dcp.FileSystemWriter
    original = writer.write_data

    def write_data(self: Any, plan: Any, planner: Any) -> Any:
        raise OSError("no space left on device (test)")

    if fail:
        writer.write_data = write_data  # type: ignore[method-assign]
    try:
        yield
    finally:
        writer.write_data = original  # type: ignore[method-assign]


def _error(call: Any) -> str:
    try:
        call()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _body(tmp: str) -> dict:
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    # Async == sync, the live state changing as soon as the call returns.
    for name, build in (("zero", _zero), ("fsdp", _fsdp)):
        model, opt = build(0)
        for s in range(STEPS):
            _step(model, opt, s)
        state = {"model": model, "optimizer": opt, "step": STEPS}
        sync, background = Path(tmp, f"{name}-sync"), Path(tmp, f"{name}-async")
        tandem.checkpoint.save(state, sync, format="dcp")
        handle = tandem.checkpoint.save(state, background, format="dcp", async_=True)
        _step(model, opt, STEPS)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        out[f"{name}_waited"] = handle.wait() == background
        dist.barrier()
        out[f"{name}_bytes"] = _files(sync) == _files(background) and len(_files(sync)) == 2
        out[f"{name}_metadata"] = _same_metadata(sync, background)

    # One save in flight, either format: the second starts once the first committed.
    model, opt = _zero(1)
    state = {"model": model, "optimizer": opt, "step": 1}
    first = tandem.checkpoint.save(state, Path(tmp, "first.pt"), async_=True)
    second = save_dcp(state, Path(tmp, "second"), async_=True)
    out["dcp_after_tandem"] = first.done() and Path(tmp, "first.pt.sha256").is_file()
    tandem.checkpoint.save(state, Path(tmp, "third.pt"))
    out["tandem_after_dcp"] = second.done() and is_dcp(Path(tmp, "second"))

    # A write that fails on rank 1: raised by wait() on every rank; no .metadata.
    failed = Path(tmp, "failed")
    with _failing_write(rank == 1):
        handle = tandem.checkpoint.save(state, failed, format="dcp", async_=True)
        out["wait_error"] = _error(handle.wait)
        # Nobody waits: the next save raises it.
        unwaited = Path(tmp, "unwaited")
        pending = tandem.checkpoint.save(state, unwaited, format="dcp", async_=True)
        while not pending.done():  # failed under the patch (done() raises nothing)
            time.sleep(0.01)
    out["next_error"] = _error(lambda: save_dcp(state, Path(tmp, "after")))
    out["failed_left"] = [is_dcp(failed), is_dcp(unwaited), Path(tmp, "after").exists()]

    # Bad input: the same ValueError on every rank, nothing written.
    bad = Path(tmp, "bad")
    save = tandem.checkpoint.save
    out["bad"] = [
        _error(lambda: save(state, bad, format="dcp", async_=True, kind="sharded")),
        _error(lambda: save({**state, "rng": tandem.checkpoint.RNG()}, bad, format="dcp")),
        _error(lambda: save(state, bad, format="dcp", async_=rank == 0)),
        _error(lambda: save(state, bad, format="dcp", kind=("full", "sharded")[rank])),
        _error(lambda: save_dcp(state, bad, async_="yes")),  # type: ignore[call-overload]
    ]
    out["bad_wrote"] = bad.exists()
    return out


@pytest.mark.timeout(200)
def test_background_dcp_saves(tmp_path: Path) -> None:
    r0, r1 = run_ranks(_body, 2, args=(str(tmp_path),), timeout=150)
    for r in (r0, r1):
        for name in ("zero", "fsdp"):
            assert r[f"{name}_waited"] and r[f"{name}_bytes"] and r[f"{name}_metadata"], r
        assert r["dcp_after_tandem"] and r["tandem_after_dcp"], r
        assert r["failed_left"] == [False, False, False], r
        assert not r["bad_wrote"], r
    failed, unwaited = tmp_path / "failed", tmp_path / "unwaited"
    for r in (r0, r1):
        assert r["wait_error"].startswith("OSError"), r["wait_error"]
        assert f"checkpoint {failed}, written in the background, was not" in r["wait_error"]
        assert "no space left on device (test)" in r["wait_error"]
        assert r["next_error"].startswith("OSError") and str(unwaited) in r["next_error"]
    sharded, rng, mixed_async, mixed_kind, not_bool = r0["bad"]
    assert r1["bad"] == r0["bad"], (r0, r1)
    assert sharded.startswith("ValueError") and "kind='sharded'" in sharded
    assert rng.startswith("ValueError") and "'rng'" in rng and "per-rank state" in rng
    assert mixed_async.startswith("ValueError") and "rank 0: True, rank 1: False" in mixed_async
    assert mixed_kind == sharded  # rank 0 passed kind='full', and raises rank 1's refusal
    assert not_bool.startswith("ValueError") and "'yes'" in not_bool


EXITING = """
import sys, torch
from torch import nn
from tandem.checkpoint.dcp import save_dcp
torch.manual_seed(0)
net = nn.Linear(300, 300)
save_dcp({"model": net}, sys.argv[1], async_=True)
with torch.no_grad():
    net.weight.zero_()  # the state of the call is what is written, not this
"""


def test_a_script_that_exits_waits_for_its_background_dcp_save(tmp_path: Path) -> None:
    """One process, no process group: the interpreter's exit waits for the write in flight."""
    path = tmp_path / "exiting"
    done = subprocess.run(
        [sys.executable, "-c", EXITING, str(path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert is_dcp(path), sorted(p.name for p in path.iterdir())
    torch.manual_seed(0)
    expected = nn.Linear(300, 300).state_dict()
    assert _weights_equal(read_dcp_weights(path), expected)


def _weights_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(v, b[k]) for k, v in a.items())


# -- the kills ----------------------------------------------------------------------------------
#
# Two ranks (forked from the harness's forkserver, which has torch imported) train a
# tandem.DDP model with a ShardedOptimizer and save steps 1, 2, 3 in the background to the
# directories b, a, b: step 3 overwrites step 1's checkpoint, as a run keeping its last two
# does. During step 3's write, rank ``trigger`` counts the writer thread's operations and, at
# the ``at``-th, SIGKILLs itself (or its peer, then itself) instead of doing it; a file write
# is cut in half first. A counting run, never killed, lists every rank's operations and
# writes each step's expected state.


class _Killer:
    """Counts the operations of the writer thread of this process; dies at the ``at``-th."""

    def __init__(self, at: int | None, victims: list[int]) -> None:
        self.at, self.victims, self.ops = at, victims, []

    def op(self, what: str) -> bool:
        if threading.current_thread().name != THREAD_NAME:
            return False
        self.ops.append(what)
        return len(self.ops) == self.at

    def die(self) -> None:
        for pid in self.victims:  # the peer first: a job killed as a whole
            os.kill(pid, signal.SIGKILL)

    def install(self) -> None:
        def counted(original: Any, what: str) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                if self.op(what):
                    self.die()
                return original(*args, **kwargs)

            return call

        os.fsync = counted(os.fsync, "fsync")
        Path.rename = counted(Path.rename, "rename")  # type: ignore[method-assign]
        Path.unlink = counted(Path.unlink, "unlink")  # type: ignore[method-assign]
        for name in ("gather_object", "broadcast_object_list", "scatter_object_list"):
            setattr(dist, name, counted(getattr(dist, name), "collective"))
        create_stream, killer = FileSystem.create_stream, self

        @contextlib.contextmanager
        def stream(fs: Any, path: Any, mode: str) -> Iterator[Any]:
            with create_stream(fs, path, mode) as real:
                yield _CutStream(real, killer, Path(path).name)

        FileSystem.create_stream = stream  # type: ignore[method-assign]


class _CutStream(io.RawIOBase):
    """A file DCP writes: each write call is an operation; the fatal one writes half."""

    def __init__(self, real: Any, killer: _Killer, name: str) -> None:
        self.real, self.killer, self.name = real, killer, name

    def write(self, data: Any) -> int:
        if self.killer.op(f"write {self.name}"):
            self.real.write(bytes(memoryview(data))[: len(memoryview(data).cast("B")) // 2])
            self.real.flush()
            self.killer.die()
        return self.real.write(data)

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.real.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.real.seek(offset, whence)

    def flush(self) -> None:
        self.real.flush()

    def fileno(self) -> int:
        return self.real.fileno()

    def close(self) -> None:  # DCP closes its stream wrapper; the file is create_stream's
        pass


def _expected(model: Any, opt: ShardedOptimizer) -> dict | None:
    full = opt.full_state_dict(0)
    return None if full is None else {"model": model.module.state_dict(), "optimizer": full}


def _kill_rank(rank: int, args: dict[str, Any]) -> None:
    out = Path(args["out"])
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=2)
        pids: list[Any] = [None, None]
        dist.all_gather_object(pids, os.getpid())
        victims = {"both": [pids[1 - rank], os.getpid()], "self": [os.getpid()]}
        at = args["at"] if rank == args["trigger"] else None
        killer = _Killer(at, victims[args["victims"]])
        model, opt = _zero(0)
        state = {"model": model, "optimizer": opt, "step": 0}
        outcome = "not reached"
        for step in (1, 2, 3):
            _step(model, opt, step)
            state["step"] = step
            if args["counting"]:
                expected = _expected(model, opt)
                if expected is not None:
                    torch.save(expected, out / f"expected-{step}.pt")
            if step == 3:
                killer.install()
            path = out / ("a", "b")[step % 2]
            handle = tandem.checkpoint.save(state, path, format="dcp", async_=True)
            try:
                outcome = f"committed {handle.wait()}"
            except Exception as e:
                outcome = f"{type(e).__name__}: {e}"
        report = {"ops": killer.ops, "outcome": outcome}
    except BaseException:
        report = {"crashed": traceback.format_exc()}
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    os._exit(0)  # a peer may be dead: no teardown


def _job(
    out: Path,
    *,
    at: int | None = None,
    trigger: int = 0,
    victims: str = "self",
    counting: bool = False,
    timeout: float = 60.0,
) -> list[dict]:
    """One job of two ranks; each rank's report ({} for one killed)."""
    out.mkdir()
    context = mp.get_context("forkserver")  # the harness's: torch imported once
    args = {"out": str(out), "at": at, "trigger": trigger, "victims": victims}
    args["counting"] = counting
    procs = [context.Process(target=_kill_rank, args=(r, args)) for r in (0, 1)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join()
    codes = [p.exitcode for p in procs]
    assert not hung, f"ranks {hung} still running after {timeout} s (a survivor must raise)"
    assert all(c in (0, -signal.SIGKILL) for c in codes), f"failed: exit codes {codes}"
    reports = []
    for r in (0, 1):
        f = out / f"rank{r}.json"
        reports.append(json.loads(f.read_text()) if f.is_file() else {})
        assert "crashed" not in reports[-1], reports[-1]["crashed"]
    return reports


def _loaded(path: Path) -> dict:
    """The checkpoint at ``path`` loaded by tandem in this process into a plain module and
    AdamW (CheckpointError if it is not complete)."""
    net = models.mlp(seed=9)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    state = {"model": net, "optimizer": opt, "step": 0}
    tandem.checkpoint.load(state, path)
    return {"model": net.state_dict(), "optimizer": opt.state_dict(), "step": state["step"]}


def _torch_refuses(path: Path) -> bool:
    net = models.mlp()
    state = {"model": net.state_dict(), "step": 0}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, checkpoint_id=path)
    except (Exception, dcp.api.CheckpointException):  # DCP's is a BaseException
        return True
    return False


def _same(loaded: dict, expected: dict) -> bool:
    model = loaded["model"].keys() == expected["model"].keys() and all(
        torch.equal(v, expected["model"][k]) for k, v in loaded["model"].items()
    )
    a, b = loaded["optimizer"], expected["optimizer"]
    optimizer = (
        a["param_groups"] == b["param_groups"]
        and a["state"].keys() == b["state"].keys()
        and all(
            a["state"][i].keys() == s.keys()
            and all(torch.equal(v, a["state"][i][k]) for k, v in s.items())
            for i, s in b["state"].items()
        )
    )
    return model and optimizer


def _points(ops: list[list[str]]) -> list[tuple[int, str, int, str]]:
    """(rank, victims, operation number, what) of the kills: the removal of the old
    ``.metadata``, each rank's data file half written, an fsync, ``.metadata`` half written,
    its rename, DCP's collectives, and rank 0's last operation (after the commit)."""

    def nth(rank: int, what: str, which: str = "first") -> int:
        found = [i + 1 for i, op in enumerate(ops[rank]) if op == what]
        assert found, (what, ops[rank])
        return {"first": found[0], "middle": found[len(found) // 2], "last": found[-1]}[which]

    return [
        (0, "self", nth(0, "unlink"), "the old .metadata removed"),
        (1, "self", nth(1, "write __1_0.distcp", "middle"), "rank 1's file half written"),
        (0, "both", nth(0, "write __0_0.distcp", "middle"), "rank 0's file half written"),
        (1, "both", nth(1, "fsync"), "rank 1's file fsynced"),
        (1, "self", nth(1, "collective", "middle"), "a collective of DCP's"),
        (0, "self", nth(0, "write .metadata.tmp", "middle"), ".metadata half written"),
        (0, "both", nth(0, "rename"), ".metadata renamed into place"),
        (0, "self", len(ops[0]), "rank 0's last operation"),
    ]


@pytest.mark.timeout(400)
def test_a_kill_during_a_background_dcp_save_never_leaves_a_checkpoint_that_loads(
    tmp_path: Path,
) -> None:
    counted = _job(tmp_path / "count", counting=True)
    assert [r["outcome"] for r in counted] == [f"committed {tmp_path / 'count' / 'b'}"] * 2
    expected = {
        s: torch.load(tmp_path / "count" / f"expected-{s}.pt", weights_only=True) for s in (1, 2, 3)
    }
    assert _same(_loaded(tmp_path / "count" / "b"), expected[3])
    complete = []
    for i, (trigger, victims, at, what) in enumerate(_points([r["ops"] for r in counted])):
        out = tmp_path / f"kill-{i}"
        reports = _job(out, at=at, trigger=trigger, victims=victims)
        where = f"kill {i} ({what}: rank {trigger}, {victims}, operation {at})"
        # The older checkpoint is whole, whatever the kill did.
        assert _same(_loaded(out / "a"), expected[2]), where
        if is_dcp(out / "b"):  # untouched yet (step 1), or committed (step 3): whole
            loaded = _loaded(out / "b")
            complete.append((what, loaded["step"]))
            assert loaded["step"] in (1, 3) and _same(loaded, expected[loaded["step"]]), where
        else:
            with pytest.raises(tandem.checkpoint.CheckpointError, match="not a complete DCP"):
                _loaded(out / "b")
            assert _torch_refuses(out / "b"), where
            # A rank that lived never says it committed what did not.
            assert not any(r.get("outcome", "").startswith("committed") for r in reports), where
        if victims == "self":  # the other rank lived, and its wait() returned or raised
            assert reports[1 - trigger].get("outcome", "").startswith(("committed", "Runtime")), (
                where,
                reports,
            )
        # Resume: the newest complete checkpoint, the state of its step.
        newest = max(
            (p for p in (out / "a", out / "b") if is_dcp(p)), key=lambda p: _loaded(p)["step"]
        )
        assert _same(_loaded(newest), expected[_loaded(newest)["step"]]), where
    # Killed before anything was written over it, the old checkpoint is whole; once written
    # over, nothing loads until the commit; after it, the new checkpoint is whole.
    assert complete == [("the old .metadata removed", 1), ("rank 0's last operation", 3)]
