"""Every benchmark still runs end to end: the tiniest run of each, as a user starts it.

Proves: each script in ``benchmarks/`` with a ``main()`` runs from its command line (its own
folder first on ``sys.path``, its worker processes started as in a real measurement) with one
pair or round of one or two steps on the smallest model, exits 0, prints its table, and writes
its JSON where ``--json`` says, with the run's ``meta``. The numbers themselves are not checked:
a run this short measures nothing, and a benchmark is not a test. Each runs in a process of its
own because benchmarks set process-wide state (``torch.set_num_threads(1)``).

``launch_probe.py`` (started by ``launch.py``) and ``sharded_contenders.py`` (imported by
``sharded.py``) run as parts of those two. ``recovery.py --netns`` (a node's link taken down,
each rank a network namespace) runs once more on its own, skipped with the reason where
namespaces or a bridge cannot be made.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

TINY = {
    # Two network-namespace nodes, unshaped; where namespaces cannot be made (no root), the
    # script says why, writes "skipped" into its JSON and exits 0.
    "across_nodes": [
        "--width", "16", "--blocks", "2", "--batch", "4", "--warmup", "1", "--rounds", "1",
        "--steps", "1", "--rate-mbit", "0", "--delay-ms", "0", "--timeout", "150",
    ],
    "ddp_throughput": [
        "--world", "2", "--pairs", "1", "--steps", "1", "--warmup", "1",
        "--models", "deep_200x16", "--interleave", "step",  # the warm-up runs a whole round
        "--recovery-overhead",
    ],
    "checkpoint": [
        "--models", "tiny", "--trials", "1", "--step-model", "tiny", "--rounds", "1",
        "--steps", "1",
    ],
    "dp": ["--pairs", "1", "--steps", "1", "--warmup", "1", "--models", "mlp", "--lm-batch", "4"],
    "gpu": ["--device", "cpu", "--tiny", "--pairs", "1", "--steps", "1", "--warmup", "2"],
    "elastic_reform": [  # tandem only (torchrun's re-form takes ~50 s), short beats
        "--quick", "--ways", "tandem", "--rdzv-conf", "keep_alive_interval=0.2",
        "--settle", "0.5", "--timeout", "60",
    ],
    "io": [
        "--world", "2", "--group-sizes", "2", "--storage", "parallel", "--pairs", "1",
        "--samples", "8", "--batch", "4", "--floats", "4", "--read-ms", "0",
    ],
    "launch": ["--pairs", "1", "--nproc", "2", "--no-floor", "--timeout", "60"],
    "recovery": ["--trials", "1", "--nproc", "2", "--ways", "kill", "restart", "--after", "2"],
    "sampler": ["--sizes", "1000", "--pairs", "1", "--iterate", "10"],
    "sharded": [
        "--world-sizes", "2", "--rounds", "1", "--steps", "1", "--warmup", "1",
        "--width", "8", "--blocks", "1", "--batch", "2", "--timeout", "60",
        "--contenders", "tandem.DDP", "stage 3",
    ],
    "trainer_overhead": [
        "--world", "2", "--pairs", "1", "--steps", "2", "--warmup", "1", "--batch", "2",
        "--block", "8", "--dim", "16", "--layers", "1", "--heads", "2",
    ],
}  # fmt: skip


def test_every_benchmark_has_a_tiny_run():
    scripts = {p.stem for p in BENCHMARKS.glob("*.py") if "def main(" in p.read_text()}
    assert scripts == set(TINY)


@pytest.mark.launch
@pytest.mark.parametrize("name", sorted(TINY))
def test_tiny_run(name, tmp_path):
    tiny_run(name, TINY[name], tmp_path)


@pytest.mark.launch
def test_tiny_run_of_recovery_on_namespace_nodes(tmp_path):
    from tests.launch.netns_switch import can_make_switch

    ok, reason = can_make_switch()
    if not ok:
        pytest.skip(reason)
    # 3 nodes: the 2 left hold the majority that goes on.
    written = tiny_run("recovery", ["--netns", "--ways", "link", "--trials", "1", "--nproc",
                                    "3", "--after", "2", "--timeout", "150"], tmp_path)  # fmt: skip
    assert written["ways"]["link"]["n"] == 1, written["ways"]["link"]["failures"]


def tiny_run(name: str, args: list[str], tmp_path: Path) -> dict:
    """Runs ``benchmarks/<name>.py args``; what it wrote to its JSON."""
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, str(BENCHMARKS / f"{name}.py"), *args, "--json", str(out)]
    # About 5-15 s each on 2 idle cores (most of it the workers' `import torch`); the limit
    # leaves room for a machine shared with other jobs.
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, f"{' '.join(cmd)}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    assert f"JSON: {out}" in run.stdout
    written = json.loads(out.read_text())
    assert "meta" in written
    return written
