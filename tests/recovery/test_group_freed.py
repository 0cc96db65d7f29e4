"""The old process group of a re-form is freed, within a bound, even with a peer cut off.

Proves, with real processes over Gloo: rank 2 is SIGSTOPped (no reset ever comes from it: its
kernel keeps its connections open) while ranks 0 and 1 wait on it in an all-reduce of a group
whose timeout is 60 s, as a re-formed group's is. Each survivor then takes the group down as a
re-form does (``tandem.recovery._abandon_group``), and, with rank 2 still stopped:

- the all-reduce it was waiting in fails at once (its connections were shut down from this
  side) instead of at the group's timeout;
- the old group is freed within :data:`BOUND_S` on the reaper thread (its destructor returned,
  every reference having been the reaper's), while the calling thread did not wait for it;
- after :data:`CYCLES` such re-forms, each followed by a new group of all three (rank 2
  resumed) whose all-reduce sums correctly, every rank has as many threads and sockets as it
  had with the first group, where each group left behind keeps three threads (its loop and
  two workers) and a socket per peer (the ranks are forked from the harness's server, which
  has imported torch: cheap);
- a survivor that exits right after a re-form (a fresh interpreter, so that its exit is a
  real one), its reaper maybe still at work and its peer still stopped, exits at once and
  cleanly: the interpreter's teardown neither drops the old group on the main thread (which
  would wait out the work's 60 s) nor finalizes under a destructor still running on the
  reaper (whose return would then abort the process).

A rank that hangs shows its stacks: the harness's timeout, or faulthandler in the fresh
interpreters.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.harness import free_port, run_ranks
from tests.launching import ROOT, clean_env, python_path

pytestmark = pytest.mark.distributed

CYCLES = 3
#: How long a survivor may take to free the old group once it took it down.
BOUND_S = 5.0
#: How long a survivor may take from its last line to the end of its process.
EXIT_S = 10.0
#: The old groups' timeout: only their own timeout would free them without the cut.
GROUP_TIMEOUT_S = 60.0
#: A rank still running after this long dumps its stacks and exits.
HANG_S = 90.0


def _counts() -> tuple[int, int]:
    """This process's threads and open sockets."""
    sockets = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed since
            sockets += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return len(os.listdir("/proc/self/task")), sockets


def _settled(base: tuple[int, int], within: float) -> tuple[int, int]:
    """The counts once they are back to ``base`` (a gloo thread ends just after its group's
    destructor returns), or as they are after ``within`` seconds."""
    deadline = time.monotonic() + within
    while _counts() != base and time.monotonic() < deadline:
        time.sleep(0.02)
    return _counts()


def _stop_rank(store: dist.Store, victim: int, key: str) -> None:
    """The victim sits in a store wait; the lowest rank stops it there, and the others go on
    once it is stopped."""
    me = dist.get_rank()
    if me == victim:
        store.set(f"idle/{key}", "1")
        store.wait([f"resume/{key}"])  # stopped in here
        return
    if me == 0:
        store.wait([f"idle/{key}"])
        os.kill(int(store.get(f"pid/{victim}")), signal.SIGSTOP)
        store.set(f"stopped/{key}", "1")
    store.wait([f"stopped/{key}"])


def _wait_on_stopped() -> tuple[dist.Work, bool]:
    """An all-reduce that waits on the stopped rank; whether it did wait."""
    work = dist.all_reduce(torch.ones(1), async_op=True)
    assert work is not None
    time.sleep(0.3)
    return work, not work.is_completed()


def _form(store: dist.Store, generation: int, rank: int, size: int) -> float:
    """A new default group of the generation over its own key prefix; its all-reduce's sum."""
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"gen{generation}/", store),
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=GROUP_TIMEOUT_S),
    )
    total = torch.ones(1) * (rank + 1)
    dist.all_reduce(total)  # every connection of the group made, and the group works
    return total.item()


def _reaped() -> dict:
    from dataclasses import asdict

    from tandem import _groups_reaper

    counts = _groups_reaper.reaped()
    return {**asdict(counts), "pending": counts.pending}


def _cycles() -> dict:
    """Rank r of 3 in the harness: :data:`CYCLES` re-forms with rank 2 stopped in each."""
    from tandem import _groups_reaper
    from tandem.recovery.recoverer import _abandon_group

    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()  # outlives the harness's group
    store.set(f"pid/{rank}", str(os.getpid()))
    dist.barrier()
    base = _counts()
    out: dict = {"base": base, "sums": [], "cycles": []}
    for g in range(CYCLES):
        if rank == 2:
            _stop_rank(store, 2, str(g))
            _abandon_group()  # its peers closed their ends while it was stopped
        else:
            _stop_rank(store, 2, str(g))
            work, blocked = _wait_on_stopped()
            # Both survivors look before either cuts: a cut closes this rank's connections to
            # the other survivor too, which would fail the other's all-reduce early.
            store.set(f"looked/{g}/{rank}", "1")
            store.wait([f"looked/{g}/{1 - rank}"])
            started = time.monotonic()
            _abandon_group()
            took_down_s = time.monotonic() - started
            early = None
            try:  # bounded: a wait that outlives BOUND_S fails the test, not the harness
                work.wait(timeout=timedelta(seconds=BOUND_S))
                failed = False
            except RuntimeError as error:
                failed = True
                early = None if blocked else str(error)[:300]  # why it did not wait
            waited_s = time.monotonic() - started
            del work  # it holds the old group's Gloo context (and its device's loop thread)
            freed = _groups_reaper.wait_reaped(BOUND_S)
            out["cycles"].append(
                {
                    "blocked": blocked,
                    "early": early,
                    "failed": failed,
                    "waited_s": waited_s,
                    "took_down_s": took_down_s,
                    "freed": freed,
                    "freed_s": time.monotonic() - started,
                    "reaped": _reaped(),
                }
            )
            store.set(f"freed/{g}/{rank}", "1")
            if rank == 0:
                store.wait([f"freed/{g}/1"])
                store.set(f"resume/{g}", "1")
                os.kill(int(store.get("pid/2")), signal.SIGCONT)
        out["sums"].append(_form(store, g, rank, 3))
    _groups_reaper.wait_reaped(BOUND_S)
    out["end"] = _settled(base, BOUND_S)
    out["reaped"] = _reaped()
    return out


def test_old_groups_are_freed_with_a_peer_stopped() -> None:
    results = run_ranks(_cycles, world_size=3, timeout=60)
    for rank, r in enumerate(results):
        assert r["sums"] == [6.0] * CYCLES, (rank, r)
        counts = {k: r["reaped"][k] for k in ("handed", "freed", "held", "kept")}
        assert counts == {"handed": CYCLES, "freed": CYCLES, "held": 0, "kept": 0}, (rank, r)
        # As many threads and sockets as with the first group: nothing of the old ones is left.
        assert r["end"] == r["base"], (rank, r)
        if rank == 2:
            continue
        assert len(r["cycles"]) == CYCLES, (rank, r)
        for c in r["cycles"]:
            assert c["blocked"], (
                f"rank {rank}: the all-reduce did not wait on the stopped peer",
                c,
            )
            # The wait ends with the cut, long before the group's timeout.
            assert c["failed"] and c["waited_s"] < BOUND_S, (rank, c)
            assert c["took_down_s"] < 1.0, (rank, c)  # the caller does not wait for the free
            assert c["freed"] and c["freed_s"] < BOUND_S, (rank, c)
        assert r["reaped"]["cut"] >= CYCLES, (rank, r)  # a socket or more each time


def _exiting(rank: int, port: int) -> None:
    """Rank r of 2, a fresh interpreter (``python -c``): rank 0 re-forms with rank 1 stopped
    and exits at once; prints its results as one JSON line."""
    import faulthandler

    from tandem.recovery.recoverer import _abandon_group

    faulthandler.dump_traceback_later(HANG_S, exit=True)
    # Registered before the reaper's own exit hook, so run after it (last in, first out): what
    # the reaper has left when the interpreter goes on to finalize.
    atexit.register(lambda: print(json.dumps({"pending": _reaped()["pending"]}), flush=True))
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    store.set(f"pid/{rank}", str(os.getpid()))
    _form(store, 0, rank, 2)
    _stop_rank(store, 1, "exit")
    if rank == 1:
        time.sleep(HANG_S)  # never here: it is stopped, then killed by the test
        return
    _held, blocked = _wait_on_stopped()  # held through the exit: the teardown drops it
    _abandon_group()
    print(json.dumps({"blocked": blocked, "reaped": _reaped(), "at": time.time()}), flush=True)


def test_exit_right_after_a_reform_is_prompt() -> None:
    port = free_port()
    env = {**clean_env(), "PYTHONPATH": python_path()}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"from tests.recovery.test_group_freed import _exiting; _exiting({rank}, {port})",
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        out, err = procs[0].communicate(timeout=HANG_S + 30)
        ended = time.time()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()  # rank 1, stopped
                proc.communicate()
    assert procs[0].returncode == 0, f"rc {procs[0].returncode}\n{out}\n{err}"
    assert "terminate called" not in err, err
    result, at_exit = (json.loads(line) for line in out.strip().splitlines()[-2:])
    assert result["blocked"] and result["reaped"]["handed"] == 1, result
    assert at_exit["pending"] == 0, at_exit  # the old group was freed before finalizing
    assert ended - result["at"] < EXIT_S, (ended - result["at"], err)
