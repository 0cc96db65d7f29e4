"""A Trainer run for the SLURM requeue test: checkpoints every epoch, resumes from the latest.

    tandem run --nproc-per-node 2 tests/slurm/trainer_job.py RUN_DIR [EPOCHS [SAVE_EVERY]]

Every epoch takes about a second (each step sleeps), so a test can requeue the job between
epochs. A checkpoint is saved every SAVE_EVERY epochs (default 1; 1000: none but those that
SIGUSR1 and SIGTERM ask for, and the last). ``resume="latest"`` makes the same command start
the run and, after a requeue, resume it: the Trainer then prints ``resumed from <checkpoint>:
epoch E, ...``.
Rank 0 prints ``CHECKPOINT <path>`` at the first step after one was written (so the run went on
after it), and at the end ``FINAL epochs E steps S stopped_by B restart R`` (R:
SLURM_RESTART_COUNT, 0 on the first attempt).
"""

from __future__ import annotations

import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import tandem

EPOCHS = 6
SAMPLES = 32
BATCH = 4  # per rank: SAMPLES / (2 ranks * BATCH) = 4 steps per epoch
STEP_S = 0.25


def main() -> None:
    run_dir = sys.argv[1]
    epochs = int(sys.argv[2]) if len(sys.argv) > 2 else EPOCHS
    save_every = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    world = tandem.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(
        torch.randn(SAMPLES, 4, generator=generator), torch.randn(SAMPLES, 1, generator=generator)
    )

    seen = None

    def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        nonlocal seen
        if world.is_main and trainer.last_checkpoint not in (seen, None):
            seen = trainer.last_checkpoint
            print(f"CHECKPOINT {seen}", flush=True)
        time.sleep(STEP_S)
        return nn.functional.mse_loss(outputs, targets)

    trainer = tandem.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        data,
        loss_fn=loss_fn,
        max_epochs=epochs,
        save_every=save_every,
        batch_size=BATCH,
        run_dir=run_dir,
        resume="latest",
        progress=False,
        log_every=None,
        keep_checkpoints=100,
    )
    seen = trainer.last_checkpoint  # the one resumed from
    summary = trainer.train()
    if world.is_main:
        print(
            f"FINAL epochs {summary.epochs} steps {summary.steps} stopped_by "
            f"{summary.stopped_by} restart {os.environ.get('SLURM_RESTART_COUNT', '0')}",
            flush=True,
        )
    tandem.shutdown()


if __name__ == "__main__":
    main()
