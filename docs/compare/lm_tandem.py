"""The example LM's training part, written for tandem.

The model, data, training step, optimizer groups, schedule and command line are imported from
:mod:`tandem.examples.lm`, as in ``lm_accelerate.py`` and ``lm_fabric.py``: only the training
part differs. The recipe: bf16-mixed, the gradient clipped to norm 1 over all ranks, 2
micro-batches per step, warm-up + cosine per step, the training set sharded and reshuffled every
epoch, the held-out text evaluated exactly after every epoch, a checkpoint every epoch and a
restart that resumes.

Run::

    tandem run --nproc-per-node 2 docs/compare/lm_tandem.py --epochs 2 --run-dir runs/cmp-tandem
"""

import functools
import math

import torch

import tandem
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
    world = tandem.init()
    train_set, eval_set = load_data(args.chars, args.block)
    model = make_model(model_config(args))
    # The schedule's length in optimizer steps: the Trainer shards, batches and accumulates so.
    batches = math.ceil(math.ceil(len(train_set) / world.world_size) / args.batch_size)
    total = args.epochs * math.ceil(batches / args.grad_accum)
    schedule = functools.partial(warmup_cosine, warmup=args.warmup, total=total)
    trainer = tandem.Trainer(
        model,
        lambda params: adamw(params, args.lr),
        train_set,
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule),
        scheduler_interval="step",
        training_step=lm_step,
        eval_data=eval_set,
        precision="bf16-mixed",
        clip_grad_norm=args.clip,
        grad_accum_steps=args.grad_accum,
        max_epochs=args.epochs,
        save_every=1,
        batch_size=args.batch_size,
        run_dir=args.run_dir,
        resume="latest",
    )
    summary = trainer.train()
    if world.is_main:
        print(f"final test loss {summary.eval_loss:.4f}")
    tandem.shutdown()


if __name__ == "__main__":
    main()
