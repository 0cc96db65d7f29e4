"""Run a test function in N real processes, with a timeout that shows every rank's traceback.

The idea of PyTorch's MultiProcessTestCase in a small harness of our own:

- each rank is a real OS process (forked from a forkserver that has imported torch once, so a
  rank starts in milliseconds instead of re-importing torch);
- the environment is the one torchrun gives (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK, ...);
- a rank that raises has its traceback reported; the others get a short grace period to report
  theirs (a peer's death often leaves them blocked in a collective), then are stopped;
- a test that exceeds its timeout fails with the Python stack of every rank still running, dumped
  by faulthandler at the moment of the timeout: a hung collective fails in seconds, readably;
  a rank that crashes in C++ (a segfault, an abort) leaves the stack it crashed in.

Example::

    def _body(scale):
        import torch.distributed as dist
        t = torch.ones(1) * dist.get_rank() * scale
        dist.all_reduce(t)
        return t.item()

    assert run_ranks(_body, world_size=2, args=(3.0,)) == [3.0, 3.0]
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import random
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

_CTX = mp.get_context("forkserver")
# What the ranks of most tests import, imported once per test worker instead of once per rank:
# torch's DDP imports torch._dynamo when it is built (1-1.7 s), which brings DTensor, FSDP and
# DCP with it. (tandem itself does not import dynamo: test_ddp_compile checks that in a fresh
# interpreter, where tandem.DDP must work with dynamo never imported.)
_CTX.set_forkserver_preload(
    [
        "torch",
        "torch.distributed",
        "torch._dynamo",
        "torch.distributed.checkpoint",
        "torch.distributed.fsdp",
        "tandem",
        "tandem.parallel.ddp",
        "tandem.checkpoint",
        "tests.models",
    ]
)

# A peer's failure usually leaves the survivors blocked in a collective: give them this long to
# finish or report their own error before they are stopped and their stacks dumped.
GRACE_S = 5.0


class RankFailure(AssertionError):
    """One or more ranks raised, died or timed out; the message holds every rank's report."""


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A TCP port that is free on loopback now, chosen outside the kernel's ephemeral range.

    A port the kernel hands out for ``bind(0)`` comes from the same range as the local ports of
    outgoing connections (every TCPStore client, every Gloo pair): between this call and the
    moment rank 0 listens, such a connection can take it (EADDRINUSE, seen on CI). Below the
    ephemeral range only another test's ``free_port`` could pick the same port: a random one of
    thousands, checked free.
    """
    low, _ = _ephemeral_range()
    start = 20000 if low > 21000 else 1024
    for _ in range(200):
        port = random.randrange(start, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(
    fn: Callable[..., Any],
    args: tuple,
    rank: int,
    env: dict[str, str],
    outdir: str,
    init: str | None,
) -> None:
    os.environ.update(env)
    stacks = open(os.path.join(outdir, f"stack{rank}.txt"), "w")  # noqa: SIM115 (lives till exit)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    # A crash in C++ (a segfault in a backend, an abort) leaves its Python stack there too.
    faulthandler.enable(file=stacks, all_threads=True)
    import torch

    # Two ranks on two cores: one intra-op thread each, or they fight over the cores.
    torch.set_num_threads(1)
    import torch.distributed as dist

    result: dict[str, Any]
    try:
        if init is not None:
            try:
                dist.init_process_group(init)
            except Exception as exc:
                if "EADDRINUSE" not in str(exc):
                    raise
                # Another program took MASTER_PORT after free_port chose it: run_ranks starts
                # the ranks again on another port (torch's own test harness retries too).
                result = {"ok": False, "port_taken": True, "error": str(exc)}
                Path(os.path.join(outdir, f"result{rank}.pkl")).write_bytes(pickle.dumps(result))
                os._exit(0)
        value = fn(*args)
        result = {"ok": True, "value": value}
    except BaseException as exc:  # report everything, KeyboardInterrupt included
        result = {"ok": False, "error": "".join(traceback.format_exception(exc))}
    path = os.path.join(outdir, f"result{rank}.pkl")
    try:
        payload = pickle.dumps(result)
    except Exception as exc:
        payload = pickle.dumps(
            {"ok": False, "error": f"result of rank {rank} not picklable: {exc}"}
        )
    Path(path + ".tmp").write_bytes(payload)
    os.replace(path + ".tmp", path)
    sys.stdout.flush()
    sys.stderr.flush()
    if result["ok"] and init is not None and dist.is_initialized():
        # Wait for the peers before tearing down: Gloo can abort a process whose peer destroys
        # its group mid-operation. (After a failure the parent stops whoever is stuck here.)
        dist.barrier()
        dist.destroy_process_group()
    os._exit(0)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    timeout: float = 60.0,
    init: str | None = "gloo",
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` real processes; return each rank's return value.

    ``fn`` must be a module-level function (it is pickled by reference). With ``init="gloo"``
    the default process group is created from the environment before ``fn`` runs and destroyed
    after; ``init=None`` leaves that to ``fn`` (tests of ``tandem.init`` itself). ``env`` adds
    variables to every rank, ``{rank}`` in a value is replaced by the rank.
    """
    for _ in range(2):
        try:
            return _launch(fn, world_size, args, timeout, init, env)
        except _PortTaken:
            continue
    return _launch(fn, world_size, args, timeout, init, env)


class _PortTaken(RankFailure):
    """Rank 0 could not listen on the port chosen for the harness's own process group."""


def _launch(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple,
    timeout: float,
    init: str | None,
    env: dict[str, str] | None,
) -> list[Any]:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="tandem-ranks-") as outdir:
        procs = []
        for rank in range(world_size):
            rank_env = {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(world_size),
                "GROUP_RANK": "0",
            }
            # The ranks fork from a server started with the environment of its first use: the
            # test's own report folder (conftest's, or the test's) is handed down explicitly.
            if "TANDEM_REPORT_DIR" in os.environ:
                rank_env["TANDEM_REPORT_DIR"] = os.environ["TANDEM_REPORT_DIR"]
            for key, value in (env or {}).items():
                rank_env[key] = value.replace("{rank}", str(rank))
            p = _CTX.Process(
                target=_child, args=(fn, args, rank, rank_env, outdir, init), daemon=True
            )
            p.start()
            procs.append(p)
        return _collect(procs, outdir, timeout)


def _collect(procs: list, outdir: str, timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    reason = None
    while any(p.is_alive() for p in procs):
        now = time.monotonic()
        failed = [r for r in range(len(procs)) if _failed(r, procs[r], outdir)]
        if failed and _port_taken(outdir, failed[0]):
            for p in procs:
                p.kill()
                p.join(5)
            raise _PortTaken(f"rank {failed[0]} could not listen on MASTER_PORT (EADDRINUSE)")
        if failed and reason is None:
            reason = f"rank {failed[0]} failed"
            deadline = min(deadline, now + GRACE_S)
        if now >= deadline:
            reason = reason or f"timed out after {timeout:.0f} s"
            break
        time.sleep(0.02)
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in alive:
        os.kill(procs[r].pid, signal.SIGUSR1)  # faulthandler dumps the stack of every thread
    time.sleep(0.5 if alive else 0)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)

    reports, values, ok = [], [], True
    for rank, p in enumerate(procs):
        path = os.path.join(outdir, f"result{rank}.pkl")
        if os.path.exists(path):
            result = pickle.loads(Path(path).read_bytes())
            values.append(result.get("value"))
            if not result["ok"]:
                ok = False
                reports.append(f"--- rank {rank} raised:\n{result['error']}")
        else:
            ok = False
            stack_file = Path(outdir, f"stack{rank}.txt")
            stack = stack_file.read_text() if stack_file.exists() else ""
            state = "still running" if rank in alive else f"exited with code {p.exitcode}"
            reports.append(f"--- rank {rank} {state}, stack at the time:\n{stack or '(none)'}")
            values.append(None)
    if not ok:
        raise RankFailure(f"{reason or 'ranks failed'}\n" + "\n".join(reports))
    return values


def _port_taken(outdir: str, rank: int) -> bool:
    try:
        return bool(pickle.loads(Path(outdir, f"result{rank}.pkl").read_bytes()).get("port_taken"))
    except Exception:
        return False


def _failed(rank: int, proc: Any, outdir: str) -> bool:
    path = os.path.join(outdir, f"result{rank}.pkl")
    if os.path.exists(path):
        try:
            return not pickle.loads(Path(path).read_bytes())["ok"]
        except Exception:
            return False  # being written
    return not proc.is_alive() and proc.exitcode not in (None, 0)
