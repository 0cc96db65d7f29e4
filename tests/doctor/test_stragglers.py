"""The step clock and the straggler summary: the arithmetic, on fixed and generated inputs.

Proves, without processes:

- a :class:`tandem.doctor.step_clock.Clock` records each step's duration and the part of it spent
  inside ``step_clock.waiting`` (a blocking collective's time inside a wait is counted once);
- the step file a rank writes reads back into the summary, only the newest attempt of the run
  asked for, a broken file left out;
- the summary names the rank whose median work per step (step less waiting) is more than 10%
  above the median rank's, and no rank when all do the same work, whatever the step times and
  waiting (hypothesis): waiting for the others is not slowness.
"""

from __future__ import annotations

import json
import time

from hypothesis import given
from hypothesis import strategies as st

from tandem.doctor import step_clock, stragglers
from tandem.doctor.stragglers import RankSteps, describe, slowest


def test_a_clock_times_steps_and_the_waiting_inside_them():
    clock = step_clock.Clock("test", priority=1)
    clock.tick()
    with step_clock.waiting:
        time.sleep(0.03)
        step_clock.blocked(5.0)  # a blocking collective inside a wait: already counted by the wait
    time.sleep(0.01)
    clock.tick()
    clock.tick()
    (seconds, waited), (short, none) = clock.steps
    assert 0.04 <= seconds < 1.0
    assert 0.03 <= waited < seconds - 0.009
    assert short < 0.01 and none == 0.0
    before = step_clock.waited()
    step_clock.blocked(0.5)  # outside a wait: counted
    assert step_clock.waited() - before == 0.5


def _write(directory, rank, attempt, run_id="run1", per_step=(0.1, 0.05), n=5):
    record = {"rank": rank, "run_id": run_id, "attempt": attempt, "clock": "test",
              "steps": [list(per_step)] * n, "waited_s": per_step[1] * n}  # fmt: skip
    (directory / step_clock.file_name(run_id, rank)).write_text(json.dumps(record))


def test_the_summary_reads_the_newest_attempt_of_its_run(tmp_path):
    _write(tmp_path, 0, attempt=1)
    _write(tmp_path, 1, attempt=1, per_step=(0.1, 0.0))
    _write(tmp_path, 2, attempt=0, per_step=(9.0, 0.0))  # an earlier attempt's: left out
    _write(tmp_path, 3, attempt=5, run_id="another")  # another job's: left out
    (tmp_path / step_clock.file_name("run1", 4)).write_text("{broken")
    ranks = stragglers.read(tmp_path, "run1")
    assert [r.rank for r in ranks] == [0, 1]
    text = stragglers.summary(tmp_path, "run1")
    assert text is not None
    assert "rank 0: 5 steps, 100.0 ms; waiting 50.0 ms (0.25 s in all)" in text
    assert "rank 1 is the slowest: 100.0 ms of work per step, 33% more" in text
    assert stragglers.summary(tmp_path, "none") is None


def test_a_rank_writes_its_steps_for_the_summary(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    monkeypatch.setattr(step_clock, "_clocks", [])
    made = step_clock.Clock("tandem.DDP forwards", priority=1)
    trainer = step_clock.Clock("tandem.Trainer optimizer steps", priority=0)
    step_clock._clocks.extend([made, trainer])
    assert step_clock.write(tmp_path) is None  # no step yet
    for _ in range(3):
        made.tick()
    assert step_clock.counting() is made
    trainer.tick()
    trainer.tick()  # the Trainer's clock wins once it has a step
    path = step_clock.write(tmp_path)
    assert path == tmp_path / "tandem-steps-abc-rank3.json"
    written = json.loads(path.read_text())
    assert written["clock"] == "tandem.Trainer optimizer steps" and len(written["steps"]) == 1
    (only,) = stragglers.read(tmp_path, "abc")
    assert only.rank == 3 and slowest([only]) is None


def test_one_rank_doing_the_same_as_others_while_they_wait_is_not_named():
    # Everyone's steps take 100 ms; rank 1 works 100 ms, the others work 50 and wait 50.
    ranks = [RankSteps(r, [(0.1, 0.05)] * 9) for r in (0, 2, 3)]
    ranks.append(RankSteps(1, [(0.1, 0.0)] * 9))
    assert slowest(ranks).rank == 1
    assert "rank 1 is the slowest: 100.0 ms of work per step, 100% more" in describe(ranks)
    assert slowest([RankSteps(r, [(0.1, 0.05)] * 9) for r in range(4)]) is None
    assert slowest([RankSteps(0, []), RankSteps(1, [(0.1, 0.0)])]) is None


_step = st.floats(min_value=1e-3, max_value=10.0)


@given(
    st.lists(st.tuples(_step, st.floats(0.0, 1.0)), min_size=1, max_size=30),
    st.integers(min_value=2, max_value=16),
)
def test_ranks_doing_equal_work_are_never_named(pattern, world):
    # Each rank may wait a different share of every step: the work (step less wait) is equal.
    ranks = []
    for r in range(world):
        rank_steps = [(work + wait * r, wait * r) for work, wait in pattern]
        ranks.append(RankSteps(r, rank_steps))
    assert slowest(ranks) is None
    assert "is the slowest" not in describe(ranks)


@given(
    _step,
    st.integers(min_value=3, max_value=16),
    st.integers(min_value=0, max_value=15),
    st.one_of(st.floats(1.0, 1.09), st.floats(1.11, 20.0)),
)
def test_a_rank_is_named_exactly_when_its_work_is_over_ten_percent_above(work, world, who, f):
    who %= world
    ranks = [RankSteps(r, [(work * (f if r == who else 1.0), 0.0)] * 3) for r in range(world)]
    named = slowest(ranks)
    assert (named is not None) == (f > 1.1)
    if named is not None:
        assert named.rank == who
