"""Ranks that issue different collectives are told so, on every rank, naming both sides.

With ``TANDEM_DEBUG=collectives`` (strict mode) the ranks compare each collective before
issuing it. Without it, Gloo aborts the process on a shape or dtype mismatch ("Received data
size doesn't match") and hangs on an op mismatch; here every rank raises
CollectiveMismatchError within seconds instead, with each rank's op, tensors and line.

Without strict mode, the cheap default check (a collective blocked for 5 s is compared across
ranks) reports a mismatched op within seconds, naming both sides, while the ranks hang until the
collective's timeout.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tandem
from tandem.doctor.records import CollectiveMismatchError
from tests.harness import run_ranks


def _mismatch(kind: str) -> str:
    tandem.init()
    rank = dist.get_rank()
    dist.all_reduce(torch.ones(2))  # a matching one first: #1 passes
    with pytest.raises(CollectiveMismatchError) as info:
        if kind == "shape":
            dist.all_reduce(torch.ones(3 if rank == 0 else 5))
        elif kind == "dtype":
            dist.all_reduce(torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float64))
        elif rank == 0:
            dist.all_reduce(torch.ones(4))
        else:
            dist.broadcast(torch.ones(4), src=1)
    return str(info.value)


@pytest.mark.parametrize(
    ("kind", "zero", "one"),
    [
        ("shape", "all_reduce of float32 (3,)", "all_reduce of float32 (5,)"),
        ("dtype", "all_reduce of float32 (4,)", "all_reduce of float64 (4,)"),
        ("op", "all_reduce of float32 (4,)", "broadcast of float32 (4,)"),
    ],
)
def test_mismatched_collectives_raise_on_every_rank(kind, zero, one):
    env = {"TANDEM_DEBUG": "collectives"}
    for message in run_ranks(_mismatch, 2, args=(kind,), env=env, timeout=60):
        assert "collective #2 of world differs across ranks" in message, message
        assert f"rank 0: {zero} at test_desync.py:" in message, message
        assert f"rank 1: {one} at test_desync.py:" in message, message


def _mismatch_without_strict_mode() -> dict:
    from tandem.doctor import hang

    tandem.init(timeout=12)  # the hang ends with the collective's timeout
    try:
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(4))
        else:
            dist.broadcast(torch.ones(4), src=1)
    except RuntimeError as e:
        outcome = str(e)[:200]
    else:
        outcome = "completed"
    reports = [r["mismatched"] for r in hang.Reporter.reports]
    dist.destroy_process_group()  # the group is broken: the harness must not use it
    return {"reports": reports, "outcome": outcome}


def test_mismatched_ops_are_reported_within_seconds_by_default(tmp_path):
    env = {"TANDEM_REPORT_DIR": str(tmp_path)}  # the 60 s hang threshold is not reached
    results = run_ranks(_mismatch_without_strict_mode, 2, init=None, env=env, timeout=90)
    found = [lines for r in results for lines in r["reports"] if lines]
    assert found, results
    line = found[0][0]
    assert "issued broadcast #" in line and "issued all_reduce #" in line, line
    assert "test_desync.py:" in line, line
