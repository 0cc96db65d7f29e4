"""``ci/gpu/run --dry`` keeps the GPU machine's one script from rotting between GPU runs.

Proves, on a machine without a GPU: the script runs end to end in its dry form and exits 0;
it collects the ``cuda`` tests (every test under ``tests/cuda`` carries the marker, and
``-m cuda`` finds them all, more than a handful); it runs ``benchmarks/gpu.py`` at tiny sizes
on the CPU, whose JSON holds the run's ``meta`` and rows; and it writes the machine description
and the log where ``$OUT`` says, as it will on the GPU machine.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.launch

ROOT = Path(__file__).resolve().parents[1]


def test_dry_run_collects_the_cuda_tests_and_runs_the_benchmark(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": "python"}
    env.pop("TANDEM_CUDA_ON_CPU", None)
    run = subprocess.run(
        [str(ROOT / "ci/gpu/run"), "--dry"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    log = (tmp_path / "log.txt").read_text()
    found = [line for line in log.splitlines() if line.startswith("tests/cuda holds")]
    assert found, log[-3000:]
    words = found[0].split()
    total, marked = int(words[2]), int(words[-1])
    assert total == marked >= 20, found[0]
    about = json.loads((tmp_path / "about.json").read_text())
    assert about["torch"] and about["gloo_collectives"]["all_reduce"] == "ok", about
    bench = json.loads((tmp_path / "gpu.json").read_text())
    assert bench["meta"]["device"].startswith("cpu") and bench["meta"]["arguments"]["tiny"], bench
    assert bench["rows"], bench
