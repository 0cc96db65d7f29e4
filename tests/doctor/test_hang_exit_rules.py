"""The rules behind a hang that a collective's timeout ends, as pure functions: when the report
comes (before the timeout), where its JSON goes, which reports an exit summary reads and whom it
blames, and which jobs check out at the end for a RANK given twice."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tandem.doctor import hang
from tandem.job.placement import placement_from_env
from tandem.launch.failures import Failure
from tandem.launch.supervisor import hang_reports, held_up_by
from tandem.world import _numbered_by_hand


@pytest.fixture
def threshold(monkeypatch):
    monkeypatch.delenv("TANDEM_HANG_REPORT_AFTER", raising=False)
    monkeypatch.setattr(hang.Reporter, "timeout_s", None)


@pytest.mark.usefixtures("threshold")
def test_a_short_timeout_brings_the_report_forward(monkeypatch):
    # The default 60 s threshold would come after a 20 s timeout has ended the job.
    assert hang.report_after(20.0) == 10.0
    assert hang.answer_within_s(20.0) == 5.0
    assert hang.report_after(8.0) + hang.answer_within_s(8.0) == 6.0  # < 8: out in time
    assert hang.report_after(1800.0) == 60.0  # torch's default timeout: the threshold stands
    assert hang.report_after(None) == 60.0  # unknown timeout: the threshold stands
    monkeypatch.setenv("TANDEM_HANG_REPORT_AFTER", "3")
    assert hang.report_after(20.0) == 3.0  # a lower threshold asked for wins
    monkeypatch.setattr(hang.Reporter, "timeout_s", 4.0)  # the group's, read at start
    assert (hang.report_after(), hang.answer_within_s()) == (2.0, 1.0)


def test_hang_reports_go_where_the_launcher_says(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_REPORT_DIR", str(tmp_path / "reports"))
    monkeypatch.delenv("TANDEM_HANG_REPORT_DIR", raising=False)
    assert hang.report_dir() == tmp_path / "reports"
    monkeypatch.setenv("TANDEM_HANG_REPORT_DIR", str(tmp_path))
    assert hang.report_dir() == tmp_path
    monkeypatch.delenv("TANDEM_HANG_REPORT_DIR")
    monkeypatch.delenv("TANDEM_REPORT_DIR")
    assert hang.report_dir() == Path(".")


def _report(path: Path, rank: int, laggards: list[int], unfinished: bool, age_s: float = 0) -> None:
    path.write_text(
        json.dumps(
            {
                "rank": rank,
                "text": f"report of rank {rank}",
                "collective": {"op": "all_reduce", "seq": 7, "group": "world"},
                "laggards": [f"rank {r} never entered all_reduce #7" for r in laggards],
                "laggard_ranks": laggards,
                "silent": [],
                "unfinished_at_exit": unfinished,
            }
        )
    )
    then = time.time() - age_s
    os.utime(path, (then, then))


def test_the_summary_blames_the_laggard_of_an_unfinished_wait(tmp_path):
    _report(tmp_path / "tandem-hang-rank0-all_reduce-7.json", 0, [1], unfinished=True)
    written = hang_reports(tmp_path)
    laggards, collective, details = held_up_by(0, written)
    assert (laggards, collective) == ([1], "all_reduce #7 of world")
    text = Failure(0, 0, "vm", 1, ("boom",)).summary(laggards, collective, details)
    assert text.splitlines()[:2] == [
        "tandem run: rank 1 held the job up; rank 0 (local rank 0 on vm) failed first "
        "(exit code 1) while waiting for it in all_reduce #7 of world",
        "  rank 1 never entered all_reduce #7",
    ]
    assert "boom" in text


def test_the_summary_keeps_the_failed_rank_when_the_report_does_not_explain_it(tmp_path):
    path = tmp_path / "tandem-hang-rank0-all_reduce-7.json"
    _report(path, 0, [1], unfinished=False)  # the wait ended: the failure came later
    assert held_up_by(0, hang_reports(tmp_path)) == ([], "", [])
    _report(path, 0, [1], unfinished=True)
    assert held_up_by(1, hang_reports(tmp_path)) == ([], "", [])  # rank 1 failed: itself
    _report(path, 0, [0, 1], unfinished=True)  # nonsense, but never blames past itself
    assert held_up_by(0, hang_reports(tmp_path)) == ([], "", [])
    assert Failure(0, 0, "vm", 1, ()).summary().startswith("tandem run: rank 0 (local rank 0")


def test_reports_of_earlier_runs_are_left_out(tmp_path):
    _report(tmp_path / "tandem-hang-rank0-all_reduce-3.json", 0, [1], True, age_s=3600)
    _report(tmp_path / "tandem-hang-rank0-all_reduce-7.json", 0, [2], True)
    (tmp_path / "tandem-hang-rank1-broken.json").write_text("{not json")
    started = time.time() - 60
    assert [p.name for p, _ in hang_reports(tmp_path, since=started)] == [
        "tandem-hang-rank0-all_reduce-7.json"
    ]
    assert len(hang_reports(tmp_path)) == 2


@pytest.mark.parametrize(
    ("env", "by_hand"),
    [
        ({"RANK": "1", "WORLD_SIZE": "2"}, True),  # exported by hand (or a test harness)
        ({"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"}, False),  # torchrun
        ({"RANK": "1", "WORLD_SIZE": "2", "TANDEM_SPAWN": "1"}, False),  # tandem.spawn
        ({"SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0",
          "SLURM_NODEID": "0", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "n1",
          "SLURM_JOB_ID": "7"}, False),
        ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
          "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, False),
    ],
)  # fmt: skip
def test_hand_numbered_jobs_check_out_for_a_rank_given_twice(monkeypatch, env, by_hand):
    for name in ("TORCHELASTIC_RUN_ID", "TANDEM_SPAWN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert _numbered_by_hand(placement_from_env(env)) is by_hand
