"""The run state and the checkpointer, in one process.

- A checkpoint holds the engine's model and optimizer at the top (``state["model"]``,
  ``state["optimizer"]``) and the run state under ``state["trainer"]``, with every rank's RNG
  states and loss sums under ``"ranks"``.
- A checkpoint of the earlier layout (RNG, sampler and history at the top level) resumes to the
  same end, bit for bit, as the same checkpoint in today's layout.
- The run state refuses, naming both values, a resume that cannot continue the run; at another
  world size it continues the epoch where the saved ranks stood (the sampler's offset and the
  loop's batch count), adds the loss sums up on rank 0, continues the saved ranks' generators
  and derives those of new ranks reproducibly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from tandem.checkpoint.rng import capture_rng_state
from tandem.checkpoint.run_dir import load_checkpoint, save_checkpoint
from tandem.data.sampler import DistributedSampler
from tandem.train.run_state import RunState
from tandem.train.trainer import Trainer


def _trainer(run_dir, resume=None, max_epochs=3) -> Trainer:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(40, 5, generator=g), torch.randint(0, 3, (40,), generator=g))
    net = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.2), nn.Linear(8, 3))
    return Trainer(
        net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), data,
        loss_fn=F.cross_entropy, max_epochs=max_epochs, save_every=1, batch_size=4,
        run_dir=run_dir, resume=resume, progress=False,
    )  # fmt: skip


def _old_layout(state: dict) -> dict:
    """The layout tandem wrote before the run state had one entry."""
    trainer = dict(state["trainer"])
    ranks = trainer.pop("ranks")
    old = {k: v for k, v in state.items() if k != "trainer"}
    old["sampler"], old["history"] = trainer.pop("sampler"), trainer.pop("history")
    old["rng"] = [r["rng"] for r in ranks]
    trainer["epoch_loss"] = [r["epoch_loss"] for r in ranks]
    old["trainer"] = trainer
    return old


def test_checkpoint_layout_and_the_earlier_one_resume_alike(tmp_path):
    whole = _trainer(tmp_path / "whole")
    whole.train()
    final = [p.detach().clone() for p in whole.module.parameters()]

    first = _trainer(tmp_path / "new", max_epochs=1)
    first.train()
    payload = load_checkpoint(tmp_path / "new")
    state = payload["state"]
    assert {"model", "optimizer", "engine", "shards", "trainer", "scheduler", "scaler"} <= set(
        state
    ), sorted(state)
    assert len(state["trainer"]["ranks"]) == 1 and "rng" in state["trainer"]["ranks"][0]
    assert state["trainer"]["epoch"] == 1 and len(state["trainer"]["history"]) == 1

    save_checkpoint(_old_layout(state), tmp_path / "old", epoch=1, step=payload["step"])
    for layout in ("new", "old"):
        resumed = _trainer(tmp_path / layout, resume="latest")
        resumed.train()
        for a, b in zip(resumed.module.parameters(), final, strict=True):
            assert torch.equal(a, b), layout
        assert _untimed(resumed.history) == _untimed(whole.history), layout


def _untimed(history: list[dict]) -> list[dict]:
    """The records without their clock readings (seconds, samples per second)."""
    return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in history]


def test_run_state_refuses_a_mid_epoch_batch_change_at_the_same_world_size():
    sampler = DistributedSampler(range(40), num_replicas=2, rank=0)
    saved = RunState(sampler, world_size=2, batch_size=4, grad_accum_steps=1)
    saved.batch = 3
    state = saved.state_dict()
    smaller = RunState(sampler, world_size=2, batch_size=2, grad_accum_steps=1)
    with pytest.raises(ValueError, match="mid-epoch with batch_size=4; this run has batch_size=2"):
        smaller.load_state_dict(state)


def test_run_state_maps_onto_another_world_size():
    saved = RunState(
        DistributedSampler(range(40), num_replicas=2, rank=0, seed=3),
        world_size=2, batch_size=4, grad_accum_steps=2,
    )  # fmt: skip
    saved.batch, saved.step = 3, 2  # 12 of each rank's 20 samples trained on
    state = saved.state_dict()
    ranks = [
        {"rng": capture_rng_state(), "epoch_loss": [1.5, 12]},
        {"rng": capture_rng_state(), "epoch_loss": [2.5, 12]},
    ]

    runs = []
    for rank in range(3):
        run = RunState(
            DistributedSampler(range(40), num_replicas=3, rank=rank, seed=3),
            world_size=3, batch_size=2, grad_accum_steps=1,
        )  # fmt: skip
        run.load_state_dict(state)  # another batch size and accumulation are fine here
        run.load_rank_state_dicts(ranks, rank)
        runs.append(run)
    for run in runs:
        # 16 samples left, 6 per rank in 3 batches of 2; 7 batches in a whole epoch of 3 ranks.
        assert (run.step, run.batch, run.dealt_from, run.offset) == (2, 4, 4, 24)
        assert run.saved_world_size == 2
        assert run.state_dict()["sampler"]["position"] == 0
    assert [run.epoch_loss for run in runs] == [[4.0, 24], [0.0, 0], [0.0, 0]]

    # Ranks 0 and 1 continue their saved generators, rank 2 derives its own, reproducibly.
    torch.manual_seed(123)
    runs[1].restore_rng()
    assert torch.equal(torch.get_rng_state(), ranks[1]["rng"]["torch"])
    draws = []
    for _ in range(2):
        again = RunState(
            DistributedSampler(range(40), num_replicas=3, rank=2, seed=3),
            world_size=3, batch_size=2, grad_accum_steps=1,
        )  # fmt: skip
        again.load_state_dict(state)
        again.load_rank_state_dicts(ranks, 2)
        again.restore_rng()
        draws.append(torch.rand(3))
    assert torch.equal(draws[0], draws[1])
    runs[0].restore_rng()
    assert not torch.equal(torch.rand(3), draws[0])
