"""The Trainer's behaviour on one process and on two, against oracles computed in this process.

Proves:

- one process (no process group): the model stays a plain module; ``metrics.jsonl`` holds one
  record per epoch equal to the returned history, ``metrics.png`` is a PNG, checkpoints follow
  ``save_every`` plus the last epoch; ``request_stop()`` during step 5 saves and stops after
  step 6 (the agreement is read one step after it is sent; step 6 is no log step), and the
  resumed run ends bitwise equal to the uninterrupted one;
- two ranks: the model is wrapped in tandem.DDP; with ``lr=0`` (a fixed model) the reported
  train loss equals the mean loss over the whole training set computed here in float64 (the
  loss averaged over ranks, not rank 0's); the eval loss and accuracy on 11 samples (shards of
  6 and 5) equal one process's on the full set; every rank returns the same summary;
- bad input fails on every rank, with the values: a run directory that cannot be created
  (before training), a checkpoint of a run with another seed (both seeds named; another world
  size resumes: tests/train/test_resume_world_size.py), and bad arguments.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import tandem
from tandem.checkpoint.run_dir import list_checkpoints
from tandem.train.trainer import Trainer
from tests.harness import run_ranks


def _data(n_train: int = 50, n_eval: int = 11) -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n_train + n_eval, 8, generator=g, dtype=torch.float64)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:])


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def _trainer(run_dir, model=None, lr=0.1, cls=Trainer, **kwargs) -> Trainer:
    train_set, eval_set = _data()
    model = _model() if model is None else model
    args = {"eval_data": eval_set, "max_epochs": 3, "save_every": 2, "batch_size": 4}
    return cls(
        model,
        torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
        train_set,
        loss_fn=F.cross_entropy,
        run_dir=run_dir,
        progress=False,
        **{**args, **kwargs},
    )


class _StopsAfter(Trainer):
    """Calls request_stop() after its 5th micro-batch."""

    seen = 0

    def _run_batch(self, *args, **kwargs) -> None:
        super()._run_batch(*args, **kwargs)
        self.seen += 1
        if self.seen == 5:
            self.request_stop()


def test_one_process_plain_model_files_and_exact_stop_resume(tmp_path):
    trainer = _trainer(tmp_path / "full")
    assert trainer.model is trainer.module and not isinstance(trainer.model, tandem.DDP)
    summary = trainer.train()
    assert (summary.epochs, summary.steps, summary.stopped_by) == (3, 39, None)
    lines = (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == summary.history
    assert set(summary.history[0]) == {
        "epoch", "step", "train_loss", "eval_loss", "eval_accuracy", "samples_per_s",
        "epoch_s", "elapsed_s",
    }  # fmt: skip
    assert (tmp_path / "full" / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    names = [p.name for p in list_checkpoints(tmp_path / "full")]
    assert names == ["ckpt-e0002-s00000026.pt", "ckpt-e0003-s00000039.pt"]  # every 2, and last
    assert summary.checkpoint == list_checkpoints(tmp_path / "full")[-1]

    stopped = _trainer(tmp_path / "stopped", cls=_StopsAfter).train()
    assert (stopped.epochs, stopped.steps, stopped.stopped_by) == (0, 6, "request_stop()")
    assert stopped.checkpoint is not None and stopped.checkpoint.name == "ckpt-e0000-s00000006.pt"
    model = _model()
    resumed = _trainer(tmp_path / "stopped", model=model, resume="latest").train()
    assert resumed.history == [
        {**r, **{k: resumed.history[i][k] for k in ("samples_per_s", "epoch_s", "elapsed_s")}}
        for i, r in enumerate(summary.history)
    ]
    for a, b in zip(model.parameters(), trainer.module.parameters(), strict=True):
        assert torch.equal(a, b)


def _two_ranks(run_dir: str) -> dict:
    trainer = _trainer(run_dir, lr=0.0, max_epochs=1)
    summary = trainer.train()
    return {
        "wrapped": isinstance(trainer.model, tandem.DDP),
        "summary": (summary.train_loss, summary.eval_loss, summary.eval_accuracy),
        "params": [p.detach().clone() for p in trainer.module.parameters()],
    }


@pytest.mark.distributed
def test_two_ranks_wrap_in_ddp_and_report_what_one_process_computes(tmp_path):
    results = run_ranks(_two_ranks, 2, args=(str(tmp_path),), timeout=60)
    assert [r["wrapped"] for r in results] == [True, True]
    assert results[0]["summary"] == results[1]["summary"]
    train_loss, eval_loss, eval_accuracy = results[0]["summary"]

    train_set, eval_set = _data()
    model = _model()  # lr=0: the trained model is the initial one
    for a, b in zip(model.parameters(), results[0]["params"], strict=True):
        assert torch.equal(a, b)
    with torch.no_grad():
        want_train = F.cross_entropy(model(train_set.tensors[0]), train_set.tensors[1]).item()
        logits = model(eval_set.tensors[0])
    assert train_loss == pytest.approx(want_train, abs=1e-12)
    assert eval_loss == pytest.approx(
        F.cross_entropy(logits, eval_set.tensors[1]).item(), abs=1e-12
    )
    hits = (logits.argmax(-1) == eval_set.tensors[1]).sum().item()
    assert eval_accuracy == hits / len(eval_set)


def _error(run_dir: str, resume: str | None, seed: int = 0) -> str:
    try:
        _trainer(run_dir, resume=resume, seed=seed)
    except ValueError as e:
        return str(e)
    raise AssertionError("no ValueError")


@pytest.mark.distributed
def test_unwritable_run_dir_fails_on_every_rank_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where a directory would have to be")
    run_dir = blocker / "run"
    messages = run_ranks(_error, 2, args=(str(run_dir), None), timeout=60)
    for message in messages:
        assert f"run_dir '{run_dir}' cannot be written on rank 0" in message, message


@pytest.mark.distributed
def test_resume_of_another_run_fails_on_every_rank(tmp_path):
    _trainer(tmp_path, max_epochs=1).train()  # one process, seed 0
    messages = run_ranks(_error, 2, args=(str(tmp_path), "latest", 1), timeout=60)
    for message in messages:
        assert "sampler state has seed=0 but this sampler has seed=1" in message, message
        assert str(list_checkpoints(tmp_path)[-1]) in message, message


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"save_every": 0}, "save_every must be an int >= 1, got 0"),
        ({"batch_size": 2.5}, "batch_size must be an int >= 1, got 2.5"),
        ({"grad_accum_steps": 0}, "grad_accum_steps must be an int >= 1, got 0"),
        ({"scheduler_interval": "batch"}, "'epoch' or 'step', not 'batch'"),
        ({"eval_data": TensorDataset(torch.empty(0, 8))}, "eval_data is empty"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(".", r"\.")):
        _trainer(tmp_path, **kwargs)


def test_missing_explicit_checkpoint_is_a_checkpoint_error(tmp_path):
    from tandem.checkpoint.run_dir import CheckpointError

    with pytest.raises(CheckpointError, match=str(tmp_path / "nope.pt")):
        _trainer(tmp_path, resume=str(tmp_path / "nope.pt"))
    assert not Path(tmp_path / "metrics.jsonl").exists()


class _StopsOnOneRank(Trainer):
    """Rank 1 calls request_stop() in step 3, before its backward."""

    def _run_batch(self, *args, **kwargs) -> None:
        if self.world.rank == 1 and self.state.step == 2:  # two steps done: step 3 runs
            self.request_stop()
        super()._run_batch(*args, **kwargs)


def _requests_between_log_steps(run_dir: str, sharded: bool) -> dict:
    from tandem.doctor import records

    train_set, _ = _data()
    model = _model()
    if sharded:
        model = tandem.FullyShardedDataParallel(model, stage=3, auto_wrap={nn.Linear})
    trainer = _StopsOnOneRank(
        model,
        lambda params: torch.optim.SGD(params, lr=0.1),
        train_set,
        loss_fn=F.cross_entropy,
        run_dir=run_dir,
        progress=False,
        batch_size=4,
        log_every=5,
        max_steps=9,
    )
    before = len(records.recent())
    summary = trainer.train()
    done = records.recent()[before:]
    return {
        "riding": trainer.state.requests.riding,
        "steps": summary.steps,
        "stopped_by": summary.stopped_by,
        # the Trainer's own background agreements, one per step that is no log step
        "sent": sum(r.context == "Trainer step agreement" for r in done),
        # tandem.DDP's end-of-backward check: its count, and the 3 request counts riding on it
        "checks": [r.shapes for r in done if r.context == "DDP end-of-backward check"],
    }


@pytest.mark.distributed
@pytest.mark.parametrize("sharded", [False, True], ids=["ddp", "fsdp3"])
def test_requests_cost_no_collective_of_their_own_with_ddp(tmp_path, sharded):
    results = run_ranks(_requests_between_log_steps, 2, args=(str(tmp_path), sharded))
    # Requested on rank 1 during step 3, acted on by both after step 4 (read one step later).
    assert [(r["steps"], r["stopped_by"]) for r in results] == [(4, "request_stop()")] * 2
    for r in results:
        if sharded:  # FSDP has no per-step collective to carry them: sent at steps 1, 2, 3
            assert (r["riding"], r["sent"], r["checks"]) == (False, 3, [])
        else:
            # In DDP's end-of-backward check, which on the CPU rides in the last bucket: only
            # step 3, whose bucket rank 1 marked, sums the counts (1 + 3 of them); nothing else
            # is sent.
            assert (r["riding"], r["sent"], r["checks"]) == (True, 0, [((4,),)])
