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
- **a member that reads the last commit's states late**: in that generation rank 4 takes the
  place of rank 1 (whose generators it now holds) and leaves them in the store for the new
  generation's start commit, which commits step 3 again; rank 6 reads rank 4's state of the
  last commit (step 3 of generation 4) only after that (``--late-read``, as a slow newcomer
  does under load: the race that made this test fail in the full suite, where rank 6 went on
  with rank 1's generators). Commits are told apart by (step, generation), so the start commit
  writes a slot of its own and rank 6 reads rank 4's own state of the commit it restarts from;
- each generation's record (members, lost, joined) is the one expected, one membership per
  generation; the run ends bitwise where "4 ranks to step 1, 3 to step 2, 2 to step 3, 3 to
  step 4, 3 to the end" ends (a resume at each step where a group formed: a new tandem.DDP lays
  its first buckets out anew, and at 3 ranks Gloo's ring sums round by that layout);
- every process is accounted for: the launcher exits 0, each of the 4 lost is named once, and
  nothing of the 7 processes is left.

And, in one process over a store in memory, the two rules that make that sound: a rank's own
state written for a start commit (step 3 of generation 6) leaves the state of the commit it
repeats (step 3 of generation 4) readable, and the one before; a member that committed a step
in an older generation than the others (the start commit completed on them and failed on it)
is behind them, in one verdict read by every member.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tandem.recovery import PREFIX, Membership
from tests.launching import run_job
from tests.recovery.chains import resumes
from tests.recovery.test_recovery import assert_equal_runs, leftovers

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
def test_losses_during_admissions_end_in_one_membership_equal_to_the_chain(tmp_path, chains):
    out = tmp_path / "run.pt"
    split = ("--kill", "3:1:forward", "--kill", "2:1:voted", "--split", "0:1")
    take_over = (
        "--kill",
        "5:*:handover",
    )
    hand_over = ("--kill", "1:4:handover", "--late-read", "6:4")
    waits = ("--await", "1:1", "--await", "2:2", "--await", "3:3")
    result = launch(4, out, 3, *split, *take_over, *hand_over, *waits)
    accounted(result, out, [1, 2, 3, 5])
    assert len(list(tmp_path.glob("run.pt.pid-*"))) == 7  # the 4 and 3 replacements
    assert json.loads((tmp_path / "run.pt.split-0").read_text())["step"] == 1
    assert (killed(out, 2)["where"], killed(out, 2)["step"]) == ("voted", 1)
    assert killed(out, 5)["where"] == "handover"
    assert (killed(out, 1)["where"], killed(out, 1)["step"]) == ("handover", 4)
    # Rank 6 read the states of step 3's commit after rank 4 had left its start commit's.
    late = json.loads((tmp_path / "run.pt.late-6").read_text())
    assert late == {"step": 3, "generation": 6, "seen": True}, late
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

    (oracle,) = chains.get(resumes(4, [(1, 3), (2, 2), (3, 3), (4, 3)], EPOCHS))
    assert_equal_runs(run, torch.load(oracle, weights_only=True))


def test_a_start_commit_keeps_the_state_of_the_commit_of_the_step_it_repeats():
    """Rank 4's own state as the launch above leaves it: handed step 2's commit (generation 2),
    it commits step 2 again as generation 4 starts, then step 3; generation 6 moves it to rank
    1's place, and its start commits step 3 again with rank 1's generators. A member still to
    read the states of generation 4's commit of step 3 finds rank 4's own (before the fix the
    start commit overwrote the slot of step 3 and it found rank 1's), and the commit before it
    too, while the next step's vote is under way."""
    store = dist.HashStore()
    rank4 = Membership(store, me=4, members=[0, 1, 4], heartbeat_timeout=10.0)
    rank4.generation = 4
    rank4.record_commit((2, 2))  # handed
    for step, value in ((2, "seeded"), (3, "own")):
        rank4.publish(step, value, committed=rank4.commits[-1][0])
        rank4.record_commit((step, 4))
    rank4.generation, rank4.members = 6, [0, 4, 6]
    rank4.publish(3, "rank 1's", committed=3)  # generation 6's start commit
    reader = Membership(store, me=6, members=[0, 4, 6], heartbeat_timeout=10.0)
    assert reader.own_value(4, (3, 4)) == "own"
    assert reader.own_value(4, (3, 6)) == "rank 1's"
    assert reader.own_value(4, (2, 4)) == "seeded"
    rank4.record_commit((3, 6))
    rank4.publish(4, "next", committed=3)
    assert [reader.own_value(4, k) for k in ((3, 4), (3, 6), (4, 6))] == ["own", "rank 1's", "next"]


def test_a_member_that_missed_a_start_commit_is_behind_those_that_made_it():
    """Generation 6's start commit (step 3 again) completed on ranks 0 and 4 and failed on rank
    6: all three joined generation 7 with step 3, and the generation tells them apart."""
    store = dist.HashStore()
    store.set(f"{PREFIX}joiner/1", "7")  # replacement 7 queued, its vote passed on 0 and 4
    results: dict[int, object] = {}

    def one(r: int, committed: tuple[int, int]) -> None:
        m = Membership(store, r, [0, 4, 6], heartbeat_timeout=30.0)
        m.generation = 6
        try:
            m.reform(committed, admit=1)  # a replacement queued: not admitted with one behind
        except Exception as error:  # told in the assertion below
            results[r] = error
            return
        results[r] = (m.members, m.generation, m.settled_key, m.settled, m.behind, m.newcomers)

    threads = [
        threading.Thread(target=one, args=a) for a in ((0, (3, 6)), (4, (3, 6)), (6, (3, 4)))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    expected = ([0, 4, 6], 7, (3, 6), 3, [6], [])
    assert results == {0: expected, 4: expected, 6: expected}, results
