"""A real Trainer whose set-up cannot be recovered in memory, under ``tandem run --recover
in-memory --max-restarts 1``: the job falls back to ``restart`` and ends as if nothing failed.

Proves (real processes over Gloo, the script in ``fallback_worker.py``: a Trainer with
tandem.ShardedOptimizer, 2 ranks, a checkpoint every 2 steps, ``resume="latest"``): rank 1
SIGKILLed in optimizer step 5 makes the launcher say at once that rank 0 cannot be recovered in
memory (its state is sharded) and restart every worker; they resume from the checkpoint of
step 4 (rank 0 says so), the job exits 0, its summary lists the fall-back, and the final
checkpoint equals bitwise (parameters, the momentum buffers of the gathered optimizer state,
the run's place) that of the same script run without the kill.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.launching import final_checkpoint, run_job

pytestmark = [pytest.mark.launch]

WORKER = "tests.launch.fallback_worker"


def launch(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    flags = ["--recover", "in-memory", "--max-restarts", "1"]
    return run_job(2, flags, WORKER, str(run_dir), *args)


final = final_checkpoint


def assert_bitwise(got: Any, expected: Any, where: str = "") -> None:
    """Every tensor ``torch.equal`` (dtype and shape included), everything else ``==``."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == expected.dtype, where
        assert torch.equal(got, expected), where
    elif isinstance(expected, dict):
        assert isinstance(got, dict) and sorted(got, key=str) == sorted(expected, key=str), where
        for key, value in expected.items():
            assert_bitwise(got[key], value, f"{where}/{key}")
    elif isinstance(expected, list | tuple):
        assert isinstance(got, list | tuple) and len(got) == len(expected), where
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            assert_bitwise(a, b, f"{where}[{i}]")
    else:
        assert got == expected, where


@pytest.mark.timeout(400)
def test_a_sharded_trainer_falls_back_to_restart_and_ends_as_without_the_kill(tmp_path):
    oracle = tmp_path / "oracle"
    quiet = launch(oracle)
    assert "falls back" not in quiet.stderr
    killed = tmp_path / "killed"
    result = launch(killed, "--kill", "1:5")
    # The Trainer's reason names the sharding (tandem.train.in_memory.why_not).
    said = re.search(
        r"^tandem run: rank 1 \(killed by SIGKILL\) was lost and rank 0 cannot be recovered in "
        r"memory \((?P<reason>.*sharded across ranks.*)\): restarting every worker from the last "
        r"checkpoint \(restart 1 of 1; --recover in-memory falls back to restart\)$",
        result.stderr,
        re.M,
    )
    assert said, result.stderr[-4000:]
    assert re.search(
        r"^tandem run: recovery 1: rank 1 \(killed by SIGKILL\) lost [\d.]+ s into the run; not "
        rf"recoverable in memory \(rank 0: {re.escape(said['reason'])}\): every worker restarted "
        r"\(restart 1 of 1\) from the last checkpoint$",
        result.stderr,
        re.M,
    ), result.stderr[-4000:]
    assert "go on without it" not in result.stderr  # nobody went on in memory
    # The restarted workers resumed from the checkpoint before the kill (a run from scratch
    # would end the same: the equality below alone would not show the resume).
    assert re.search(
        r"^\[rank 0\] resumed from .*ckpt-e0000-s00000004\.pt: epoch 1, batch 4, step 4$",
        result.stdout + result.stderr,
        re.M,
    ), result.stdout[-2000:] + result.stderr[-2000:]

    got, expected = final(killed), final(oracle)
    assert expected["trainer"]["step"] == 12  # 2 epochs of 6 steps: the run went to its end
    assert_bitwise(got["model"], expected["model"], "model")
    assert_bitwise(got["optimizer"], expected["optimizer"], "optimizer")
    momentum = [s["momentum_buffer"] for s in expected["optimizer"]["state"].values()]
    assert len(momentum) == 4  # the whole optimizer state, gathered from both shards
    for key in ("world_size", "epoch", "step", "batch", "sampler"):
        assert got["trainer"][key] == expected["trainer"][key], key
    for rank, (a, b) in enumerate(
        zip(got["trainer"]["ranks"], expected["trainer"]["ranks"], strict=True)
    ):
        assert torch.equal(a["rng"]["torch"], b["rng"]["torch"]), f"rank {rank}'s generator"
