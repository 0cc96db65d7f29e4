"""`tandem.spawn` runs fn(rank, *args) in real processes with torchrun's environment set.

- Every rank joins one process group through `tandem.init()` with no arguments, and the return
  values come back in rank order.
- A rank that raises stops the others (which are blocked in a collective, waiting for it)
  within seconds, and its traceback is raised in the caller; a rank that dies without a
  traceback (SIGKILL) is named with the signal.
- A function defined at the top of a `python -` script (a `__main__` with no file, as in a
  notebook) runs in 2 processes that all_reduce, within seconds: shipped by value with
  cloudpickle, or forked when cloudpickle is missing; and where neither is possible (a
  non-daemon thread running) spawn raises at once saying what to do. No process is left behind
  in any case (checked by a marker in the environment of every process).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import tandem
from tandem.launch.spawn import SpawnError


def _sum_of_ranks(rank: int, scale: float) -> tuple[int, float]:
    import torch
    import torch.distributed as dist

    w = tandem.init()
    assert w.rank == rank and w.world_size == 3
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    tandem.shutdown()
    return rank, t.item() * scale


@pytest.mark.launch
def test_spawn_returns_results_in_rank_order():
    assert tandem.spawn(_sum_of_ranks, nprocs=3, args=(2.0,)) == [(0, 6.0), (1, 6.0), (2, 6.0)]


def _one_rank_raises(rank: int) -> None:
    import torch
    import torch.distributed as dist

    tandem.init()
    if rank == 1:
        raise KeyError("rank one is broken")
    dist.all_reduce(torch.ones(1))  # blocks forever: rank 1 never joins


@pytest.mark.launch
def test_failure_stops_the_others_and_raises_the_traceback():
    start = time.monotonic()
    with pytest.raises(SpawnError) as info:
        tandem.spawn(_one_rank_raises, nprocs=3, start_method="forkserver")
    assert time.monotonic() - start < 20
    assert info.value.rank == 1
    assert "KeyError: 'rank one is broken'" in str(info.value)
    assert "_one_rank_raises" in info.value.child_traceback


def _one_rank_dies(rank: int) -> None:
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


@pytest.mark.launch
def test_a_rank_killed_by_a_signal_is_named():
    start = time.monotonic()
    with pytest.raises(SpawnError, match="rank 0 died without a traceback: killed by SIGKILL"):
        tandem.spawn(_one_rank_dies, nprocs=2, start_method="forkserver")
    assert time.monotonic() - start < 15


def test_bad_nprocs():
    with pytest.raises(ValueError, match="nprocs=0"):
        tandem.spawn(_one_rank_dies, nprocs=0)


# --- functions defined interactively -----------------------------------------------------------

INTERACTIVE = """
import sys, threading, time
if "no-cloudpickle" in sys.argv:
    sys.modules["cloudpickle"] = None  # import cloudpickle now raises ImportError
if "thread" in sys.argv:
    threading.Thread(target=time.sleep, args=(30,), name="busy").start()
import torch, torch.distributed as dist
import tandem

def work(rank, scale):
    tandem.init()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    tandem.shutdown()
    return t.item() * scale

try:
    print("RESULT", tandem.spawn(work, nprocs=2, args=(2.0,)), flush=True)
except ValueError as exc:
    print("ERROR", exc, flush=True)
    import os
    os._exit(3)  # without waiting for the thread
"""


def _processes_with(marker: str) -> list[int]:
    """Live processes whose environment holds ``marker`` (the script and all its children)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:  # gone, or not ours to read
                continue
    return found


def _run_interactive(*flags: str) -> subprocess.CompletedProcess:
    marker = f"TANDEM_SPAWN_TEST={uuid.uuid4().hex}"
    name, value = marker.split("=")
    env = {**os.environ, name: value, "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-", *flags],
        input=INTERACTIVE,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    elapsed = time.monotonic() - start
    time.sleep(0.2)
    assert _processes_with(marker) == [], "processes left behind"
    print(f"python - {' '.join(flags)}: {elapsed:.1f} s, rc {done.returncode}")
    return done


@pytest.mark.launch
@pytest.mark.parametrize("flags", [(), ("no-cloudpickle",)], ids=["cloudpickle", "fork"])
def test_function_defined_in_python_stdin_runs(flags):
    if not flags:
        pytest.importorskip("cloudpickle")
    done = _run_interactive(*flags)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RESULT [6.0, 6.0]" in done.stdout


@pytest.mark.launch
def test_unshippable_unforkable_function_fails_at_once_saying_what_to_do():
    done = _run_interactive("no-cloudpickle", "thread")
    assert done.returncode == 3, done.stdout + done.stderr
    assert "work (or an argument) is defined in an interactive __main__" in done.stdout
    assert "non-daemon threads ['busy']" in done.stdout
    assert "pip install cloudpickle" in done.stdout
