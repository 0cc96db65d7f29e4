"""The Trainer with a hybrid-sharded FSDP model: it trains, evaluates, checkpoints and resumes.

4 real ranks on Gloo laid out as 2 nodes of 2 (the launcher's variables as torchrun sets them,
``tests.parallel.fsdp.models.as_nodes``), ``FullyShardedDataParallel(hybrid=True)`` over two
units that 2 does not divide, AdamW, 2 micro-batches a step (``no_sync``), 48 training samples
(2 per rank per micro-batch: 3 steps an epoch) and 10 evaluation samples. Proven:

- **Evaluation** is exact and in lock step within each shard group: after training,
  ``evaluate()`` equals one process's loss and accuracy on the whole set with the gathered
  weights (1e-6), and every evaluation ran as many forwards on each rank as the busiest rank of
  its shard group has batches: the set is dealt over all 4 ranks (3, 3, 2, 2 samples, batches
  of 2), so the first node runs 2 forwards and the second 1 (the shard group's size would
  have dealt it over 2 ranks and run 3 everywhere). Each epoch's metrics equal flat FSDP's
  Trainer over the same 4 ranks (1e-6): hybrid sums the gradients in another order, nothing
  else.
- **Resume, same layout**: a run stopped mid-epoch (``request_stop()`` after 2 steps, the
  checkpoint of step 2, ``save_every_steps=2``) and resumed in fresh processes equals the
  uninterrupted run bit for bit (history and final weights), with ``checkpoint_format``
  ``"sharded"`` and ``"full"``.
- **Resume, another node count**: the stopped runs resumed on 1 node of 2 (``hybrid=True`` is
  flat sharding there) and on 3 nodes of 1 (hybrid, a whole replica per rank): right after
  loading, the model and optimizer gathered whole equal the checkpoint's bitwise, for both
  formats; training on from the sharded checkpoint equals training on from the full one bit
  for bit (the resharding changes no number).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import tandem
from tandem.train.trainer import Trainer
from tests import models
from tests.harness import run_ranks
from tests.parallel.fsdp.models import as_nodes

pytestmark = pytest.mark.distributed

N_TRAIN, N_EVAL, BATCH = 48, 10, 2
# The stop is asked for in step 1's last micro-batch and read at step 2's end: the run stops
# there, mid-epoch (3 steps an epoch), with the checkpoint of step 2.
REQUEST_AT = 2
FORMATS = ("sharded", "full")

_trainer: Trainer | None = None
_micro_batches = 0
_stop_after: int | None = None


def _data() -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_TRAIN + N_EVAL, 4, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), TensorDataset(x[N_TRAIN:], y[N_TRAIN:])


def _loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    global _micro_batches
    _micro_batches += 1
    if _stop_after is not None and _micro_batches == _stop_after:
        assert _trainer is not None
        _trainer.request_stop()  # read at the next step's end: every rank saves and stops
    return F.cross_entropy(outputs, targets)


def _trainer_for(
    run_dir: str, hybrid: bool, fmt: str, max_epochs: int, resume: str | None
) -> tuple[Trainer, list[int]]:
    """A Trainer and the list its model's evaluation forwards are counted into (per rank)."""
    global _trainer
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))  # units of 25 and 18
    model = tandem.FullyShardedDataParallel(net, auto_wrap={nn.Linear}, hybrid=hybrid)
    one_node = os.environ["LOCAL_WORLD_SIZE"] == os.environ["WORLD_SIZE"]
    assert model.mesh.hybrid == (hybrid and not one_node)
    forwards: list[int] = []
    net.register_forward_hook(lambda m, *_: None if m.training else forwards.append(1))
    train_set, eval_set = _data()
    _trainer = Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1),
        train_set,
        loss_fn=_loss,
        eval_data=eval_set,
        max_epochs=max_epochs,
        save_every_steps=2,
        batch_size=BATCH,
        eval_batch_size=BATCH,
        grad_accum_steps=2,
        run_dir=run_dir,
        resume=resume,
        progress=False,
        checkpoint_format=fmt,
    )
    return _trainer, forwards


def _whole(trainer: Trainer) -> dict[str, Any] | None:
    """The model's and optimizer's full state on rank 0 (a collective), copied; None elsewhere."""
    model = trainer.model
    assert isinstance(model, tandem.FullyShardedDataParallel)
    weights = model.full_state_dict()
    optim = model.full_optim_state_dict(trainer.optimizer)
    if weights is None:
        return None
    return {"model": models.copied(weights), "optimizer": models.copied(optim)}


def _history(summary: Any) -> list[tuple]:
    keys = ("step", "train_loss", "eval_loss", "eval_accuracy")
    return [tuple(r[k] for k in keys) for r in summary.history]


def _first_runs(tmp: str) -> dict:
    """The uninterrupted hybrid run, flat FSDP's, and the stopped hybrid runs (4 ranks)."""
    global _stop_after, _micro_batches
    as_nodes(2)
    tandem.init()
    out: dict = {}
    trainer, forwards = _trainer_for(f"{tmp}/whole", True, "sharded", 2, None)
    summary = trainer.train()
    evaluations = len(summary.history)
    out["whole"] = {"history": _history(summary), "final": _whole(trainer)}
    out["forwards per evaluation"] = len(forwards) / evaluations
    metrics = trainer.evaluate()  # the final weights, against one process below
    final = out["whole"]["final"]
    if final is not None:
        net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
        net.load_state_dict(final["model"])
        x, y = _data()[1].tensors
        with torch.no_grad():
            scores = net(x)
        one = (F.cross_entropy(scores, y).item(), (scores.argmax(1) == y).float().mean().item())
        out["evaluate vs one process"] = ((metrics["eval_loss"], metrics["eval_accuracy"]), one)
    flat, _ = _trainer_for(f"{tmp}/flat", False, "full", 2, None)
    out["flat"] = _history(flat.train())
    for fmt in FORMATS:
        _micro_batches, _stop_after = 0, REQUEST_AT
        trainer, _ = _trainer_for(f"{tmp}/{fmt}", True, fmt, 2, None)
        summary = trainer.train()
        _stop_after = None
        out[f"stopped {fmt}"] = {
            "at": (summary.stopped_by, trainer.state.step),
            "state": _whole(trainer),
        }
    return out


def _resumed(tmp: str, per_node: int, tag: str) -> dict:
    """The stopped runs resumed (copies of their run directories, tagged), at this layout."""
    as_nodes(per_node)
    tandem.init()
    out: dict = {}
    for fmt in FORMATS:
        trainer, _ = _trainer_for(f"{tmp}/{fmt}-{tag}", True, fmt, 2, "latest")
        loaded = _whole(trainer)
        summary = trainer.train()
        out[fmt] = {
            "hybrid": trainer.model.mesh.hybrid,  # type: ignore[union-attr]
            "loaded": loaded,
            "history": _history(summary),
            "final": _whole(trainer),
        }
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("hybrid-trainer")
    first = run_ranks(_first_runs, 4, args=(str(tmp),), timeout=180)
    out = {"first": first}
    for tag, world, per_node in (("same", 4, 2), ("1x2", 2, 2), ("3x1", 3, 1)):
        for fmt in FORMATS:  # resuming writes into the run directory: each resume its copy
            shutil.copytree(tmp / fmt, tmp / f"{fmt}-{tag}")
        out[tag] = run_ranks(_resumed, world, args=(str(tmp), per_node, tag), timeout=180)
    return out


def _equal(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def test_evaluation_is_exact_and_in_lock_step_within_each_shard_group(runs):
    first = runs["first"]
    # 10 samples over 4 ranks: 3, 3, 2, 2, batches of 2; shard groups [0, 1] and [2, 3]
    assert [r["forwards per evaluation"] for r in first] == [2, 2, 1, 1]
    (loss, accuracy), (one_loss, one_accuracy) = first[0]["evaluate vs one process"]
    assert abs(loss - one_loss) <= 1e-6 and abs(accuracy - one_accuracy) <= 1e-6
    for rank, r in enumerate(first):
        hybrid, flat = r["whole"]["history"], r["flat"]
        assert len(hybrid) == len(flat) == 2, rank
        for got, want in zip(hybrid, flat, strict=True):
            assert got[0] == want[0], (rank, got, want)
            for a, b in zip(got[1:], want[1:], strict=True):
                assert abs(a - b) <= 1e-6, (rank, got, want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_stopped_hybrid_run_resumes_bitwise_at_the_same_layout(runs, fmt):
    first = runs["first"]
    assert first[0][f"stopped {fmt}"]["at"] == ("request_stop()", 2)
    for rank in range(4):
        got = runs["same"][rank][fmt]
        assert got["hybrid"], rank
        assert got["history"] == first[rank]["whole"]["history"], rank
    _equal(runs["same"][0][fmt]["final"], first[0]["whole"]["final"], f"{fmt} final")


@pytest.mark.parametrize("layout", ["1x2", "3x1"])
def test_a_stopped_hybrid_run_resumes_at_another_node_count(runs, layout):
    first = runs["first"]
    resumed = runs[layout]
    assert resumed[0]["sharded"]["hybrid"] == (layout == "3x1")
    for fmt in FORMATS:  # what was loaded is what was saved, bit for bit
        _equal(resumed[0][fmt]["loaded"], first[0][f"stopped {fmt}"]["state"], f"{fmt} loaded")
    # the two checkpoints held the same state; from there the sharded one trains as the full
    _equal(first[0]["stopped sharded"]["state"], first[0]["stopped full"]["state"], "saved")
    for rank in range(len(resumed)):
        assert resumed[rank]["sharded"]["history"] == resumed[rank]["full"]["history"], rank
    _equal(resumed[0]["sharded"]["final"], resumed[0]["full"]["final"], "final")
