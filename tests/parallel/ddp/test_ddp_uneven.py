"""Without join, a rank that runs out of data stops the job in seconds, named, never a hang.

Real scripts (tests/parallel/ddp/uneven_worker.py) in two processes with a hand-made torchrun
environment: rank 1 trains 2 steps, rank 0 five, so rank 0 waits in step 3 for a rank that will
never come. Proven:

- rank 1 then waits in ``dist.barrier()``: both processes exit non-zero within 10 s of rank 1
  leaving its loop; rank 0's error is a RanksOutOfStepError that names rank 1, the 2 steps it
  started, ``torch.distributed.barrier`` and the script line, its own step 3, and the fixes
  (same number of batches, ``tandem.join``); rank 1 gets the same error;
- rank 1's script simply ends: rank 0 fails within 10 s naming rank 1 as exited after 2 steps;
- a rank that is slow (6 s asleep inside a step, not in another collective) is not an error:
  the job finishes with every rank at the same parameters.
Without the check, rank 0 would wait out Gloo's 30-minute timeout (the test's own 60 s timeout
would fail it).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import free_port
from tests.launching import clean_env

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[3]


def _launch(mode: str) -> list[dict]:
    port = free_port()
    procs = []
    for rank in range(2):
        env = clean_env()
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
            PYTHONPATH=str(ROOT),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.parallel.ddp.uneven_worker", mode],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    deadline = time.monotonic() + 60
    ended: dict[int, float] = {}
    while len(ended) < 2 and time.monotonic() < deadline:
        for rank, p in enumerate(procs):
            if rank not in ended and p.poll() is not None:
                ended[rank] = time.time()
        time.sleep(0.05)
    results = []
    for rank, p in enumerate(procs):
        if p.poll() is None:
            p.kill()
        out, err = p.communicate(timeout=10)
        results.append({"code": p.returncode, "out": out, "err": err, "ended": ended.get(rank)})
    return results


def _left_loop_at(results: list[dict]) -> float:
    match = re.search(r"rank 1 done training at ([0-9.]+)", results[1]["out"])
    assert match, results[1]
    return float(match.group(1))


def test_rank_in_a_barrier_after_running_out_is_named_on_every_rank():
    results = _launch("barrier")
    left = _left_loop_at(results)
    for rank, r in enumerate(results):
        assert r["code"] != 0, (rank, r)
        assert r["ended"] is not None and r["ended"] - left < 10, (rank, r["ended"] - left, r)
        assert "RanksOutOfStepError" in r["err"], (rank, r["err"][-3000:])
    err = results[0]["err"]
    assert "rank 1 started 2 training steps and is now in torch.distributed.barrier" in err, err
    assert "uneven_worker.py:" in err and "while rank 0 waits in step 3" in err, err
    assert "tandem.join" in err and "same number of batches" in err, err


def test_rank_whose_script_ended_is_named():
    results = _launch("exit")
    left = _left_loop_at(results)
    assert results[1]["code"] == 0, results[1]
    r = results[0]
    assert r["code"] != 0 and r["ended"] - left < 10, r
    assert "rank 1 exited after starting 2 training steps" in r["err"], r["err"][-3000:]


@pytest.mark.timeout(120)
def test_slow_rank_is_not_an_error():
    results = _launch("slow")
    sums = []
    for rank, r in enumerate(results):
        assert r["code"] == 0, (rank, r["err"][-3000:])
        sums.append(re.search(r"checksum (\S+)", r["out"]).group(1))
    assert sums[0] == sums[1]
