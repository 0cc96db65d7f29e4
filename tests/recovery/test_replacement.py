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
