"""Recovery in memory: survivors of a SIGKILLed rank re-form and end as a resume would.

Proves, with ``tandem run --recover in-memory`` (real processes over Gloo; the launcher hosts
the store, marks a dead rank there and kills a rank the others left out):

- a rank SIGKILLed during a step (before its backward: the others are inside the gradient
  all-reduce; or after it: the others' all-reduce is done and they wait in the commit) costs
  that step only: the survivors re-form a group one smaller (renumbered where the lost rank
  was not the last) and redo it;
- the run then ends **bitwise** equal to the oracle: the same job trained to that step at the
  full size, saved, and resumed at one rank fewer (parameters, optimizer state, and every
  rank's generators: the model draws dropout masks, each rank its own);
- a hung rank (SIGSTOP) is left out after the heartbeat timeout and killed by the launcher;
- the recovery is recorded (lost rank, members, the step redone, times) and listed in the exit
  summary, within the issue's targets (3 s from the loss, 5 s for a hung rank).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.launching import clean_env

pytestmark = pytest.mark.launch

WORKER = "tests.recovery.recovery_worker"
ROOT = Path(__file__).resolve().parents[2]


def launch(
    nproc: int, args: list[str], recover: bool = False, timeout: float = 150, beat: float = 2
) -> subprocess.CompletedProcess[str]:
    """``tandem run --nproc-per-node N [--recover in-memory] -m the worker ARGS``."""
    flags = ["--recover", "in-memory", "--heartbeat-timeout", f"{beat:g}"] if recover else []
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", "run", "--nproc-per-node", str(nproc), *flags,
         "-m", WORKER, *args],
        env={**clean_env(), "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )  # fmt: skip


def oracle(tmp_path: Path, step: int, nproc: int = 3) -> dict:
    """Train at ``nproc`` ranks to ``step``, save, resume at one rank fewer to the end."""
    half = tmp_path / "half.pt"
    first = launch(nproc, [str(half), "--stop-after", str(step)])
    assert first.returncode == 0, first.stderr
    end = tmp_path / "oracle.pt"
    second = launch(nproc - 1, [str(end), "--resume", str(half)])
    assert second.returncode == 0, second.stderr
    return torch.load(end, weights_only=True)


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("nproc", "victim", "where", "how"),
    [
        (3, 2, "commit", "killed by SIGKILL"),
        (4, 1, "forward", "killed by SIGKILL"),
        (4, 0, "hang", "hung or cut off"),
    ],
)
def test_a_lost_rank_costs_one_step_and_the_run_equals_a_resume(
    tmp_path, nproc, victim, where, how
):
    # forward: SIGKILL before its backward (the others wait in the all-reduce); commit: after
    # it (their all-reduce is done, they wait in the commit); hang: SIGSTOP (alive and silent:
    # after the 2 s heartbeat timeout the others go on, and the launcher kills it). Rank 1 of 4
    # lost renumbers the ranks after it; rank 0 lost takes the store's first client with it.
    step = 3
    out = tmp_path / "recovered.pt"
    result = launch(nproc, [str(out), "--kill", f"{victim}:{step}:{where}"], recover=True)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    summary = [line for line in lines if line.startswith("tandem run: recovery 1:")]
    assert summary and f"rank {victim} ({how}" in summary[0], result.stderr
    if where == "hang":
        assert f"rank {victim} was left out of the job by the others" in result.stderr
    recovered = torch.load(out, weights_only=True)
    (recovery,) = recovered["recoveries"]
    survivors = [r for r in range(nproc) if r != victim]
    assert recovery["lost"] == [victim] and recovery["members"] == survivors, recovery
    assert recovery["step"] == step and recovery["generation"] == 1, recovery
    limit = 5 if where == "hang" else 3  # the targets, detection included
    assert recovery["detected_s"] + recovery["recovered_s"] < limit, recovery
    assert recovered["world_size"] == nproc - 1

    expected = oracle(tmp_path, step, nproc)
    assert recovered["steps"] == expected["steps"]
    assert recovered["run"] == expected["run"]
    for key, value in expected["model"].items():
        assert torch.equal(recovered["model"][key], value), key
    for k, state in expected["optimizer"]["state"].items():
        got = recovered["optimizer"]["state"][k]["momentum_buffer"]
        assert torch.equal(got, state["momentum_buffer"]), k
    # Every rank ends with the generators the resumed run's rank ends with (the dropout masks
    # drawn after the loss are the same): a renumbered survivor took its new place's.
    for mine, theirs in zip(recovered["rng"], expected["rng"], strict=True):
        assert torch.equal(mine["torch"], theirs["torch"])


def test_without_a_failure_the_run_differs_from_the_resumed_one(tmp_path):
    # The oracle means something: at 3 ranks throughout, the run ends elsewhere.
    out = tmp_path / "plain.pt"
    assert launch(3, [str(out)]).returncode == 0
    plain, resumed = torch.load(out, weights_only=True), oracle(tmp_path, 3)
    assert plain["steps"] != resumed["steps"]
    assert any(not torch.equal(plain["model"][k], v) for k, v in resumed["model"].items())
