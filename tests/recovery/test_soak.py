"""A soak: 4 ranks lose three of theirs, one at a time, in three ways, over four epochs.

Proves (real processes, ``tandem run --recover in-memory --heartbeat-timeout 2``): a rank
SIGKILLed in its forward at step 3 (4 -> 3 ranks), one hung (SIGSTOP) at step 11 (3 -> 2, left
out after the heartbeat timeout and killed by the launcher) and rank 0 SIGKILLed inside its
optimizer step at step 23 (committed: the loss is met at step 24, 2 -> 1): the run ends bitwise
where the oracle chain ends (4 ranks to step 3, saved; 3 ranks resumed to 11, saved; 2 ranks to
24, saved; 1 rank to the end), each sample of each epoch was trained exactly once (the sample
ids every rank recorded for each step it committed, the lost ranks' included), and no process
is left behind. The losses fall where the rest of each epoch divides among the survivors, so
no padding repeats a sample.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.launching import run_job
from tests.recovery.test_recovery import assert_equal_runs, leftovers

pytestmark = [pytest.mark.launch, pytest.mark.xdist_group("recovery")]

WORKER = "tests.recovery.soak_worker"
EPOCHS = ("--epochs", "4")
SAMPLES = 96
KILLS = ("1:3:forward", "3:11:hang", "0:23:step")
# (ranks, the step each segment stops after): the oracle chain's segments.
CHAIN = ((4, 3), (3, 11), (2, 24), (1, None))


def run_worker(nproc: int, out: Path, *args: str, recover: bool = False):
    flags = ["--recover", "in-memory", "--heartbeat-timeout", "2"] if recover else []
    return run_job(nproc, flags, WORKER, str(out), *args, timeout=300)


@pytest.mark.timeout(600)
def test_three_losses_in_four_epochs_equal_the_resume_chain_and_train_each_sample_once(
    tmp_path,
):
    soak = tmp_path / "soak.pt"
    kills = [arg for kill in KILLS for arg in ("--kill", kill)]
    result = run_worker(4, soak, *EPOCHS, *kills, recover=True)
    lost = re.findall(r"^tandem run: rank (\d+) \(.*\) was lost", result.stderr, re.M)
    assert sorted(map(int, lost)) == [0, 1, 3], result.stderr[-3000:]
    summary = [line for line in result.stderr.splitlines() if "tandem run: recovery " in line]
    assert len(summary) == 3, result.stderr[-3000:]
    recovered = torch.load(soak, weights_only=True)
    assert [(r["lost"], r["step"]) for r in recovered["recoveries"]] == [
        ([1], 3),
        ([3], 11),
        ([0], 24),
    ]
    assert recovered["world_size"] == 1

    # Every sample of every epoch exactly once, over every rank's committed steps.
    per_epoch: dict[int, Counter] = {}
    steps: dict[int, set[int]] = {}
    for path in tmp_path.glob("soak.pt.samples-*"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            per_epoch.setdefault(entry["epoch"], Counter()).update(entry["ids"])
            steps.setdefault(entry["epoch"], set()).add(entry["step"])
    assert sorted(per_epoch) == [0, 1, 2, 3]
    for epoch, counts in per_epoch.items():
        extra, missing = counts - Counter(range(SAMPLES)), Counter(range(SAMPLES)) - counts
        assert not extra and not missing, f"epoch {epoch}: twice {extra}, never {missing}"
    assert sorted(s for e in steps.values() for s in e) == list(range(recovered["steps"]))

    # The oracle chain: each segment saves, the next resumes from it at its size.
    saved: Path | None = None
    for i, (nproc, stop) in enumerate(CHAIN):
        out = tmp_path / f"oracle{i}.pt"
        args = [*EPOCHS]
        args += ["--stop-after", str(stop)] if stop is not None else []
        args += ["--resume", str(saved)] if saved is not None else []
        run_worker(nproc, out, *args)
        saved = out
    assert saved is not None
    assert_equal_runs(recovered, torch.load(saved, weights_only=True))

    pids = {int(p.read_text()) for p in tmp_path.glob("soak.pt.pid-*")}
    assert len(pids) == 4 and not leftovers(pids), leftovers(pids)
