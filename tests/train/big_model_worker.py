"""A Trainer run of a ~100M-parameter model, for the SIGTERM checkpoint test.

``python big_model_worker.py RUN_DIR [--width W] [--layers L] [--steps-after-resume K]``

Four ``Linear(5000, 5000)`` layers by default: 100,020,000 parameters, 400 MB of float32
weights. Plain SGD keeps no optimizer state, so a rank holds weights, gradients and
tandem.DDP's buckets (~1.2 GB). Batches of one sample keep a step short; one epoch is far
longer than the test waits. The run always passes ``resume="latest"``, so the same command
starts the job and resumes it.

Prints (rank 0, flushed): ``TRAINING step 1 done`` once the first optimizer step is done;
``RESUMED step S`` when the run resumed from a checkpoint. A resumed run stops itself
(``request_stop()``: save, then stop) after ``--steps-after-resume`` more steps.

For the failure path: ``--checkpoint-at-step N`` asks for a checkpoint of step N
(``request_checkpoint()``: save and carry on), ``--fail-at-step M`` makes rank 1 raise once M
steps are done.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import TensorDataset

import tandem


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--width", type=int, default=5000)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps-after-resume", type=int, default=2)
    parser.add_argument("--checkpoint-at-step", type=int, default=None)
    parser.add_argument("--fail-at-step", type=int, default=None)
    args = parser.parse_args()

    world = tandem.init()
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(args.width, args.width) for _ in range(args.layers)))
    data = TensorDataset(torch.randn(4096, args.width), torch.randn(4096, args.width))
    calls = 0

    def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # One micro-batch per step: the second call means the first step is done.
        nonlocal calls
        calls += 1
        if calls == 2 and world.is_main:
            print("TRAINING step 1 done", flush=True)
        # A request made during step k (trainer.step + 1) is sent at its end and acted on at
        # the end of step k + 1: the step it is for.
        acted_at = trainer.step + 2
        if resumed_at is not None and acted_at >= resumed_at + args.steps_after_resume:
            trainer.request_stop()
        if acted_at == args.checkpoint_at_step and world.is_main:
            trainer.request_checkpoint()
        if trainer.step == args.fail_at_step and world.rank == 1:
            raise RuntimeError(f"rank 1 fails after step {trainer.step}")
        return nn.functional.mse_loss(outputs, targets)

    trainer = tandem.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=1e-6),
        data,
        loss_fn=loss_fn,
        max_epochs=1,
        save_every=1,
        batch_size=1,
        run_dir=args.run_dir,
        resume="latest",
        keep_checkpoints=2,
        progress=False,
    )
    resumed_at = trainer.step if trainer.last_checkpoint is not None else None
    if resumed_at is not None and world.is_main:
        print(f"RESUMED step {resumed_at}", flush=True)
    summary = trainer.train()
    if world.is_main:
        print(f"DONE stopped_by={summary.stopped_by} step={summary.steps}", flush=True)
    tandem.shutdown()


if __name__ == "__main__":
    main()
