"""A loss during an admission: every survivor and every newcomer still alive ends in one agreed
membership, and the run still ends bitwise where its oracle chain ends.

Proves, with ``tandem run --recover in-memory --max-restarts 3`` (real processes over Gloo,
``tandem.recovery.Run``; the worker waits at a known step until it has seen the replacements
queued, so the step whose vote admits them is known), in one launch of 4 ranks:

- **a split vote that admits**: rank 3 is lost at step 1 and its replacement 4 queues; the
  redo's vote, which admits rank 4, completes on ranks 1 and 2 (rank 2 is SIGKILLed right after
  it completed there) while rank 0 raises as if it had failed (its gradients spoilt, as a broken
  ring leaves them). Rank 1 goes to admit, rank 0 to re-form: one decision on generation 2
  settles both, a re-form without rank 2 (a loss stops an admission), rank 0 rolls forward to
  rank 1's step, and rank 4, still queued, is admitted by the next step's vote with rank 2's
  replacement 5;
- **a newcomer killed during its take-over**: rank 5 is SIGKILLed as it enters the hand-over of
  the run; the members meet the loss there, and rank 4, which has not received the run either,
  joins their re-form as a member holding nothing: generation 4 is ranks 0, 1 and 4, and rank 4
  is handed the run again;
- **a member killed during a newcomer's hand-over**: rank 5's replacement 6 is admitted after
  step 3, and member 1 is SIGKILLed as it enters that hand-over: ranks 0 and 4 and the newcomer 6
  re-form as one generation, rank 6 is handed the run again and takes the place of rank 2 of the
  last commit (its generators, as a resume at 3 ranks maps them);
- each generation's record (members, lost, joined) is the one expected, one membership per
  generation; the run ends bitwise where "4 ranks to step 1, 3 to step 2, 2 to step 3, 3 to
  step 4, 3 to the end" ends (a resume at each step where a group formed: a new tandem.DDP lays
  its first buckets out anew, and at 3 ranks Gloo's ring sums round by that layout);
- every process is accounted for: the launcher exits 0, each of the 4 lost is named once, and
  nothing of the 7 processes is left.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

from tests.launching import run_job
from tests.recovery.test_recovery import assert_equal_runs, leftovers, resumed_chain

pytestmark = [pytest.mark.launch, pytest.mark.xdist_group("recovery")]

WORKER = "tests.recovery.recovery_worker"
EPOCHS = ("--epochs", "2")


def launch(nproc: int, out: Path, restarts: int, *args: str) -> subprocess.CompletedProcess[str]:
    flags = ["--recover", "in-memory", "--heartbeat-timeout", "2", "--max-restarts", str(restarts)]
    return run_job(nproc, flags, WORKER, str(out), *EPOCHS, *args, timeout=240, check=False)


def records(run: dict) -> list[tuple[list[int], list[int], list[int], int]]:
    """Each generation's (lost, joined, members, step), in order."""
    return [(r["lost"], r["joined"], r["members"], r["step"]) for r in run["recoveries"]]


def accounted(result: subprocess.CompletedProcess[str], out: Path, lost: list[int]) -> None:
    """The launcher exited 0, each of ``lost`` was lost once, nothing of a worker is left."""
    assert result.returncode == 0, result.stderr[-4000:]
    named = re.findall(r"^tandem run: rank (\d+) \(.*\) was lost", result.stderr, re.M)
    assert sorted(map(int, named)) == sorted(lost), result.stderr[-4000:]
    pids = {int(p.read_text()) for p in out.parent.glob(f"{out.name}.pid-*")}
    assert not leftovers(pids), leftovers(pids)


def killed(out: Path, rank: int) -> dict:
    return json.loads(out.with_name(f"{out.name}.killed-{rank}").read_text())


@pytest.mark.timeout(600)
def test_losses_during_admissions_end_in_one_membership_equal_to_the_chain(tmp_path):
    out = tmp_path / "run.pt"
    split = ("--kill", "3:1:forward", "--kill", "2:1:voted", "--split", "0:1")
    take_over = (
        "--kill",
        "5:*:handover",
    )
    hand_over = ("--kill", "1:4:handover")
    waits = ("--await", "1:1", "--await", "2:2", "--await", "3:3")
    result = launch(4, out, 3, *split, *take_over, *hand_over, *waits)
    accounted(result, out, [1, 2, 3, 5])
    assert len(list(tmp_path.glob("run.pt.pid-*"))) == 7  # the 4 and 3 replacements
    assert json.loads((tmp_path / "run.pt.split-0").read_text())["step"] == 1
    assert (killed(out, 2)["where"], killed(out, 2)["step"]) == ("voted", 1)
    assert killed(out, 5)["where"] == "handover"
    assert (killed(out, 1)["where"], killed(out, 1)["step"]) == ("handover", 4)
    run = torch.load(out, weights_only=True)
    assert records(run) == [
        ([3], [], [0, 1, 2], 1),
        ([2], [], [0, 1], 2),  # rank 1 had committed step 1 and admitted: a re-form instead
        ([], [4, 5], [0, 1, 4, 5], 3),  # rank 4, still queued, with rank 2's replacement
        ([5], [4], [0, 1, 4], 3),  # 5 lost in its take-over; 4 is handed the run again
        ([], [6], [0, 1, 4, 6], 4),
        ([1], [6], [0, 4, 6], 4),  # 1 lost in the hand-over; 6 is handed the run again
    ], run["recoveries"]
    assert run["world_size"] == 3
    assert "replacement ranks 4, 5 admitted after step 3; ranks 0,1,4,5 go on" in result.stderr

    oracle = resumed_chain(tmp_path, 4, [(1, 3), (2, 2), (3, 3), (4, 3)], [*EPOCHS])
    assert_equal_runs(run, oracle)
