"""A hand-written training loop for the elastic tests, run by `tandem run` on every node.

    python elastic_worker.py CKPT_DIR STEPS [--tag TAG] [--idle | --trainer]

Every rank trains one seeded linear model with ``tandem.DDP``; every few steps the ranks save
``tandem.checkpoint.save`` to ``CKPT_DIR/step-NNNNN.pt``, a new file each time (a crash while one
is written leaves the previous ones loadable). At start the loop resumes from the newest
committed one (its ``.sha256`` written), at whatever world size this attempt has, and rank 0
prints::

    RESUMED world W step S restart R round N

then ``STEP s world W`` after each step and ``DONE world W step S`` at the end. ``--idle``: on
the job's first round the ranks sleep without communicating (only the launchers' beats can
tell them that a node was lost); later rounds train as usual. ``--trainer``: the same run
through ``tandem.Trainer`` (``max_steps=STEPS``, a checkpoint every 4 steps, ``resume="latest"``
in ``CKPT_DIR``), which resumes at the new world size with the epoch's remaining samples.
``--tag`` only marks the command line, for the tests' orphan check.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

import tandem
import tandem.checkpoint

SAVE_EVERY = 4
STEP_SLEEP_S = 0.1


def newest_checkpoint(directory: Path) -> Path | None:
    """The newest committed checkpoint in ``directory`` (its sidecar written), or None."""
    committed = sorted(
        p for p in directory.glob("step-*.pt") if p.with_suffix(".pt.sha256").exists()
    )
    return committed[-1] if committed else None


def train_with_trainer(
    args: argparse.Namespace, w: tandem.World, restart: str, round_: str
) -> None:
    """The run through tandem.Trainer: it checkpoints and resumes by itself."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 4), torch.randn(256, 1))

    def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if w.rank == 0:  # the step about to be taken, whose predecessors are done (and saved)
            print(f"STEP {trainer.step + 1} world {w.world_size}", flush=True)
        time.sleep(STEP_SLEEP_S)
        return nn.functional.mse_loss(outputs, targets)

    trainer = tandem.Trainer(
        nn.Linear(4, 1),
        lambda params: torch.optim.SGD(params, lr=0.01),
        data,
        loss_fn=loss_fn,
        batch_size=4,
        max_steps=args.steps,
        save_every_steps=SAVE_EVERY,
        run_dir=args.ckpt_dir,
        resume="latest",
        progress=False,
    )
    if w.rank == 0:
        print(
            f"RESUMED world {w.world_size} step {trainer.step} restart {restart} round {round_}",
            flush=True,
        )
    summary = trainer.train()
    if w.rank == 0:
        print(f"DONE world {w.world_size} step {summary.steps}", flush=True)
    tandem.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt_dir", type=Path)
    parser.add_argument("steps", type=int)
    parser.add_argument("--tag", default="")
    parser.add_argument("--idle", action="store_true")
    parser.add_argument("--trainer", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    w = tandem.init()
    restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
    round_ = os.environ.get("TANDEM_RDZV_ROUND", "?")
    if args.idle and round_ == "0":
        print(f"IDLE world {w.world_size}", flush=True)
        time.sleep(120)
    if args.trainer:
        train_with_trainer(args, w, restart, round_)
        return
    torch.manual_seed(0)
    model = tandem.DDP(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    found = newest_checkpoint(args.ckpt_dir)
    if found is not None:
        tandem.checkpoint.load(state, found)
    if w.rank == 0:
        print(
            f"RESUMED world {w.world_size} step {state['step']} restart {restart} round {round_}",
            flush=True,
        )
    for step in range(int(state["step"]), args.steps):
        g = torch.Generator().manual_seed(step * 1000 + w.rank)
        x = torch.randn(8, 4, generator=g)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
        if (step + 1) % SAVE_EVERY == 0:
            state["step"] = step + 1
            tandem.checkpoint.save(state, args.ckpt_dir / f"step-{step + 1:05d}.pt")
        if w.rank == 0:
            print(f"STEP {step + 1} world {w.world_size}", flush=True)
        time.sleep(STEP_SLEEP_S)
    if w.rank == 0:
        print(f"DONE world {w.world_size} step {args.steps}", flush=True)
    tandem.shutdown()


if __name__ == "__main__":
    main()
