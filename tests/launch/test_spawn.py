"""`tandem.spawn` runs fn(rank, *args) in real processes with torchrun's environment set.

- Every rank joins one process group through `tandem.init()` with no arguments, and the return
  values come back in rank order.
- A rank that raises stops the others (which are blocked in a collective, waiting for it)
  within seconds, and its traceback is raised in the caller; a rank that dies without a
  traceback (SIGKILL) is named with the signal.
"""

from __future__ import annotations

import os
import signal
import time

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


def test_spawn_returns_results_in_rank_order():
    assert tandem.spawn(_sum_of_ranks, nprocs=3, args=(2.0,)) == [(0, 6.0), (1, 6.0), (2, 6.0)]


def _one_rank_raises(rank: int) -> None:
    import torch
    import torch.distributed as dist

    tandem.init()
    if rank == 1:
        raise KeyError("rank one is broken")
    dist.all_reduce(torch.ones(1))  # blocks forever: rank 1 never joins


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


def test_a_rank_killed_by_a_signal_is_named():
    start = time.monotonic()
    with pytest.raises(SpawnError, match="rank 0 died without a traceback: killed by SIGKILL"):
        tandem.spawn(_one_rank_dies, nprocs=2, start_method="forkserver")
    assert time.monotonic() - start < 15


def test_bad_nprocs():
    with pytest.raises(ValueError, match="nprocs=0"):
        tandem.spawn(_one_rank_dies, nprocs=0)
