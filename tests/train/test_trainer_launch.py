"""A real SIGTERM sent to ``tandem run`` checkpoints a 2-process Trainer run, which then resumes.

Proves, end to end with the wine example: SIGTERM to the launcher (forwarded to both workers)
makes the workers agree on a step, write one checkpoint and stop within the launcher's grace
period (rank 0 prints ``stopped by SIGTERM``; the launcher exits 143 = 128 + SIGTERM, as it
does for any run stopped by a signal). The same command with ``--resume latest`` continues
from that checkpoint: it says where it resumed, prints exactly the remaining epochs, numbered
on from the ones already done, and ends with a final accuracy.
"""

from __future__ import annotations

import re
import signal
import subprocess
import threading

import pytest

from tandem.checkpoint.run_dir import list_checkpoints, load_checkpoint
from tests.launching import clean_env, tandem_run_module

pytestmark = pytest.mark.launch

_EPOCH = re.compile(r"^epoch\s+(\d+)\s+loss", re.MULTILINE)


def _command(run_dir, epochs: int, *extra: str) -> list[str]:
    return tandem_run_module(
        "tandem.examples.wine",
        "--epochs",
        str(epochs),
        "--save-every",
        "1000",
        "--run-dir",
        str(run_dir),
        *extra,
    )


def test_sigterm_to_tandem_run_checkpoints_and_the_run_resumes(tmp_path):
    proc = subprocess.Popen(
        _command(tmp_path, 5000),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    watchdog = threading.Timer(90, proc.kill)
    watchdog.start()
    try:
        seen = []
        assert proc.stdout is not None
        for line in proc.stdout:  # wait until training is well under way
            seen.append(line)
            if line.startswith("epoch   3 "):
                break
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        watchdog.cancel()
    out = "".join(seen) + out
    shown = f"stdout:\n{out}\nstderr:\n{err}"
    assert proc.returncode == 128 + signal.SIGTERM, shown
    assert re.search(r"^stopped by SIGTERM at epoch \d+ step \d+", out, re.MULTILINE), shown
    assert "final test accuracy" not in out, shown

    last = list_checkpoints(tmp_path)[-1]
    saved = load_checkpoint(last)
    done = saved["state"]["trainer"]["epoch"]  # epochs completed when it stopped
    assert done >= 3, shown
    resumed = subprocess.run(
        _command(tmp_path, done + 2, "--resume", "latest"),
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
        check=False,
    )
    shown = f"stdout:\n{resumed.stdout}\nstderr:\n{resumed.stderr}"
    assert resumed.returncode == 0, shown
    assert f"resumed from {last}: epoch {done + 1}" in resumed.stdout, shown
    assert [int(e) for e in _EPOCH.findall(resumed.stdout)] == [done + 1, done + 2], shown
    assert "final test accuracy" in resumed.stdout, shown
