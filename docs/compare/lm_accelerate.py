"""The example LM's training part, written for HuggingFace Accelerate.

The same model, data, training step, optimizer groups, schedule and command line as
``lm_tandem.py`` (imported from :mod:`tandem.examples.lm`), and the same recipe: bf16-mixed,
the gradient clipped to norm 1 over all ranks, 2 micro-batches per step, warm-up + cosine per
step, the training set sharded and reshuffled every epoch, the held-out text evaluated exactly
after every epoch, a checkpoint every epoch and a restart that resumes (at an epoch boundary:
a mid-epoch resume would need ``skip_first_batches`` and the position saved by hand).

Run::

    torchrun --nproc-per-node 2 docs/compare/lm_accelerate.py --epochs 2 --run-dir runs/cmp-acc

(On a CPU-only machine ``accelerate launch --cpu --num_processes 2`` starts one process:
Accelerate launches several CPU processes through mpirun. torchrun starts them.)
"""

import functools
import json
import math
import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader

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
    # Without cpu=True on a machine with no GPU, each process under torchrun trains alone on
    # all the data, silently: Accelerate only starts its CPU process group when told to.
    accelerator = Accelerator(
        mixed_precision="bf16",
        gradient_accumulation_steps=args.grad_accum,
        cpu=not torch.cuda.is_available(),
    )
    train_set, eval_set = load_data(args.chars, args.block)
    model = make_model(model_config(args))
    optimizer = adamw(list(model.parameters()), args.lr)
    train_loader = DataLoader(train_set, args.batch_size, shuffle=True)
    eval_loader = DataLoader(eval_set, 4 * args.batch_size)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(
        model, optimizer, train_loader, eval_loader
    )
    # A prepared scheduler steps once per process at every optimizer step: its length counts
    # the steps of all processes.
    total = args.epochs * math.ceil(len(train_loader) / args.grad_accum)
    schedule = functools.partial(
        warmup_cosine,
        warmup=args.warmup * accelerator.num_processes,
        total=total * accelerator.num_processes,
    )
    scheduler = accelerator.prepare(torch.optim.lr_scheduler.LambdaLR(optimizer, schedule))

    # Checkpoints: Accelerate saves model, optimizer, scheduler and RNG states; the epoch is ours.
    checkpoint = os.path.join(args.run_dir, "checkpoint")
    start_epoch = 0
    if os.path.exists(os.path.join(checkpoint, "epoch.json")):
        accelerator.load_state(checkpoint)
        with open(os.path.join(checkpoint, "epoch.json")) as f:
            start_epoch = json.load(f)["epoch"]

    eval_loss = float("nan")  # a finished run restarted trains no epoch
    for epoch in range(start_epoch, args.epochs):
        model.train()
        sums = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
        for batch in train_loader:
            with accelerator.accumulate(model):
                out = lm_step(model, batch)
                accelerator.backward(out["loss"])
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.clip)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            sums += torch.tensor([out["loss"].item() * out["count"], out["count"]])
        train_loss = accelerator.reduce(sums, "sum")

        # Exact evaluation: per-sequence losses, gathered without the duplicates that even out
        # the ranks' last batches, summed over every token of the held-out text.
        model.eval()
        eval_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
        with torch.no_grad():
            for batch in eval_loader:
                ids = batch["ids"]
                logits = model(ids[:, :-1])
                losses = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
                eval_sum += accelerator.gather_for_metrics(losses.sum(1)).double().sum()
        eval_loss = eval_sum.item() / (len(eval_set) * args.block)
        accelerator.print(
            f"epoch {epoch + 1:3d}  loss {(train_loss[0] / train_loss[1]).item():.4f}  "
            f"test loss {eval_loss:.4f}"
        )

        accelerator.wait_for_everyone()
        accelerator.save_state(checkpoint)
        if accelerator.is_main_process:
            with open(os.path.join(checkpoint, "epoch.json"), "w") as f:
                json.dump({"epoch": epoch + 1}, f)
    accelerator.print(f"final test loss {eval_loss:.4f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
