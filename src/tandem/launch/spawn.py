"""``tandem.spawn``: ``mp.spawn`` with torchrun's environment and failures that do not hang.

Each process gets MASTER_ADDR, MASTER_PORT (a free port), RANK, LOCAL_RANK, WORLD_SIZE and
LOCAL_WORLD_SIZE, so ``tandem.init()`` inside ``fn`` needs no arguments. The first process to
raise (or die) stops the others, SIGTERM then SIGKILL, and its traceback is raised in the caller:
a rank that fails never leaves the others blocked in a collective until a 30-minute timeout.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from tandem.launch.failures import describe_exit
from tandem.launch.rendezvous import free_port

GRACE_S = 3.0


class SpawnError(RuntimeError):
    """A spawned process failed; ``rank`` and the child's ``traceback`` are attached."""

    def __init__(self, rank: int, message: str, child_traceback: str = "") -> None:
        super().__init__(message + (f"\n\n{child_traceback}" if child_traceback else ""))
        self.rank = rank
        self.child_traceback = child_traceback


def _entry(
    fn: Callable[..., Any], rank: int, args: tuple, env: dict[str, str], conn: Connection
) -> None:
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    try:
        result = fn(rank, *args)
    except BaseException as exc:
        conn.send(("error", "".join(traceback.format_exception(exc))))
        conn.close()
        raise SystemExit(1) from None
    try:
        conn.send(("ok", result))
    except Exception as exc:  # an unpicklable return value is the user's to know about
        conn.send(("error", f"the return value of rank {rank} could not be pickled: {exc}"))
    conn.close()


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    *,
    start_method: str = "spawn",
    grace_s: float = GRACE_S,
) -> list[Any]:
    """Run ``fn(rank, *args)`` in ``nprocs`` processes; return their results in rank order.

    Args:
        fn: a picklable (module-level) function; its first argument is the rank.
        nprocs: how many processes (ranks 0..nprocs-1 on this machine).
        args: the remaining arguments of ``fn``, the same for every rank.
        start_method: "spawn" (the default, safe with CUDA and threads), "forkserver" or "fork".
        grace_s: seconds between SIGTERM and SIGKILL when stopping the others after a failure.

    Raises:
        ValueError: nprocs < 1.
        SpawnError: a process raised or died; the first one's rank and traceback.

    Example::

        def train(rank, epochs):
            w = tandem.init()          # the environment is already set
            ...
            return final_loss

        losses = tandem.spawn(train, nprocs=2, args=(10,))
    """
    if nprocs < 1:
        raise ValueError(f"nprocs={nprocs} must be >= 1")
    ctx = mp.get_context(start_method)
    # typeshed declares Process on each concrete context, not on the BaseContext that
    # get_context(str) is typed to return; every context it returns has one.
    process = ctx.Process  # type: ignore[attr-defined]
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "GROUP_RANK": "0",
        "NODE_RANK": "0",
    }
    procs, conns = [], []
    for rank in range(nprocs):
        receiver, sender = ctx.Pipe(duplex=False)
        p = process(target=_entry, args=(fn, rank, tuple(args), env, sender), daemon=False)
        p.start()
        sender.close()
        procs.append(p)
        conns.append(receiver)
    try:
        return _join(procs, conns, grace_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()


def _join(procs: list, conns: list[Connection], grace_s: float) -> list[Any]:
    results: list[Any] = [None] * len(procs)
    pending = dict(enumerate(procs))
    while pending:
        # A message, or a process gone without one (killed, os._exit), wakes us up.
        ready = wait([conns[r] for r in pending] + [p.sentinel for p in pending.values()])
        for rank in list(pending):
            message = _receive(conns[rank]) if conns[rank] in ready else None
            proc = pending[rank]
            if message is None and proc.sentinel not in ready:
                continue
            if message is not None and message[0] == "ok":
                results[rank] = message[1]
                proc.join()
                del pending[rank]
                continue
            if message is None and proc.exitcode is None:
                proc.join(1.0)
            _stop(list(pending.values()), grace_s, failed=proc)
            if message is not None:
                raise SpawnError(rank, f"tandem.spawn: rank {rank} raised", message[1])
            how = describe_exit(proc.exitcode if proc.exitcode is not None else -signal.SIGKILL)
            raise SpawnError(rank, f"tandem.spawn: rank {rank} died without a traceback: {how}")
    return results


def _receive(conn: Connection) -> tuple[str, Any] | None:
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None


def _stop(procs: list, grace_s: float, failed: Any) -> None:
    others = [p for p in procs if p is not failed and p.is_alive()]
    for p in others:
        p.terminate()
    deadline = time.monotonic() + grace_s
    while any(p.is_alive() for p in others) and time.monotonic() < deadline:
        time.sleep(0.02)
    for p in others:
        if p.is_alive():
            p.kill()
