"""``tandem.spawn``: ``mp.spawn`` with torchrun's environment and failures that do not hang.

Each process gets MASTER_ADDR, MASTER_PORT (a free port), RANK, LOCAL_RANK, WORLD_SIZE and
LOCAL_WORLD_SIZE, so ``tandem.init()`` inside ``fn`` needs no arguments. The first process to
raise (or die) stops the others, SIGTERM then SIGKILL, and its traceback is raised in the caller:
a rank that fails never leaves the others blocked in a collective until a 30-minute timeout.

A function defined interactively (a notebook cell, ``python -``, ``python -c``) lives in a
``__main__`` that a spawned process cannot import, and pickle sends functions by name: the
child would die unpickling it. Such a function is shipped by value with cloudpickle when it is
installed; otherwise, with the default start method, the processes are forked when that is safe
(no CUDA initialised, no other non-daemon thread); otherwise ``spawn`` raises at once, saying
what to do, before any process starts.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import pickletools
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.connection import Connection, wait
from typing import Any

from tandem.launch.failures import describe_exit
from tandem.launch.rendezvous import free_port

GRACE_S = 3.0

log = logging.getLogger("tandem.spawn")


class SpawnError(RuntimeError):
    """A spawned process failed; ``rank`` and the child's ``traceback`` are attached."""

    def __init__(self, rank: int, message: str, child_traceback: str = "") -> None:
        super().__init__(message + (f"\n\n{child_traceback}" if child_traceback else ""))
        self.rank = rank
        self.child_traceback = child_traceback


def _entry(
    payload: tuple[Callable[..., Any], tuple] | bytes,
    rank: int,
    env: dict[str, str],
    conn: Connection,
) -> None:
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    try:
        # Bytes: (fn, args) shipped by value with cloudpickle, whose output plain pickle loads;
        # inside the try so that a failure to rebuild them comes back as a traceback.
        fn, args = pickle.loads(payload) if isinstance(payload, bytes) else payload
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
    start_method: str | None = None,
    grace_s: float = GRACE_S,
) -> list[Any]:
    """Run ``fn(rank, *args)`` in ``nprocs`` processes; return their results in rank order.

    Args:
        fn: a module-level function, or one defined in a notebook or ``python -`` (see the
            module's docstring); its first argument is the rank.
        nprocs: how many processes (ranks 0..nprocs-1 on this machine).
        args: the remaining arguments of ``fn``, the same for every rank.
        start_method: "spawn", "forkserver" or "fork"; None (the default) is "spawn", safe with
            CUDA and threads, or "fork" for an interactive function when cloudpickle is missing.
        grace_s: seconds between SIGTERM and SIGKILL when stopping the others after a failure.

    Raises:
        ValueError: nprocs < 1; or ``fn`` (or an argument) was defined interactively and can
            be neither shipped by value (no cloudpickle) nor forked, saying why and what to do.
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
    method, payload = _plan(fn, tuple(args), start_method)
    ctx = mp.get_context(method)
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
        "TANDEM_SPAWN": "1",  # the ranks are numbered here: no duplicate RANK to look for
    }
    procs, conns = [], []
    for rank in range(nprocs):
        receiver, sender = ctx.Pipe(duplex=False)
        p = process(target=_entry, args=(payload, rank, env, sender), daemon=False)
        with _unreadable_main_hidden():
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


def _plan(
    fn: Callable[..., Any], args: tuple, start_method: str | None
) -> tuple[str, tuple[Callable[..., Any], tuple] | bytes]:
    """The start method, and what to send the children: ``(fn, args)``, or them cloudpickled."""
    method = start_method or "spawn"
    if method == "fork" or not _interactive_main():
        return method, (fn, args)
    try:
        import cloudpickle  # type: ignore[import-untyped]  # not a dependency: used if installed
    except ImportError:
        pass
    else:
        return method, cloudpickle.dumps((fn, args))
    if not _refers_to_main((fn, args)):
        return method, (fn, args)
    unsafe = _fork_unsafe()
    if start_method is None and unsafe is None:
        log.debug("fn %r is defined in an interactive __main__: forking", fn)
        return "fork", (fn, args)
    why = (
        f"start_method={start_method!r} was asked for"
        if start_method is not None
        else f"fork is not safe here: {unsafe}"
    )
    name = getattr(fn, "__qualname__", repr(fn))
    raise ValueError(
        f"tandem.spawn: {name} (or an argument) is defined in an interactive __main__ (a "
        "notebook, `python -` or `python -c`), which a spawned process cannot import, and "
        f"{why}. Do one of: `pip install cloudpickle` (then it is sent by value); move the "
        "function into a .py file and import it; or pass start_method='fork' (only before "
        "CUDA is initialised)"
    )


def _interactive_main() -> bool:
    """Whether a spawned child would fail to import this process's ``__main__``."""
    main = sys.modules.get("__main__")
    if main is None or getattr(main.__spec__, "name", None):  # python -m: imported by name
        return False
    path = getattr(main, "__file__", None)
    return path is None or not os.path.isfile(path)


def _refers_to_main(payload: Any) -> bool:
    """Whether pickling ``payload`` names something in ``__main__`` (by reference)."""
    try:
        data = pickle.dumps(payload)
    except Exception:  # lambdas, closures: multiprocessing's own error says it best
        return False
    # STACK_GLOBAL takes the module as a pushed string; GLOBAL (older protocols) "module name".
    return any(
        isinstance(arg, str) and (arg == "__main__" or arg.startswith("__main__ "))
        for _, arg, _ in pickletools.genops(data)
    )


def _fork_unsafe() -> str | None:
    """Why forking this process is unsafe, or None."""
    if "fork" not in mp.get_all_start_methods():
        return "this platform has no fork"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised in this process, and a forked child cannot use it"
    # A forked child has only this thread, and copies of the locks the others held: a lock
    # taken at that moment stays taken. Daemon threads (a notebook kernel's) are accepted.
    others = [
        t.name
        for t in threading.enumerate()
        if t is not threading.current_thread() and t.is_alive() and not t.daemon
    ]
    if others:
        return f"non-daemon threads {others} are running, and their locks would be copied"
    return None


@contextmanager
def _unreadable_main_hidden() -> Iterator[None]:
    """Hide ``__main__.__file__`` while a child starts, when it names no file (``<stdin>``).

    A spawned child runs the parent's main file again before it unpickles anything, and
    ``python -`` sets ``__file__`` to "<stdin>": the child would die on FileNotFoundError.
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None or os.path.isfile(path):
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


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
