"""Growing back with the Trainer: under ``tandem run --recover in-memory --max-restarts 1`` an
unchanged Trainer script admits the launcher's replacement for a lost rank at a step boundary,
hands it the run over the new group, and the run ends where the chain of resumes with the same
membership schedule ends, bitwise.

Proves (real processes over Gloo, the script in ``trainer_worker.py``: dropout drawn by every
rank, SGD with momentum, an evaluation set, a step log, checkpoints every 3 steps): 3 ranks;
rank 1 is SIGKILLed in step 4's forward; the 2 survivors go back to step 3 and go on; the
launcher starts rank 3 in its place, which the survivors admit after some step J (whichever
boundary follows its arrival: read from the exit summary), handing it the parameters, the
momentum, the run's place, scheduler and step log, and their own parts (generators, loss sums).
Then:

- the final checkpoint (parameters, momentum, epoch, step, the sampler's place, every rank's
  generators and loss sums, the history's train and test losses) and every record of the step
  log (timing columns aside) equal those of "3 ranks to step 3, saved; 2 ranks resumed to step
  J, saved; 3 ranks resumed to the end";
- the same chain whose last link seeds its third rank otherwise (where a resume at a larger size
  seeds a rank the checkpoint had not: the place the replacement takes) ends elsewhere, so the
  newcomer's seeding is what the equality checks, not a no-op;
- the exit summary names the loss and the admission, the job exits 0, and none of the 4 workers
  (the replacement included) is left behind.

The step 3 of the loss is neither a log nor an evaluation step: there the oracle reduces 3 ranks'
sums and the recovered run 2 ranks' (rank 0 holding the 3 added up), whose rounding may differ.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tandem.train.loggers import JSONL_FILE, read_jsonl
from tandem.train.step_log import TIMING_COLUMNS
from tests.recovery.chains import TRAINER_WORKER, Chain, Segment
from tests.recovery.test_recovery import leftovers
from tests.recovery.test_trainer_recovery import assert_same_run, final, launch

pytestmark = [pytest.mark.launch, pytest.mark.xdist_group("recovery")]

# 4 epochs: 44 steps at 2 ranks at most, 0.5 s each, for the replacement to start and join
# (it takes a few seconds: the steps at 3 ranks do not sleep).
EPOCHS = ("--epochs", "4")


def step_log(run_dir: Path) -> list[dict]:
    return [
        {k: v for k, v in record.items() if k not in TIMING_COLUMNS}
        for record in read_jsonl(run_dir / JSONL_FILE)
    ]


@pytest.mark.timeout(900)
def test_a_trainer_admits_a_replacement_and_equals_the_chain_of_resumes(tmp_path, chains):
    grown, pids = tmp_path / "grown", tmp_path / "pids"
    pids.mkdir()
    result = launch(
        3, grown, *EPOCHS, "--kill", "1:3:forward", "--step-sleep", "0.5", "--pids", str(pids),
        recover=True, replacements=1,
    )  # fmt: skip
    err = result.stderr
    assert re.search(r"^tandem run: rank 1 \(.*\) was lost", err, re.M), err[-3000:]
    assert "starting rank 3 to replace rank 1 (replacement 1 of 1)" in err, err[-3000:]
    assert re.search(r"recovery 1: rank 1 \(killed by SIGKILL\) lost at step 3;", err), err[-3000:]
    admitted = re.search(
        r"recovery 2: replacement rank 3 admitted after step (\d+); ranks 0,2,3 go on", err
    )
    assert admitted, err[-3000:]
    at = int(admitted.group(1))
    got = final(grown)
    assert got["trainer"]["world_size"] == 3 and 3 < at < got["trainer"]["step"], at

    # The oracle chain with the same membership schedule: each link resumes a copy of the last;
    # the mutant's last link seeds the newcomer's place otherwise (one launch for both).
    links = (Segment(3, 3), Segment(2, at))
    oracle = Chain(TRAINER_WORKER, (*links, Segment(3)), EPOCHS)
    mutated = Chain(TRAINER_WORKER, (*links, Segment(3, None, ("--newcomer-seed-mutant",))), EPOCHS)
    expected, mutant = chains.get(oracle, mutated)
    assert_same_run(got, final(expected))
    assert step_log(grown) == step_log(expected)
    mutant_end = final(mutant)
    assert any(not torch.equal(mutant_end["model"][k], v) for k, v in got["model"].items())

    started = {int(p.read_text()) for p in pids.iterdir()}
    assert sorted(p.name for p in pids.iterdir()) == ["0", "1", "2", "3"]
    assert not leftovers(started), leftovers(started)


@pytest.mark.timeout(900)
def test_a_member_lost_in_the_hand_over_re_forms_and_hands_the_run_to_the_replacement(
    tmp_path, chains
):
    """Rank 1 is lost at step 3 and replaced by rank 3; as the members (ranks 0 and 2) hand it
    the run after step J, rank 2 is SIGKILLed entering the hand-over. The newcomer's take-over
    fails with the members' hand-over: it joins their re-form as a member that holds nothing,
    and ranks 0 and 3 re-form, rank 0 handing rank 3 the run of step J's commit (rank 2's own
    part with it: rank 3 takes its place) and both doing step J's boundary again. Rank 2's
    replacement, rank 4, is admitted after step K. The run ends where "3 ranks to step 3, 2 to
    J, 2 to K, 3 to the end" ends, bitwise; the job exits 0 with none of its 5 workers left."""
    grown, pids = tmp_path / "grown", tmp_path / "pids"
    pids.mkdir()
    result = launch(
        3, grown, *EPOCHS, "--kill", "1:3:forward", "--kill", "2:*:handover",
        "--step-sleep", "0.5", "--pids", str(pids), recover=True, replacements=2,
    )  # fmt: skip
    err = result.stderr
    assert re.search(r"recovery 1: rank 1 \(killed by SIGKILL\) lost at step 3;", err), err[-3000:]
    assert "starting rank 3 to replace rank 1 (replacement 1 of 2)" in err, err[-3000:]
    assert "starting rank 4 to replace rank 2 (replacement 2 of 2)" in err, err[-3000:]
    # The admission's generation never committed; the re-form after it hands rank 3 the run.
    told = re.search(
        r"recovery 2: replacement rank 3 admitted after step (\d+); ranks 0,2,3 go on; cut short "
        r"by the loss of rank 2 before the run was handed over\n.*"
        r"recovery 3: rank 2 \(killed by SIGKILL\) lost at step (\d+); detected in [\d.]+ s; "
        r"step \d+ redone by ranks 0,3 in [\d.]+ s \(replacement rank 3 handed the run in it\)\n.*"
        r"recovery 4: replacement rank 4 admitted after step (\d+); ranks 0,3,4 go on",
        err,
    )
    assert told, err[-3000:]
    at, then = int(told.group(2)), int(told.group(3))
    assert int(told.group(1)) == at, told.group(0)
    got = final(grown)
    assert got["trainer"]["world_size"] == 3 and 3 < at < then < got["trainer"]["step"], (at, then)

    oracle = Chain(
        TRAINER_WORKER, (Segment(3, 3), Segment(2, at), Segment(2, then), Segment(3)), EPOCHS
    )
    (expected,) = chains.get(oracle)
    assert_same_run(got, final(expected))
    assert step_log(grown) == step_log(expected)

    started = {int(p.read_text()) for p in pids.iterdir()}
    assert sorted(p.name for p in pids.iterdir()) == ["0", "1", "2", "3", "4"]
    assert not leftovers(started), leftovers(started)
