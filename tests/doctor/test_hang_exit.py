"""A job that a collective's timeout ends, under a real ``tandem run``: the hang report names the
laggard before the job ends, it outlives the run, and the exit summary blames the laggard.

Two workers; rank 1 sleeps before an all-reduce that rank 0 waits in, until the collective's
timeout ends rank 0 (Gloo: "Timed out waiting ... for recv"). Neither test sets
``TANDEM_REPORT_DIR`` or ``--log-dir``, as a user would not: the launcher's report directory is
then temporary, and the hang reports go to the working directory (a temporary one here).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launching import clean_env

pytestmark = pytest.mark.launch

HERE = Path(__file__).parent


def _run(worker: str, cwd: Path, **extra: str) -> subprocess.CompletedProcess:
    env = {
        k: v
        for k, v in clean_env().items()
        if k not in ("TANDEM_REPORT_DIR", "TANDEM_HANG_REPORT_DIR", "TANDEM_HANG_REPORT_AFTER")
    }
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", "run", "--nproc-per-node", "2", str(HERE / worker)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={**env, **extra},
    )


@pytest.mark.timeout(150)
def test_a_short_timeout_is_reported_before_it_ends_the_job(tmp_path):
    """``tandem.init(timeout=8)`` and the default ``hang_report_after`` (60 s): the report comes
    at half the timeout (4 s), so the laggard is named, on the console and in the JSON, before
    the timeout ends the job; the exit summary heads with the laggard, not with rank 0, whose
    collective timed out."""
    result = _run("timeout_worker.py", tmp_path, TIMEOUT_S="8")
    assert result.returncode == 1, result.stderr
    err = result.stderr
    # Printed by rank 0 while it waited, before its collective's timeout ended it.
    printed = re.search(
        r"\[rank 0\] tandem: rank 0 has waited [45] s in all_reduce #1 of world", err
    )
    assert printed is not None, err
    assert printed.start() < err.index("Timed out waiting 8000ms"), err
    assert re.search(r"rank 1 never entered all_reduce #1: .* in read_forever", err), err

    (written,) = tmp_path.glob("tandem-hang-rank0-all_reduce-1.json")
    report = json.loads(written.read_text())
    assert report["laggard_ranks"] == [1], report["text"]
    assert report["timeout_s"] == 8.0 and 4.0 <= report["waited_s"] < 8.0, report["waited_s"]
    # Marked at rank 0's exit: the report was there, and its collective never completed.
    assert report["unfinished_at_exit"] is True

    summary = err[err.index("tandem run: ") :]
    first = summary.splitlines()[0]
    assert first.startswith("tandem run: rank 1 held the job up; rank 0 (local rank 0 on "), first
    assert first.endswith(
        "failed first (exit code 1) while waiting for it in all_reduce #1 of world"
    )
    assert "tandem run: rank 0 (local rank 0" not in summary, summary
    assert re.search(r"\n  rank 1 never entered all_reduce #1: .* in read_forever\n", summary)
    assert f"--- the newest hang report ({written}) ---" in summary, summary


@pytest.mark.timeout(150)
def test_the_hang_report_outlives_a_run_without_a_log_dir(tmp_path):
    """The README's promise: without ``--log-dir`` the JSON lands in the working directory and
    is still there after the run (it used to go to the launcher's temporary directory, removed
    at exit); the exit summary repeats it, naming the file."""
    before = set(os.listdir(tmp_path))
    result = _run("hang_worker.py", tmp_path)
    assert result.returncode != 0
    written = tmp_path / "tandem-hang-rank0-all_reduce-1.json"
    assert set(os.listdir(tmp_path)) - before == {written.name}  # nothing else left here
    report = json.loads(written.read_text())
    assert "rank 1 never entered all_reduce #1" in report["text"], report["text"]
    assert "hang_worker.py:12 in read_forever" in report["text"], report["text"]
    summary = result.stderr[result.stderr.index("tandem run: rank") :]
    assert summary.startswith("tandem run: rank 1 held the job up"), summary
    assert f"--- the newest hang report ({written}) ---" in summary, result.stderr
    assert "hang_worker.py:12 in read_forever" in summary, summary
