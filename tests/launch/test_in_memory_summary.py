"""The exit summary of `--recover in-memory`, in this process: the launcher's record of each lost
rank joined with the survivors' `tandem-recovery-*.json` (one line per recovery, in order; a
loss no survivor reported says so), the store key and the record the launcher writes, and the
refusal of more than one node."""

from __future__ import annotations

import json
import os
import time

import pytest

from tandem.launch.failures import Failure
from tandem.launch.in_memory import (
    check_one_node,
    dead_key,
    death_record,
    recovery_lines,
    recovery_reports,
)
from tandem.launch.rendezvous import LaunchError


def _write(directory, name, **report):
    path = directory / f"tandem-recovery-{name}.json"
    path.write_text(json.dumps(report))
    return path


def test_each_loss_joined_with_its_report_in_order(tmp_path):
    lost = [
        Failure(2, 2, "vm", -9, (), at=110.0),
        Failure(3, 3, "vm", 1, (), at=120.0),
        Failure(0, 0, "vm", -11, (), at=130.0),
    ]
    # Generation 2 covers two ranks lost at once (3, and 1 which the launcher never saw exit).
    _write(tmp_path, "b", generation=2, lost=[3, 1], members=[0], detected_s=0.52, step=12,
           recovered_s=1.26)  # fmt: skip
    _write(tmp_path, "a", generation=1, lost=[2], members=[0, 1, 3], detected_s=0.31, step=7,
           recovered_s=0.94)  # fmt: skip
    reports = recovery_reports(tmp_path)
    assert [r["generation"] for r in reports] == [1, 2]
    assert recovery_lines(lost, reports, started=100.0) == [
        "recovery 1: rank 2 (killed by SIGKILL) lost at step 7; detected in 0.3 s; step 7 "
        "redone by ranks 0,1,3 in 0.9 s",
        "recovery 2: ranks 1 (no exit seen by the launcher), 3 (exit code 1) lost at step 12; "
        "detected in 0.5 s; step 12 redone by rank 0 in 1.3 s",
        "recovery 3: rank 0 (killed by SIGSEGV) lost 30.0 s into the run; the survivors did "
        "not report a recovery",
    ]


def test_one_generation_written_by_several_survivors_is_one_recovery(tmp_path):
    for rank, (detected, recovered) in enumerate([(0.2, 0.8), (0.4, 0.7)]):
        _write(tmp_path, f"g1-r{rank}", generation=1, lost=[2], members=[0, 1], step=3,
               detected_s=detected, recovered_s=recovered)  # fmt: skip
    (tmp_path / "tandem-recovery-broken.json").write_text("{not json")
    reports = recovery_reports(tmp_path)
    assert len(reports) == 1
    assert reports[0]["detected_s"] == 0.4 and reports[0]["recovered_s"] == 0.8
    lines = recovery_lines([Failure(2, 2, "vm", -9, (), at=5.0)], reports, started=0.0)
    assert lines == [
        "recovery 1: rank 2 (killed by SIGKILL) lost at step 3; detected in 0.4 s; step 3 "
        "redone by ranks 0,1 in 0.8 s"
    ]


def test_reports_of_other_runs_are_left_out(tmp_path):
    old = _write(tmp_path, "old", generation=1, lost=[1], members=[0])
    os.utime(old, (time.time() - 100, time.time() - 100))
    _write(tmp_path, "other", generation=2, lost=[1], members=[0], run_id="someone-else")
    _write(tmp_path, "ours", generation=3, lost=[1], members=[0], run_id="ours")
    found = recovery_reports(tmp_path, since=time.time() - 50, run_id="ours")
    assert [r["generation"] for r in found] == [3]


def test_a_report_without_a_committed_step_says_so(tmp_path):
    _write(tmp_path, "x", generation=1, lost=[1], members=[0, 2], detected_s=0.1, step=4)
    lines = recovery_lines([Failure(1, 1, "vm", -9, (), at=2.0)], recovery_reports(tmp_path), 0.0)
    assert lines == [
        "recovery 1: rank 1 (killed by SIGKILL) lost at step 4; detected in 0.1 s; no step "
        "committed after it by ranks 0,2"
    ]


def test_the_dead_key_and_its_record():
    assert dead_key(3, {}) == "tandem/recover/dead/3"
    assert dead_key(3, {"TANDEM_JOB_SECRET": "x"}).endswith("/recover/dead/3")
    assert dead_key(3, {"TANDEM_JOB_SECRET": "x"}).startswith("tandem/job-")
    record = death_record(Failure(3, 1, "vm", 2, ("Traceback",), at=12.5))
    assert json.loads(json.dumps(record)) == {
        "rank": 3,
        "how": "exit code 2",
        "at": 12.5,
        "returncode": 2,
        "local_rank": 1,
        "host": "vm",
    }


def test_more_than_one_node_is_refused():
    check_one_node("--nnodes 1", True)
    with pytest.raises(LaunchError, match="--nnodes 2: only one node is supported"):
        check_one_node("--nnodes 2", False)
