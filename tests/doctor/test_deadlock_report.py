"""A job deadlocked in user code, with no collective in flight, is reported; signals still end it.

Real launches (``tandem run``, two workers, tests/doctor/deadlock_worker.py): after one
all-reduce, rank 0 waits on a ``threading.Event`` that nobody sets and rank 1 sleeps. No
collective is open, so no timeout will ever end the job. With ``hang_report_after=2``:

- rank 0 prints one report within seconds, "no rank has issued a collective for N s", with each
  rank's line (``wait_for_data`` and ``main`` in the worker) and its stacks, once however long
  the job stays quiet, and writes it as JSON in ``TANDEM_REPORT_DIR``;
- SIGINT and SIGTERM to the launcher still end the job promptly (the doctor thread keeps no
  worker alive), with the launcher's 128 + signal status, and leave no worker behind.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.launching import clean_env

pytestmark = pytest.mark.launch

WORKER = str(Path(__file__).with_name("deadlock_worker.py"))


def _lines(pipe, into: queue.Queue, kept: list[str]) -> None:
    for line in iter(pipe.readline, ""):
        kept.append(line)
        into.put(line)
    into.put(None)


def _until(lines: queue.Queue, pattern: str, seconds: float) -> re.Match:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            continue
        if line is None:
            break
        if (found := re.search(pattern, line)) is not None:
            return found
    pytest.fail(f"no line matching {pattern!r} within {seconds} s")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_deadlock_in_user_code_is_reported_and_signals_end_the_job(signum, tmp_path):
    env = {**clean_env(), "TANDEM_REPORT_DIR": str(tmp_path)}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "run", "--nproc-per-node", "2", WORKER],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines: queue.Queue = queue.Queue()
    kept: list[str] = []
    threading.Thread(target=_lines, args=(launcher.stdout, lines, kept), daemon=True).start()
    pids: list[int] = []
    try:
        pids += [int(_until(lines, r"READY rank \d pid (\d+)", 60).group(1)) for _ in range(2)]
        _until(lines, r"no rank has issued a collective for \d+ s", 30)
        time.sleep(4)  # quiet for twice the threshold more: still one report
        text = "".join(kept)
        assert text.count("no rank has issued a collective") == 1, text
        assert re.search(r"rank 0 is at deadlock_worker.py:\d+ in wait_for_data", text), text
        assert re.search(r"rank 1 is at deadlock_worker.py:\d+ in main", text), text
        assert "--- rank 0 thread MainThread" in text and "ready.wait()" in text, text
        assert "--- rank 1 thread MainThread" in text and "time.sleep(3600)" in text, text
        (written,) = tmp_path.glob("tandem-hang-rank0-deadlock-*.json")
        report = json.loads(written.read_text())
        assert report["kind"] == "deadlock" and set(report["where"]) == {"0", "1"}, report
        sent = time.monotonic()
        launcher.send_signal(signum)
        assert launcher.wait(timeout=20) == 128 + signum, "".join(kept)
        assert time.monotonic() - sent < 10, "".join(kept)  # not the 30 s term timeout
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids), "workers outlived the launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
