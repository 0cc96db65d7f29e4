"""The character-level LM example trains under ``tandem run`` on two processes in bf16-mixed.

Proves: ``tandem run --nproc-per-node 2 -m tandem.examples.lm`` with tiny settings exits 0;
the header reports one group of two processes and the precision the Trainer resolved
(``bf16-mixed``); ``metrics.jsonl`` holds one record per epoch, numbered 1..E; the training
loss averaged over all ranks' tokens falls, the last epoch's below 0.8 of the first's (3.49 ->
2.66 here: the run is deterministic), and the final test loss (printed once, by rank 0, and equal
to the last record's exact evaluation loss) ends at least 0.5 below the untrained model's, which
is log(96) within 0.05, a uniform guess over the vocabulary (checked in-process, so the drop
measures learning); a checkpoint is written. The corpus is built offline and deterministically
(the same text twice, every character in the vocabulary), and the scheduler's factor warms up
then decays to its floor as documented.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import subprocess

import pytest
import torch

from tandem.checkpoint.run_dir import list_checkpoints
from tandem.examples.lm import (
    VOCAB,
    LMConfig,
    lm_step,
    load_corpus,
    load_data,
    make_model,
    warmup_cosine,
)
from tests.launching import clean_env, tandem_run_module

EPOCHS = 6
TINY = {"chars": 30_000, "block": 32, "dim": 64, "layers": 2, "heads": 4}
ARGS = [
    "--epochs", str(EPOCHS), "--batch-size", "8", "--warmup", "5", "--save-every", "10",
    "--sample", "40", "--eval-every", "20", "--tensorboard",
    *(x for k, v in TINY.items() for x in (f"--{k}", str(v))),
]  # fmt: skip

_HEADER = re.compile(
    r"^lm: \d+ training sequences .* on (\d+) process\(es\).* precision (\S+)$", re.M
)
_FINAL = re.compile(r"^final test loss ([0-9.]+) \(([0-9.]+) bits per character\)$", re.M)


def _untrained_eval_loss() -> float:
    _, eval_set = load_data(TINY["chars"], TINY["block"])
    config = LMConfig(**{k: v for k, v in TINY.items() if k != "chars"})
    model = make_model(config).eval()
    batch = {"ids": torch.stack([eval_set[i]["ids"] for i in range(len(eval_set))])}
    with torch.no_grad():
        return float(lm_step(model, batch)["loss"])


def test_corpus_is_deterministic_and_in_the_vocabulary():
    text = load_corpus(TINY["chars"])
    assert text == load_corpus(TINY["chars"])
    assert len(text) == TINY["chars"] and set(text) <= set(VOCAB)


def test_schedule_warms_up_then_decays_to_the_floor():
    factors = [warmup_cosine(s, warmup=10, total=100, floor=0.1) for s in range(120)]
    assert factors[:10] == [(s + 1) / 10 for s in range(10)]
    assert all(a >= b for a, b in itertools.pairwise(factors[10:]))
    assert factors[100:] == [0.1] * 20


def test_untrained_model_guesses_uniformly():
    assert abs(_untrained_eval_loss() - math.log(len(VOCAB))) < 0.05


@pytest.mark.launch
def test_two_processes_under_tandem_run_bf16_loss_falls(tmp_path):
    command = tandem_run_module("tandem.examples.lm", *ARGS, "--run-dir", str(tmp_path))
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=120, env=clean_env(), check=False
    )
    shown = f"command: {command}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert done.returncode == 0, f"exit code {done.returncode}\n{shown}"
    assert _HEADER.findall(done.stdout) == [("2", "bf16-mixed")], shown
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == list(range(1, EPOCHS + 1)), shown
    losses = [r["train_loss"] for r in records]
    assert losses[-1] < 0.8 * losses[0], f"{losses}\n{shown}"
    final = _FINAL.findall(done.stdout)
    assert len(final) == 1, shown
    final_loss = float(final[0][0])
    assert final_loss < _untrained_eval_loss() - 0.5, shown
    assert math.isclose(float(final[0][1]), final_loss / math.log(2), abs_tol=2e-3), shown
    assert math.isclose(records[-1]["eval_loss"], final_loss, abs_tol=1e-4)
    assert list_checkpoints(tmp_path), f"no checkpoints in {tmp_path}"
    assert list(tmp_path.glob("**/events.out.tfevents.*")), f"no TensorBoard events in {tmp_path}"
    steps = [json.loads(x) for x in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert any("eval_loss" in r and r["step"] % 20 == 0 for r in steps), steps
