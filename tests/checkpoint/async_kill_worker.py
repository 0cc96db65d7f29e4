"""Runs of two ranks that resume, train a step and save in the background, SIGKILLed at a
chosen operation of that background write (test_async_save.py sends them).

:func:`serve` runs in one process that imports all this once, and forks the two ranks of each
run the test sends it (a rank starts in milliseconds instead of importing torch's compiler,
which tandem.DDP pulls in, for seconds). The ranks join through a file store. The run:
tandem.DDP over an MLP with dropout, a ShardedOptimizer(AdamW), ``tandem.checkpoint.RNG()`` and
a step counter, saved by a :class:`~tandem.checkpoint.checkpointer.Checkpointer` with
``async_=True`` into ``run_dir`` (:func:`run`):

1. resume from ``latest`` (nothing at the first run), train one step, save that step;
2. every file written, fsync, rename, unlink, temporary file and collective of the writer
   thread is counted; the ``kill_at``-th one, on rank ``trigger``, is not done (a file is
   written up to its ``write_at``-th write call, that one half): the process SIGKILLs itself,
   or its peer and then itself (``victims == "both"``: the job);
3. a rank that lives writes ``rank<r>.json``: the step it resumed from, whether its
   ``wait()`` committed or raised (with the message), and the operations counted.

:func:`uninterrupted` is the oracle: the same training without a stop, each step saved
synchronously in both kinds.
"""

from __future__ import annotations

import faulthandler
import json
import os
import random
import signal
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tandem
from tandem.checkpoint import RNG
from tandem.checkpoint.async_save import THREAD_NAME
from tandem.checkpoint.checkpointer import Checkpointer
from tandem.parallel.engine import Engine, make_engine

KEEP = 100  # nothing pruned but the leftovers of killed saves


class Steps:
    """The run's step count, saved with it."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]


def build(kind: str) -> tuple[Engine, dict[str, Any]]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))
    opt = tandem.ShardedOptimizer(net.parameters(), torch.optim.AdamW, lr=0.01)
    engine = make_engine(net, opt, checkpoint_format=kind)
    for seed in (torch.manual_seed, random.seed, np.random.seed):  # each rank its own draws
        seed(100 + dist.get_rank())
    return engine, {"rng": RNG(), "steps": Steps()}


def train_step(engine: Engine, steps: Steps) -> None:
    g = torch.Generator().manual_seed(1000 * steps.step + dist.get_rank())
    x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
    loss = F.cross_entropy(engine.model(x), y)
    loss.backward()
    engine.optimizer.step()
    engine.optimizer.zero_grad()
    steps.step += 1


def uninterrupted(rank: int, args: dict[str, Any]) -> None:
    """The oracle: ``args["steps"]`` steps, each saved synchronously in both kinds."""
    _join(rank, args)
    os.fsync = lambda fd: None  # what is written counts here, not that it lasts: faster
    engine, objects = build("sharded")
    run_dir = Path(args["run_dir"])
    savers = [Checkpointer(run_dir / kind, keep=KEEP, kind=kind) for kind in ("full", "sharded")]
    for _ in range(args["steps"]):
        train_step(engine, objects["steps"])
        for saver in savers:
            saver.save(engine, objects, epoch=0, step=objects["steps"].step)
    dist.barrier()


class _Killer:
    """Counts the writer thread's operations; dies at the ``at``-th one instead of doing it.

    Writing a file is one operation, however many write calls it takes: when it is the fatal
    one, the process dies in its ``write_at``-th call, with half of that call's bytes written,
    or before its flush if it has fewer calls (whole, not fsynced)."""

    def __init__(self, at: int | None, write_at: int, victims: list[int], note: Path) -> None:
        self.at, self.write_at, self.victims, self.count = at, write_at, victims, 0
        self.note = note  # where the fatal operation's name is written

    def op(self) -> bool:
        """Count one operation; True if it is the one to die at."""
        if threading.current_thread().name != THREAD_NAME:
            return False
        self.count += 1
        return self.count == self.at

    def die(self, what: str) -> None:
        self.note.write_text(what)
        for pid in self.victims:  # the peer first: a job killed as a whole
            os.kill(pid, signal.SIGKILL)

    def install(self) -> None:
        def counted(original: Any, what: str) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                if self.op():
                    self.die(what)
                return original(*args, **kwargs)

            return call

        for module, name in ((os, "fsync"), (os, "replace"), (os, "unlink")):
            setattr(module, name, counted(getattr(module, name), name))
        tempfile.mkstemp = counted(tempfile.mkstemp, "mkstemp")  # type: ignore[assignment]
        dist.all_gather = counted(dist.all_gather, "all_gather")
        fdopen = os.fdopen

        def opened(*args: Any, **kwargs: Any) -> Any:
            return _Counted(fdopen(*args, **kwargs), self)

        os.fdopen = opened  # type: ignore[assignment]


class _Counted:
    """A file being written: its writes are one operation of the killer's."""

    def __init__(self, file: Any, killer: _Killer) -> None:
        self._file, self._killer = file, killer
        self._calls, self._fatal = 0, False

    def write(self, data: Any) -> int:
        self._calls += 1
        if self._calls == 1:
            self._fatal = self._killer.op()
        if self._fatal and self._calls == self._killer.write_at:
            self._file.write(bytes(memoryview(data))[: len(data) // 2])
            self._file.flush()
            self._killer.die("write")
        return self._file.write(data)

    def flush(self) -> None:
        if self._fatal:  # fewer write calls than write_at: whole, but neither flushed nor synced
            self._killer.die("flush")
        self._file.flush()

    def __enter__(self) -> _Counted:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


def _join(rank: int, args: dict[str, Any]) -> None:
    stacks = open(Path(args["out"]) / f"stack{rank}.txt", "w")  # noqa: SIM115 (till exit)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    torch.set_num_threads(1)
    store = f"file://{args['out']}/store"
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=2)


def run(rank: int, args: dict[str, Any]) -> None:
    out = Path(args["out"])
    _join(rank, args)
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    engine, objects = build(args["kind"])
    Path(args["run_dir"]).mkdir(exist_ok=True)  # as the Trainer's check makes it
    saver = Checkpointer(args["run_dir"], keep=KEEP, kind=args["kind"], async_=True)
    saver.resume(engine, objects, "latest")
    resumed = objects["steps"].step
    train_step(engine, objects["steps"])
    victims = {"both": [pids[1 - rank], os.getpid()], "self": [os.getpid()]}[args["victims"]]
    at = args["kill_at"] if rank == args["trigger"] else None
    killer = _Killer(at, args["write_at"], victims, out / "killed at")
    killer.install()
    try:
        saver.save(engine, objects, epoch=0, step=objects["steps"].step)
        outcome = {"committed": str(saver.wait())}
    except Exception as e:
        outcome = {"error": f"{type(e).__name__}: {e}"}
    report = {"resumed": resumed, "ops": killer.count, **outcome}
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    os._exit(0)  # a peer may be dead: no teardown


def serve(conn: Any) -> None:
    """Fork the two ranks of every run the test sends (``(function name, args, timeout)``);
    send back their exit codes (``"hung"`` for one still running at the timeout, stopped
    after its stacks were written). None ends it."""
    while (job := conn.recv()) is not None:
        conn.send(_fork_ranks(*job))


def _fork_ranks(name: str, args: dict[str, Any], timeout: float) -> list[int | str]:
    # This process has no thread of its own (no process group, no doctor): forking is safe.
    pids = []
    for rank in (0, 1):
        pid = os.fork()
        if pid == 0:
            try:
                globals()[name](rank, args)
            except BaseException:
                traceback.print_exc()
                os._exit(1)
            os._exit(0)
        pids.append(pid)
    codes: dict[int, int | str] = {}
    deadline = time.monotonic() + timeout
    while len(codes) < len(pids) and time.monotonic() < deadline:
        for pid in pids:
            if pid not in codes and (status := os.waitpid(pid, os.WNOHANG))[0]:
                codes[pid] = os.waitstatus_to_exitcode(status[1])
        time.sleep(0.005)
    for pid in [p for p in pids if p not in codes]:
        os.kill(pid, signal.SIGUSR1)  # faulthandler writes its stacks
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        codes[pid] = "hung"
    return [codes[pid] for pid in pids]
