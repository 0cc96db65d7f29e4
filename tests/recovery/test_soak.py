"""Soaks: ``tandem run --recover in-memory`` through many losses, against the chain of saves and
resumes with the membership schedule the run went through, run in one launch
(``soak_worker --chain``: each segment a fresh ``tandem.init`` at its size, resumed from the
previous one's ``tandem.checkpoint`` file, the processes beyond its size waiting for a later
one).

Proves (real processes, ``--heartbeat-timeout 2``, ``tandem.recovery.Run``):

- Three losses, one at a time, in three ways, over four epochs, nobody replaced: a rank
  SIGKILLed before its forward at step 3 (4 -> 3 ranks), one hung (SIGSTOP) at step 11 (3 -> 2,
  left out after the heartbeat timeout and killed by the launcher) and rank 0 SIGKILLed inside
  its optimizer step at step 23 (committed: the loss is met at step 24, 2 -> 1). The losses
  fall where the rest of each epoch divides among the survivors, so no padding repeats a
  sample.
- The issue's soak: 4 ranks, 200 steps, a failure every 15 to 30 steps drawn from a seed
  (``soak_worker.plan``: any rank, rank 0 included; SIGKILL or SIGSTOP; before the forward,
  inside the backward with a bucket per parameter, after it, or inside the optimizer step: the
  last two after the step's vote, which rides in the gradient all-reduce, so that step
  commits), each replaced (``--max-restarts``): the newcomer joins at a later step boundary,
  so the membership goes 4 -> 3 -> 4 -> 3 ... (a failure planned before the previous replacement
  joined waits for it, and may then strike the grown generation at its first step, which
  commits nothing). 12 samples a rank and step over 960: every share of the rest of an epoch
  at 4, 3, 2 or 1 ranks is whole, so no padding repeats a sample. The seed, 2, strikes at
  every point, with both signals, every rank of the first four included.

Each ends bitwise where its chain ends (parameters, momentum, every rank's generator), each
rank of each committed step trained the samples its place in the chain trains, to the same
loss, each sample of each epoch was trained exactly once (the sample ids every rank recorded
for each step it committed, the lost ranks' included; the 200-step soak's last epoch, cut
short, at most once), the observed schedule is the one the losses and joins make, and no
process the run started (replacements included) is left behind.

The 200-step soak's seed is fixed; another one runs by hand with
``TANDEM_SOAK_SEED=N python -m pytest -n 0 -s tests/recovery/test_soak.py -k replaced`` (``-s``
prints the plan and the observed schedule, with each loss's and join's time from its
failure), e.g. a few in turn with ``for n in 1 2 3; do TANDEM_SOAK_SEED=$n python -m pytest
...; done``.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

from tests.launching import run_job
from tests.recovery.soak_worker import WORLD, plan, strikes
from tests.recovery.test_recovery import ONE_PARAMETER_BUCKETS, assert_equal_runs, leftovers

pytestmark = [pytest.mark.launch, pytest.mark.xdist_group("recovery")]

WORKER = "tests.recovery.soak_worker"
RECOVER = ("--recover", "in-memory", "--heartbeat-timeout", "2")

# Committed steps as the worker records them: step -> launch rank -> its line.
Steps = dict[int, dict[int, dict]]
# A generation as observed: its number, its members (launch ranks, in rank order), its first step.
Generation = tuple[int, list[int], int]


def run_worker(nproc: int, out: Path, *args: str, flags: tuple[str, ...] = ()):
    return run_job(nproc, list(flags), WORKER, str(out), *args, timeout=400)


def records(out: Path, kind: str) -> dict[int, str]:
    """``OUT.<kind>-RANK`` files' text, by launch rank."""
    found = out.parent.glob(f"{out.name}.{kind}-*")
    return {int(p.name.rsplit("-", 1)[1]): p.read_text() for p in found}


def committed(out: Path) -> Steps:
    """Every step some rank committed: its lines, by launch rank (each rank once a step)."""
    steps: Steps = {}
    for rank, text in records(out, "samples").items():
        for line in text.splitlines():
            entry = json.loads(line)
            mine = steps.setdefault(entry["step"], {})
            assert rank not in mine, f"rank {rank} committed step {entry['step']} twice"
            mine[rank] = entry
    return steps


def schedule(steps: Steps, killed: Iterable[dict] = ()) -> list[Generation]:
    """The generations, from the ranks' own lines: every step's lines agree on its generation
    and members, and come from exactly those members, each at its place. A generation that
    committed no step (a loss at its first) is known from that loss's record (``killed``)."""
    generations: list[Generation] = []
    for step in sorted(steps):
        lines = steps[step]
        (generation, members), *others = {
            (e["generation"], tuple(e["members"])) for e in lines.values()
        }
        assert not others, f"step {step}: the ranks disagree on the membership: {lines}"
        assert sorted(lines) == sorted(members), f"step {step}: {sorted(lines)} of {members}"
        for rank, entry in lines.items():
            assert entry["rank"] == members.index(rank), f"step {step}: rank {rank}'s place"
        if not generations or generations[-1][0] != generation:
            generations.append((generation, list(members), step))
    seen = {g for g, _, _ in generations}
    empty = {r["generation"]: (r["members"], r["step"]) for r in killed}
    generations += [(g, *empty[g]) for g in empty if g not in seen]
    return sorted(generations, key=lambda generation: generation[0])


def assert_each_sample_once(steps: Steps, samples: int, epochs: int) -> None:
    """Each of ``samples`` trained once in each of the first ``epochs`` epochs, over every
    rank's committed steps, and none twice in a later (last, cut short) one."""
    per_epoch: dict[int, Counter] = {}
    for lines in steps.values():
        for entry in lines.values():
            per_epoch.setdefault(entry["epoch"], Counter()).update(entry["ids"])
    assert sorted(per_epoch)[:epochs] == list(range(epochs)), sorted(per_epoch)
    for epoch, counts in per_epoch.items():
        twice = {i: n for i, n in counts.items() if n > 1}
        never = set(range(samples)) - set(counts) if epoch < epochs else set()
        assert not twice and not never, f"epoch {epoch}: twice {twice}, never {sorted(never)}"


def oracle(tmp_path: Path, generations: list[Generation], args: tuple[str, ...]) -> Path:
    """The chain of saves and resumes with those generations' sizes, in one launch: its
    record's path."""
    ends = [first for _, _, first in generations[1:]] + [None]
    segments = [[len(members), end] for (_, members, _), end in zip(generations, ends, strict=True)]
    out = tmp_path / "oracle.pt"
    size = max(len(members) for _, members, _ in generations)
    run_worker(size, out, *args, "--chain", json.dumps(segments))
    return out


def assert_same_samples(steps: Steps, chain: Steps) -> None:
    """Each step's samples and loss, by group rank, as the chain trains them (bitwise: the
    first step that differs, if any, is named)."""
    assert sorted(steps) == sorted(chain)
    for step in sorted(steps):
        mine = {e["rank"]: (e["epoch"], e["ids"], e["loss"]) for e in steps[step].values()}
        theirs = {e["rank"]: (e["epoch"], e["ids"], e["loss"]) for e in chain[step].values()}
        assert mine == theirs, f"step {step}: {mine} != {theirs}"


def assert_nothing_left(*outs: Path) -> None:
    """No process of these runs is left: none of those that wrote ``OUT.pid-RANK`` (nor of
    their process groups), none whose command line names an OUT (one killed before it
    wrote)."""
    pids = {int(text) for out in outs for text in records(out, "pid").values()}
    assert not leftovers(pids), leftovers(pids)
    names = [str(out).encode() for out in outs]
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue  # gone meanwhile
        assert not any(name in command for name in names), command.replace(b"\0", b" ")


EPOCHS = ("--epochs", "4")  # 96 samples, 4 a rank and step
SAMPLES = 96
KILLS = ("1:3:forward", "3:11:hang", "0:23:step")


@pytest.mark.timeout(600)
def test_three_losses_in_four_epochs_equal_the_resume_chain_and_train_each_sample_once(
    tmp_path,
):
    soak = tmp_path / "soak.pt"
    kills = [arg for kill in KILLS for arg in ("--kill", kill)]
    result = run_worker(4, soak, *EPOCHS, *kills, flags=RECOVER)
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

    steps = committed(soak)
    assert sorted(steps) == list(range(recovered["steps"]))
    generations = schedule(steps)
    assert generations == [(0, [0, 1, 2, 3], 0), (1, [0, 2, 3], 3), (2, [0, 2], 11), (3, [2], 24)]
    assert_each_sample_once(steps, SAMPLES, epochs=4)

    chain = oracle(tmp_path, generations, EPOCHS)
    assert_same_samples(steps, committed(chain))
    assert_equal_runs(recovered, torch.load(chain, weights_only=True))
    assert sorted(records(soak, "pid")) == sorted(records(chain, "pid")) == [0, 1, 2, 3]
    assert_nothing_left(soak, chain)


STEPS = 200
SOAK_SEED = int(os.environ.get("TANDEM_SOAK_SEED", "2"))
SOAK_SAMPLES = 960
SOAK = (
    "--samples", str(SOAK_SAMPLES), "--batch-size", "12", "--epochs", "20",
    "--stop-after", str(STEPS), "--bucket-cap-mb", ONE_PARAMETER_BUCKETS,
)  # fmt: skip
# Seconds of sleep a step trained short of a member: the replacement takes some seconds to
# start (an interpreter, torch's import) and join, which that stretch lasts whatever the sleep;
# a long one makes it few steps, so that it joins before the next failure is due.
SHORT_SLEEP = "1"


@pytest.mark.timeout(600)
def test_a_rank_lost_every_15_to_30_steps_and_replaced_equals_its_resume_chain(tmp_path):
    failures = plan(SOAK_SEED, STEPS)
    print(f"seed {SOAK_SEED}: {len(failures)} failures planned:", *failures, sep="\n  ")
    soak = tmp_path / "soak.pt"
    flags = (*RECOVER, "--max-restarts", str(len(failures)))
    # The commit's state taken on a thread (TANDEM_COMMIT_OFF_PATH=1), as where a core is
    # spare; the other recovery tests take it as this machine's cores decide (on the path with
    # a core per rank).
    args = (*SOAK, "--plan", str(SOAK_SEED), "--short-sleep", SHORT_SLEEP, "--off-path")
    err = run_worker(WORLD, soak, *args, flags=flags).stderr
    recovered = torch.load(soak, weights_only=True)
    steps = committed(soak)
    assert sorted(steps) == list(range(STEPS)) and recovered["steps"] == STEPS
    killed = {rank: json.loads(text) for rank, text in records(soak, "killed").items()}
    generations = schedule(steps, killed.values())
    report(generations, steps, killed)

    # 4 -> 3 -> 4 -> 3 ...: failure k took its rank of generation 2k (whole) where, how and
    # when it was due (soak_worker.strikes); generation 2k + 1 went on without it from that
    # step (from the next, when it was lost after its backward or inside the optimizer step:
    # its vote, in the gradient all-reduce, had passed, so that step committed),
    # and its replacement, launch rank 4 + k, completed generation 2k + 2. Only a replacement
    # too late for the end leaves the rest of the plan undone.
    victims: list[int] = []
    for k, failure in enumerate(failures):
        if 2 * k == len(generations):
            break  # the last replacement was not admitted before the end
        g, whole, first = generations[2 * k]
        assert (g, len(whole)) == (2 * k, WORLD), generations
        at = strikes(failure, first, STEPS)
        if at is None:
            break  # its generation came too late
        victims.append(whole[failure.rank])
        got = {key: v for key, v in killed.get(victims[-1], {}).items() if key != "time"}
        assert got == {
            "where": failure.where, "signal": failure.signal, "step": at, "generation": g,
            "members": whole, "rank": failure.rank, "world_size": WORLD, "failure": k,
        }, (k, failure, generations)  # fmt: skip
        assert len(generations) > 2 * k + 1, (k, generations)
        lost_g, short, from_step = generations[2 * k + 1]
        assert lost_g == 2 * k + 1 and short == [r for r in whole if r != victims[-1]], k
        committed_anyway = failure.where in ("commit", "step")
        assert from_step == at + committed_anyway, (k, failure, generations)
        if 2 * k + 2 < len(generations):
            assert generations[2 * k + 2][:2] == (2 * k + 2, [*short, WORLD + k]), k
    assert len(generations) in (2 * len(victims), 2 * len(victims) + 1), generations
    assert sorted(killed) == sorted(victims)
    lost = re.findall(r"^tandem run: rank (\d+) \(.*\) was lost", err, re.M)
    assert sorted(map(int, lost)) == sorted(victims), err[-3000:]
    for k, victim in enumerate(victims):
        assert f"starting rank {WORLD + k} to replace rank {victim} " in err, err[-3000:]
    summary = [line for line in err.splitlines() if "tandem run: recovery " in line]
    assert len(summary) == len(generations) - 1, err[-3000:]

    # The last epoch, cut short by the 200th step, only at most once.
    last_epoch = max(e["epoch"] for e in steps[STEPS - 1].values())
    assert_each_sample_once(steps, SOAK_SAMPLES, epochs=last_epoch)
    chain = oracle(tmp_path, generations, SOAK)
    assert_same_samples(steps, committed(chain))
    assert_equal_runs(recovered, torch.load(chain, weights_only=True))
    # Every worker started wrote its id (but a replacement the job ended before admitting,
    # which the launcher kills, may not have got that far).
    members = {rank for _, ranks, _ in generations for rank in ranks}
    assert members <= set(records(soak, "pid")) <= set(range(WORLD + len(victims)))
    assert_nothing_left(soak, chain)


def report(generations: list[Generation], steps: Steps, killed: dict[int, dict]) -> None:
    """Print the observed schedule, and each loss's and join's time from the failure."""
    print("observed: generation, members (launch ranks), first step, seconds from the failure")
    struck = 0.0
    for g, members, first in generations:
        if g % 2:
            struck = next(r["time"] for r in killed.values() if r["failure"] == g // 2)
        # Its first commit's (a generation lost at its first step has none).
        at = [line["time"] for line in steps[first].values() if line["generation"] == g]
        took = f"{min(at) - struck:6.1f}" if g and at else "     -"
        print(f"  {g:3d} {members!s:16s} {first:4d} {took}")
