"""Ranks that issue different collectives are told so, on every rank, naming both sides.

Without tandem, Gloo aborts the process on a shape or dtype mismatch ("Received data size
doesn't match") and hangs until the collective's timeout on an op mismatch. Proven here, with
two real processes and a 60 s collective timeout:

- by default (no strict mode), a mismatched op, shape or dtype makes every rank raise
  CollectiveMismatchError within seconds, with each rank's op, tensors and line: the op at the
  cheap check (a collective blocked for ``min(5 s, hang_report_after)`` is compared across
  ranks; tested at 2 s and at the default 5 s), a size mismatch as soon as Gloo would abort;
  the next collective then raises at its entry;
- the same inside tandem.DDP, where the rank waits for its gradient all-reduce;
- with ``TANDEM_DEBUG=collectives`` (strict mode) the ranks compare each collective before
  issuing it, and raise the same error;
- a collective that no peer ever joins (no mismatch) still ends with its own timeout.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tandem
from tandem.doctor.records import CollectiveMismatchError
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed

CASES = [
    ("shape", "all_reduce of float32 (3,)", "all_reduce of float32 (5,)"),
    ("dtype", "all_reduce of float32 (4,)", "all_reduce of float64 (4,)"),
    ("op", "all_reduce of float32 (4,)", "broadcast of float32 (4,)"),
]


def _issue(kind: str, rank: int) -> None:
    if kind == "shape":
        dist.all_reduce(torch.ones(3 if rank == 0 else 5))
    elif kind == "dtype":
        dist.all_reduce(torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float64))
    elif rank == 0:
        dist.all_reduce(torch.ones(4))
    else:
        dist.broadcast(torch.ones(4), src=1)


def _mismatch(kind: str) -> str:
    tandem.init()
    dist.all_reduce(torch.ones(2))  # a matching one first: #1 passes
    with pytest.raises(CollectiveMismatchError) as info:
        _issue(kind, dist.get_rank())
    return str(info.value)


def _check_message(message: str, zero: str, one: str) -> None:
    assert "collective #2 of world differs across ranks" in message, message
    assert f"rank 0: {zero} at test_desync.py:" in message, message
    assert f"rank 1: {one} at test_desync.py:" in message, message


@pytest.mark.parametrize(("kind", "zero", "one"), CASES)
def test_mismatched_collectives_raise_on_every_rank_in_strict_mode(kind, zero, one):
    env = {"TANDEM_DEBUG": "collectives"}
    for message in run_ranks(_mismatch, 2, args=(kind,), env=env, timeout=60):
        _check_message(message, zero, one)


def _mismatch_by_default(kind: str) -> dict:
    tandem.init(timeout=60)  # a hang would last this long: longer than the test allows
    rank = dist.get_rank()
    dist.all_reduce(torch.ones(2))
    start = time.monotonic()
    with pytest.raises(CollectiveMismatchError) as info:
        _issue(kind, rank)
    after = time.monotonic() - start
    with pytest.raises(CollectiveMismatchError):  # the group is done with: raised at the entry
        dist.barrier()
    return {"message": str(info.value), "after": after}


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("kind", "zero", "one"), CASES)
def test_mismatched_collectives_raise_on_every_rank_by_default(kind, zero, one, tmp_path):
    env = {"TANDEM_HANG_REPORT_AFTER": "2", "TANDEM_REPORT_DIR": str(tmp_path)}
    # init=None: the harness must not end with a barrier on the broken group.
    results = run_ranks(_mismatch_by_default, 2, args=(kind,), init=None, env=env, timeout=50)
    for result in results:
        _check_message(result["message"], zero, one)
        assert result["after"] < 8, result  # the check at 2 s, or Gloo's abort held at once


@pytest.mark.timeout(90)
def test_mismatched_op_raises_within_seconds_with_the_default_thresholds(tmp_path):
    env = {"TANDEM_REPORT_DIR": str(tmp_path)}  # the 5 s check; the 60 s report is not reached
    results = run_ranks(_mismatch_by_default, 2, args=("op",), init=None, env=env, timeout=50)
    for result in results:
        _check_message(result["message"], *CASES[2][1:])
        assert 4 < result["after"] < 12, result


def _mismatch_in_ddp() -> dict:
    tandem.init(timeout=60)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = tandem.DDP(nn.Linear(4, 2))
    x, y = torch.randn(3, 4), torch.randint(0, 2, (3,))
    F.cross_entropy(model(x), y).backward()  # one step in step
    loss = F.cross_entropy(model(x), y)
    start = time.monotonic()
    with pytest.raises(CollectiveMismatchError) as info:
        if rank == 0:
            loss.backward()  # waits for its gradient all-reduce
        else:
            dist.broadcast(torch.ones(4), src=1)  # where rank 0 all-reduces gradients
    return {"message": str(info.value), "after": time.monotonic() - start}


@pytest.mark.timeout(90)
def test_mismatch_raises_while_ddp_waits_for_its_gradients(tmp_path):
    env = {"TANDEM_HANG_REPORT_AFTER": "2", "TANDEM_REPORT_DIR": str(tmp_path)}
    results = run_ranks(_mismatch_in_ddp, 2, init=None, env=env, timeout=50)
    for result in results:
        message = result["message"]
        assert "rank 0: all_reduce of float32 (10,) at test_desync.py:" in message, message
        assert "rank 1: broadcast of float32 (4,) at test_desync.py:" in message, message
        assert result["after"] < 8, result


def _unanswered(timeout_s: float) -> dict:
    tandem.init(timeout=timeout_s, hang_report_after=60)
    start = time.monotonic()
    if dist.get_rank() == 1:
        time.sleep(timeout_s + 3)  # never joins in time: not a mismatch, a hang
    try:
        dist.all_reduce(torch.ones(2))
    except RuntimeError as e:
        return {"error": type(e).__name__, "text": str(e)[:300], "after": time.monotonic() - start}
    return {"error": None, "after": time.monotonic() - start}


@pytest.mark.timeout(60)
def test_a_collective_no_peer_joins_still_ends_with_its_own_timeout():
    first, _ = run_ranks(_unanswered, 2, args=(4.0,), init=None, timeout=40)
    assert first["error"] is not None and first["error"] != "CollectiveMismatchError", first
    assert "timed out" in first["text"].lower(), first
    assert 3 < first["after"] < 9, first
