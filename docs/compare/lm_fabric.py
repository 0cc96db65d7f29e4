"""The example LM's training part, written for Lightning Fabric.

The same model, data, training step, optimizer groups, schedule and command line as
``lm_tandem.py`` (imported from :mod:`tandem.examples.lm`), and the same recipe: bf16-mixed,
the gradient clipped to norm 1 over all ranks, 2 micro-batches per step, warm-up + cosine per
step, the training set sharded and reshuffled every epoch, the held-out text evaluated exactly
after every epoch, a checkpoint every epoch and a restart that resumes (at an epoch boundary:
a mid-epoch resume would need the sampler's position saved and skipped by hand).

Run::

    torchrun --nproc-per-node 2 docs/compare/lm_fabric.py --epochs 2 --run-dir runs/cmp-fabric

(``fabric run ... lm_fabric.py`` refuses the script's ``fabric.launch()``: "processes have
already been created". A script for ``fabric run`` leaves it out; one that starts its own
processes passes ``devices=N`` and runs as ``python lm_fabric.py``. Under torchrun the
script takes ``devices`` from torchrun's ``LOCAL_WORLD_SIZE``.)
"""

import functools
import math
import os

import lightning as L
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from tandem.examples.lm import (
    adamw,
    lm_step,
    load_data,
    make_model,
    model_config,
    parse_args,
    warmup_cosine,
)


def main() -> None:
    args = parse_args(None)
    fabric = L.Fabric(precision="bf16-mixed", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    fabric.launch()
    train_set, eval_set = load_data(args.chars, args.block)
    model = make_model(model_config(args))
    optimizer = adamw(list(model.parameters()), args.lr)
    model, optimizer = fabric.setup(model, optimizer)
    # Our own samplers: Fabric sets a loader's epoch to the number of times it was iterated,
    # which starts again at 0 in a resumed run; and its evaluation sampler would pad the
    # ranks' shares with repeated sequences.
    sampler = DistributedSampler(train_set, fabric.world_size, fabric.global_rank, seed=0)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler)
    eval_ids = range(fabric.global_rank, len(eval_set), fabric.world_size)
    eval_loader = DataLoader(eval_set, 4 * args.batch_size, sampler=eval_ids)
    total = args.epochs * math.ceil(len(train_loader) / args.grad_accum)
    schedule = functools.partial(warmup_cosine, warmup=args.warmup, total=total)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)

    checkpoint = os.path.join(args.run_dir, "last.ckpt")
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "epoch": 0}
    if os.path.exists(checkpoint):
        fabric.load(checkpoint, state)

    eval_loss = float("nan")  # a finished run restarted trains no epoch
    for epoch in range(state["epoch"], args.epochs):
        model.train()
        sampler.set_epoch(epoch)
        sums = torch.zeros(2, dtype=torch.float64)
        for i, batch in enumerate(train_loader):
            batch = fabric.to_device(batch)
            stepping = (i + 1) % args.grad_accum == 0 or i + 1 == len(train_loader)
            with fabric.no_backward_sync(model, enabled=not stepping):
                out = lm_step(model, batch)
                # The step's gradient is the mean over its micro-batches.
                fabric.backward(out["loss"] / args.grad_accum)
            if stepping:
                fabric.clip_gradients(model, optimizer, max_norm=args.clip)
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
            sums += torch.tensor([out["loss"].item() * out["count"], out["count"]])
        train_loss = fabric.all_reduce(sums, reduce_op="sum")

        model.eval()
        eval_sums = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad():
            for batch in eval_loader:
                out = lm_step(model, fabric.to_device(batch))
                eval_sums += torch.tensor([out["loss"].item() * out["count"], out["count"]])
        eval_sums = fabric.all_reduce(eval_sums, reduce_op="sum")
        eval_loss = (eval_sums[0] / eval_sums[1]).item()
        fabric.print(
            f"epoch {epoch + 1:3d}  loss {(train_loss[0] / train_loss[1]).item():.4f}  "
            f"test loss {eval_loss:.4f}"
        )

        state["epoch"] = epoch + 1
        fabric.save(checkpoint, state)
    fabric.print(f"final test loss {eval_loss:.4f}")


if __name__ == "__main__":
    main()
