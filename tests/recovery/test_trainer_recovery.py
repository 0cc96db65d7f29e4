"""A Trainer script, unchanged, under ``tandem run --recover in-memory``: a lost rank costs the
step in flight, and the run ends bitwise where "train to that step, save, resume at the new
size" ends.

Proves (real processes over Gloo, the script in ``trainer_worker.py`` knows nothing of
recovery; 3 ranks, one lost, 2 go on):

- a rank SIGKILLed in its training step (before the backward: the others wait in the
  all-reduce), one SIGKILLed inside the optimizer step (after the step committed: the others
  meet the loss in the step's boundary, at the checkpoint), rank 0 SIGKILLed while it writes a
  checkpoint (the others wait for its verdict; the new rank 0 writes it), and a rank hung
  (SIGSTOP) in its training step (left out after the heartbeat timeout): each run's
  final checkpoint equals the oracle's (3 ranks to step 6, saved; 2 ranks resumed from it):
  parameters, momentum buffers, epoch, step, the sampler's place, every rank's generators and
  loss sums, and the per-epoch train and test losses of the history;
- a vote split between the survivors (one spoils its gradients and raises right after its vote,
  in the gradient all-reduce, completed, while another committed the step) ends there too: the
  one behind takes the state of the one ahead;
- the uninterrupted 3-rank run ends elsewhere (the equality above is not trivially true);
- the exit summary names the recovery, and the job exits 0 with no worker left behind.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.launching import final_checkpoint, run_job
from tests.recovery.chains import TRAINER_WORKER, Chain, Chains, Segment

pytestmark = [pytest.mark.launch, pytest.mark.xdist_group("recovery")]

WORKER = TRAINER_WORKER


def launch(nproc: int, run_dir: Path, *args: str, recover: bool = False, replacements: int = 0):
    """The Trainer script at ``nproc`` ranks; ``recover``: under ``--recover in-memory``, with
    ``--max-restarts replacements``."""
    flags = ["--recover", "in-memory", "--heartbeat-timeout", "2"] if recover else []
    if replacements:
        flags += ["--max-restarts", str(replacements)]
    return run_job(nproc, flags, WORKER, str(run_dir), *args)


final = final_checkpoint


# 3 ranks train to step 6 and save: the oracles' first half.
HALF = Segment(3, 6)


@pytest.fixture(scope="module")
def oracles(chains: Chains) -> dict[int, dict]:
    """By world size: the final checkpoint of :data:`HALF` resumed at 2 ranks (or 1) to the end
    (one launch for both: :mod:`tests.recovery.chains`)."""
    wanted = {n: Chain(TRAINER_WORKER, (HALF, Segment(n))) for n in (2, 1)}
    ends = chains.get(*wanted.values())
    return {n: final(end) for n, end in zip(wanted, ends, strict=True)}


@pytest.fixture(scope="module")
def oracle(oracles: dict[int, dict]) -> dict:
    """3 ranks train to step 6 and save; 2 ranks resume from it to the end."""
    return oracles[2]


def assert_same_run(got: dict, expected: dict) -> None:
    for key, value in expected["model"].items():
        assert torch.equal(got["model"][key], value), key
    for k, state in expected["optimizer"]["state"].items():
        assert torch.equal(
            got["optimizer"]["state"][k]["momentum_buffer"], state["momentum_buffer"]
        ), k
    mine, theirs = got["trainer"], expected["trainer"]
    for key in ("world_size", "epoch", "step", "batch", "sampler"):
        assert mine[key] == theirs[key], key
    assert len(mine["ranks"]) == len(theirs["ranks"])
    for rank, (a, b) in enumerate(zip(mine["ranks"], theirs["ranks"], strict=True)):
        assert torch.equal(a["rng"]["torch"], b["rng"]["torch"]), f"rank {rank}'s generator"
        assert a["epoch_loss"] == b["epoch_loss"], f"rank {rank}'s loss sums"
    losses = [(h["train_loss"], h["eval_loss"]) for h in theirs["history"]]
    assert [(h["train_loss"], h["eval_loss"]) for h in mine["history"]] == losses


CASES = [
    pytest.param("1:6:forward", 1, id="forward"),
    pytest.param("2:5:step", 2, id="optimizer-step"),
    pytest.param("0:6:save", 0, id="rank-0-writing-a-checkpoint"),
    # Hung (SIGSTOP) in its training step: the others count it lost after the 2 s heartbeat
    # timeout, and the launcher kills it.
    pytest.param("1:6:hang", 1, id="hung"),
]


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("kill", "victim"), CASES)
def test_a_trainer_survives_a_lost_rank_and_equals_a_resume(tmp_path, oracle, kill, victim):
    result = launch(3, tmp_path, "--kill", kill, recover=True)
    lost = re.findall(r"^tandem run: rank (\d+) \(.*\) was lost", result.stderr, re.M)
    assert lost == [str(victim)], result.stderr[-3000:]
    summary = [line for line in result.stderr.splitlines() if "tandem run: recovery 1:" in line]
    assert len(summary) == 1 and "step 6 redone" in summary[0], result.stderr[-3000:]
    assert_same_run(final(tmp_path), oracle)


@pytest.mark.timeout(400)
def test_a_survivor_whose_vote_failed_where_another_committed_takes_its_state(tmp_path, oracle):
    """A split vote: step 6's vote completes on every rank, rank 2 dies in its optimizer step,
    and rank 0 spoils its gradients and raises as if its vote (its last bucket's all-reduce)
    had failed. Rank 1 committed step 6: rank 0 takes the state step 6 left from it
    (parameters, momentum, the kept shared state; every member's loss sums were left in the
    store at the vote) and both redo step 7, as if rank 2 had died after a plain commit. Rank
    0, the new rank 0, writes the checkpoints: had it not caught up (or stepped with its own
    gradients), its parameters would be the ones broadcast and saved."""
    result = launch(3, tmp_path, "--kill", "2:5:step", "--split", "0:5", recover=True)
    lost = re.findall(r"^tandem run: rank (\d+) \(.*\) was lost", result.stderr, re.M)
    assert lost == ["2"], result.stderr[-3000:]
    # Rank 0 did raise at the split (without it, the run ends the same as a plain kill's).
    assert json.loads((tmp_path / "split-0.json").read_text()) == {"step": 5}
    summary = [line for line in result.stderr.splitlines() if "tandem run: recovery 1:" in line]
    assert len(summary) == 1 and "step 6 redone" in summary[0], result.stderr[-3000:]
    assert_same_run(final(tmp_path), oracle)


@pytest.mark.timeout(400)
def test_a_second_loss_before_the_redo_commits_goes_back_to_the_same_step(tmp_path, oracles):
    """Rank 1 is lost in step 7's forward; rank 2 is lost in the redo, before it commits: the
    second re-form goes back to step 6's committed state again (that of 3 ranks), and rank 0
    alone ends where 1 rank resumed from step 6 ends."""
    result = launch(
        3, tmp_path / "run", "--kill", "1:6:forward", "--kill", "2:6:redo", recover=True
    )
    lost = re.findall(r"^tandem run: rank (\d+) \(.*\) was lost", result.stderr, re.M)
    assert lost == ["1", "2"], result.stderr[-3000:]
    summary = [line for line in result.stderr.splitlines() if "tandem run: recovery " in line]
    assert len(summary) == 2 and all("step 6 redone" in line for line in summary), summary
    got = final(tmp_path / "run")
    assert got["trainer"]["world_size"] == 1
    assert_same_run(got, oracles[1])


@pytest.mark.timeout(200)
def test_without_a_failure_the_trainer_run_differs_from_the_resumed_one(tmp_path, oracle):
    launch(3, tmp_path, recover=True)
    got = final(tmp_path)
    assert got["trainer"]["world_size"] == 3
    assert any(not torch.equal(got["model"][k], v) for k, v in oracle["model"].items())
