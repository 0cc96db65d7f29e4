"""Growing back: with ``--max-restarts``, ``tandem run --recover in-memory`` starts a replacement
for a lost rank, and the survivors admit it at a step boundary and hand it the run's state.

Proves (real processes over Gloo, ``tandem.recovery.Run``): 3 ranks; rank 1 is SIGKILLed in its
forward at step 2; the 2 survivors redo the step; the launcher starts rank 3 in its place,
which asks to join through the store; the survivors admit it after some step J (whichever step
boundary follows its arrival: read from the run's record), hand it the parameters (the wrapper's
broadcast), the optimizer's state and the sampler's place from rank 0, and it starts its
generators as a resume at 3 ranks seeds a rank the saved run had not. The run ends bitwise where
the oracle chain with that membership schedule ends (3 ranks to step 2, saved; 2 ranks resumed
to step J, saved; 3 ranks resumed to the end), the exit summary names the loss and the
admission, and no process is left behind.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.launching import run_job
from tests.recovery.chains import resumes
from tests.recovery.test_recovery import assert_equal_runs, leftovers

pytestmark = [pytest.mark.launch, pytest.mark.xdist_group("recovery")]

WORKER = "tests.recovery.recovery_worker"
EPOCHS = ("--epochs", "8")


def run_worker(nproc: int, out: Path, *args: str, flags: tuple[str, ...] = ()):
    return run_job(nproc, list(flags), WORKER, str(out), *args, timeout=300)


@pytest.mark.timeout(600)
def test_a_replacement_joins_at_a_step_boundary_and_the_run_equals_its_schedule(tmp_path, chains):
    out = tmp_path / "grown.pt"
    flags = ("--recover", "in-memory", "--heartbeat-timeout", "2", "--max-restarts", "1")
    result = run_worker(
        3, out, *EPOCHS, "--kill", "1:2:forward", "--step-sleep", "0.15", flags=flags
    )
    err = result.stderr
    assert re.search(r"^tandem run: rank 1 \(.*\) was lost", err, re.M), err[-3000:]
    assert "starting rank 3 to replace rank 1 (replacement 1 of 1)" in err, err[-3000:]
    grown = torch.load(out, weights_only=True)
    lost, joined = grown["recoveries"]
    assert (lost["lost"], lost["step"], lost["members"]) == ([1], 2, [0, 2])
    assert joined["lost"] == [] and joined["joined"] == [3] and joined["members"] == [0, 2, 3]
    at = joined["step"]
    assert 2 < at < grown["steps"], f"admitted after step {at} of {grown['steps']}"
    assert grown["world_size"] == 3
    assert re.search(rf"replacement rank 3 admitted after step {at}; ranks 0,2,3 go on", err)

    # The oracle chain with the same membership schedule: 3 ranks to step 2, saved; 2 ranks
    # resumed to the admission's step, saved; 3 ranks resumed to the end (one launch).
    (last,) = chains.get(resumes(3, [(2, 2), (at, 3)], EPOCHS))
    assert_equal_runs(grown, torch.load(last, weights_only=True))

    pids = {int(p.read_text()) for p in tmp_path.glob("grown.pt.pid-*")}
    assert len(pids) == 4 and not leftovers(pids), leftovers(pids)


@pytest.mark.timeout(600)
def test_a_replacement_whose_script_makes_a_collective_before_training_is_refused(tmp_path, chains):
    """The replacement's script calls ``dist.barrier()`` before its ``Run`` (the members are past
    that part of the script): it raises ``ReplacementCollectiveError`` naming the line, rather
    than hang or meet the members' own collectives. The members meet its exit in the admission
    (a loss like any: they re-form without it and go on), the launcher starts the second
    replacement, which fails the same way, and with ``--max-restarts 2`` spent the two members
    finish the run: bitwise where "3 ranks to step 2, 2 to the end" ends with a new group at each
    admission's step (a new tandem.DDP there), and the job exits 0 with nothing left."""
    out = tmp_path / "refused.pt"
    flags = ("--recover", "in-memory", "--heartbeat-timeout", "2", "--max-restarts", "2")
    result = run_worker(
        3, out, *EPOCHS, "--kill", "1:2:forward", "--step-sleep", "0.15",
        "--replacement-barrier", flags=flags,
    )  # fmt: skip
    err = result.stderr
    for newcomer, replaced, n in ((3, 1, 1), (4, 3, 2)):
        assert f"starting rank {newcomer} to replace rank {replaced} (replacement {n} of 2)" in err
        refused = re.search(
            rf"ReplacementCollectiveError: rank {newcomer} is a replacement .* "
            r"recovery_worker\.py:\d+ in main leads to torch\.distributed\.barrier",
            err,
        )
        assert refused, err[-4000:]
    run = torch.load(out, weights_only=True)
    records = [(r["lost"], r["joined"], r["members"]) for r in run["recoveries"]]
    assert records == [
        ([1], [], [0, 2]),
        ([], [3], [0, 2, 3]),
        ([3], [], [0, 2]),  # refused: lost in its admission, the members go on
        ([], [4], [0, 2, 4]),
        ([4], [], [0, 2]),
    ], run["recoveries"]
    steps = [r["step"] for r in run["recoveries"]]
    first, second = steps[1], steps[3]
    assert steps == [2, first, first, second, second] and 2 < first < second < run["steps"]
    assert run["world_size"] == 2

    (last,) = chains.get(resumes(3, [(2, 2), (first, 2), (second, 2)], EPOCHS))
    assert_equal_runs(run, torch.load(last, weights_only=True))
    pids = {int(p.read_text()) for p in tmp_path.glob("refused.pt.pid-*")}
    assert len(pids) == 5 and not leftovers(pids), leftovers(pids)


@pytest.mark.timeout(600)
def test_a_member_lost_in_the_formation_that_admits_a_replacement(tmp_path, chains):
    """Rank 1 is lost at step 1 and its replacement 3 queues; every rank waits at step 2 until
    it has seen it (so step 2's vote admits it). As the generation that admits it forms, member
    2 is SIGKILLed right after it said it is here: the others (rank 0, and rank 3 in its
    ``tandem.init()``) wait in the formation, give up at its timeout (5 s), and re-form: rank
    0 with rank 3 joining from its wait as one that holds nothing, handed the run there. Rank
    2's replacement 4 is admitted after step 3 or later. The records tell it; the run ends where
    "3 ranks to step 1, 2 to step 3, 3 from the last admission" ends, and nothing is left."""
    out = tmp_path / "formed.pt"
    flags = ("--recover", "in-memory", "--heartbeat-timeout", "2", "--max-restarts", "2")
    result = run_worker(
        3, out, *EPOCHS, "--kill", "1:1:forward", "--await", "2:1", "--kill", "2:3:form",
        "--step-sleep", "0.15", flags=flags,
    )  # fmt: skip
    err = result.stderr
    killed = json.loads(out.with_name(f"{out.name}.killed-2").read_text())
    assert (killed["where"], killed["step"]) == ("form", 3), killed
    run = torch.load(out, weights_only=True)
    records = [(r["lost"], r["joined"], r["members"], r["step"]) for r in run["recoveries"]]
    at = records[-1][3]
    assert records == [
        ([1], [], [0, 2], 1),
        ([2], [3], [0, 3], 3),  # the admission's generation never formed: one record
        ([], [4], [0, 3, 4], at),
    ], run["recoveries"]
    # Rank 4 queues while the others wait in the formation: the start commit of generation 3
    # (ranks 0 and 3, after step 3) may already admit it.
    assert 3 <= at < run["steps"] and run["world_size"] == 3
    recovery = run["recoveries"][1]
    # From the admission's start: the formation's 5 s, the re-form, the hand-over and the start
    # commit (10.7 s in a full suite's run on 2 cores), far from the collectives' 60 s.
    assert recovery["recovered_s"] < 30, recovery
    assert "recovery 2: rank 2 (killed by SIGKILL) lost at step 3" in err, err[-3000:]

    # A resume at each step where a group formed and trained (a new tandem.DDP there).
    sizes = [(1, 2), (3, 2), (at, 3)] if at > 3 else [(1, 2), (3, 3)]
    (last,) = chains.get(resumes(3, sizes, EPOCHS))
    assert_equal_runs(run, torch.load(last, weights_only=True))
    pids = {int(p.read_text()) for p in tmp_path.glob("formed.pt.pid-*")}
    assert len(pids) == 5 and not leftovers(pids), leftovers(pids)
