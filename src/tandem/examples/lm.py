"""A character-level transformer language model, trained with the tandem Trainer.

The corpus is generated offline and deterministically: the docstrings of a fixed list of Python
standard library modules, read from their source files with :mod:`ast` (nothing is imported or
downloaded, and ``python -OO`` does not empty it), in a fixed order. It is the same text on
every rank and in every run on one Python version (631,149 characters on Python 3.11). The last
tenth is held out for evaluation; both parts are cut into sequences of ``--block + 1``
characters.

The model is ours, a small GPT: token and position embeddings, ``--layers`` pre-LayerNorm
blocks of causal self-attention (``torch.nn.functional.scaled_dot_product_attention``) and an
MLP, a final LayerNorm, and an output head tied to the token embedding. The Trainer runs it as
a real run would: ``bf16-mixed`` precision, the gradient clipped to norm 1 over all ranks,
AdamW built by a factory (weight decay on matrices only), a linear warm-up then cosine schedule
stepped every optimizer step, 2 micro-batches accumulated per step, dict batches
``{"ids": ...}`` through a ``training_step`` that weighs each batch by its tokens, and an exact
evaluation of the held-out text after every epoch.

Run::

    python -m tandem.examples.lm                                     # one process
    tandem run --nproc-per-node 2 -m tandem.examples.lm              # two processes
    tandem run --nproc-per-node 2 -m tandem.examples.lm --epochs 8 --dim 192 --layers 6
    tandem run --nproc-per-node 2 -m tandem.examples.lm --resume latest   # continue a run

Each epoch rank 0 prints the training loss (nats per character, averaged over all ranks'
tokens) and the test loss; then a sample of text from the trained model, and last
``final test loss L (B bits per character)``. Checkpoints (every ``--save-every`` epochs, and
on SIGTERM or SIGUSR1), ``metrics.jsonl`` and ``metrics.png`` go to ``--run-dir``.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import tandem
from tandem.examples.lm_data import (  # noqa: F401  (the example's public names)
    MODULES,
    VOCAB,
    CharChunks,
    decode,
    encode,
    load_corpus,
    load_data,
    module_docstrings,
)
from tandem.train.trainer import Trainer


@dataclass(frozen=True)
class LMConfig:
    """The model's shape. ``block`` is the longest context it reads."""

    vocab: int = len(VOCAB)
    block: int = 64
    dim: int = 128
    layers: int = 4
    heads: int = 4


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which each position sees only itself and earlier ones."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        if config.dim % config.heads:
            raise ValueError(f"dim {config.dim} is not divisible by heads {config.heads}")
        self.heads = config.heads
        self.qkv = nn.Linear(config.dim, 3 * config.dim)
        self.proj = nn.Linear(config.dim, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        # (b, t, 3d) -> three (b, heads, t, d / heads): the layout the attention kernel takes.
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.dim)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.dim)
        self.mlp = nn.Sequential(
            nn.Linear(config.dim, 4 * config.dim),
            nn.GELU(),
            nn.Linear(4 * config.dim, config.dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharLM(nn.Module):
    """A small GPT over characters: ids ``(batch, time)`` in, next-character logits out.

    Example::

        >>> model = CharLM(LMConfig(block=16, dim=32, layers=1, heads=2))
        >>> model(torch.zeros(3, 16, dtype=torch.long)).shape
        torch.Size([3, 16, 96])
    """

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.config = config
        self.tokens = nn.Embedding(config.vocab, config.dim)
        self.positions = nn.Embedding(config.block, config.dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.ln = nn.LayerNorm(config.dim)
        # GPT-2's initialisation: small weights keep the first losses near log(vocab).
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > self.config.block:
            raise ValueError(f"sequence of {t} ids is longer than the block {self.config.block}")
        x = self.tokens(ids) + self.positions(torch.arange(t, device=ids.device))
        for block in self.blocks:
            x = block(x)
        # The head is the token embedding itself (tied): one matrix, which learns from both ends.
        return F.linear(self.ln(x), self.tokens.weight)


def lm_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | int]:
    """Next-character loss of a batch, its mean over tokens, weighted by its token count.

    Used for training and evaluation: the Trainer averages ``loss`` over batches weighted by
    ``count``, so the epoch's and the evaluation's losses are exact means over tokens.

    Example::

        >>> model = CharLM(LMConfig(block=8, dim=16, layers=1, heads=2))
        >>> out = lm_step(model, {"ids": torch.zeros(2, 9, dtype=torch.long)})
        >>> out["count"]
        16
    """
    ids = batch["ids"]
    logits = model(ids[:, :-1])
    targets = ids[:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return {"loss": loss, "count": targets.numel()}


def warmup_cosine(step: int, *, warmup: int, total: int, floor: float = 0.1) -> float:
    """The learning rate's factor at optimizer step ``step``: linear warm-up, then cosine.

    Rises from ``1 / warmup`` to 1 over the first ``warmup`` steps, then falls along a half
    cosine to ``floor`` at step ``total`` (and stays there).

    Example::

        >>> [round(warmup_cosine(s, warmup=2, total=6), 3) for s in range(7)]
        [0.5, 1.0, 1.0, 0.868, 0.55, 0.232, 0.1]
    """
    if step < warmup:
        return (step + 1) / warmup
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def steps_per_epoch(samples: int, world_size: int, batch_size: int, grad_accum: int) -> int:
    """Optimizer steps in one epoch of the Trainer (the scheduler's clock).

    Each rank gets ``ceil(samples / world_size)`` samples (the sampler pads), in batches of
    ``batch_size``; an epoch's last step takes the micro-batches left.

    Example::

        >>> steps_per_epoch(1000, world_size=2, batch_size=16, grad_accum=2)
        16
    """
    batches = math.ceil(math.ceil(samples / world_size) / batch_size)
    return math.ceil(batches / grad_accum)


def model_config(args: argparse.Namespace) -> LMConfig:
    """The model's shape from the command line (:func:`parse_args`)."""
    return LMConfig(block=args.block, dim=args.dim, layers=args.layers, heads=args.heads)


def make_model(config: LMConfig) -> CharLM:
    """The model with this example's initial weights (the same in every run and on every rank)."""
    torch.manual_seed(0)
    return CharLM(config)


def adamw(params: list[nn.Parameter], lr: float) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices only (biases, LayerNorm: none), as GPTs train."""
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def build(args: argparse.Namespace) -> tuple[Trainer, CharChunks]:
    """The Trainer for these arguments, and the training set it shards."""
    train_set, eval_set = load_data(args.chars, args.block)
    model = make_model(model_config(args))
    per_epoch = steps_per_epoch(
        len(train_set), tandem.world().world_size, args.batch_size, args.grad_accum
    )
    total = (
        args.epochs * per_epoch
        if args.max_steps is None
        else min(args.max_steps, args.epochs * per_epoch)
    )  # the schedule's length: the run's optimizer steps (trainer.total_steps)
    schedule = functools.partial(warmup_cosine, warmup=args.warmup, total=total)
    trainer = Trainer(
        model,
        # Factories: the Trainer builds them over the parameters as it runs the model (an
        # FSDP model's shards), and the scheduler over the optimizer it built.
        lambda params: adamw(params, args.lr),
        train_set,
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule),
        scheduler_interval="step",
        training_step=lm_step,  # evaluation uses it too (no eval_step, no loss_fn)
        eval_data=eval_set,
        precision=args.precision,
        clip_grad_norm=args.clip,
        grad_accum_steps=args.grad_accum,
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        eval_every=args.eval_every,
        loggers=["csv", "jsonl", *(["tensorboard"] if args.tensorboard else [])],
        save_every=args.save_every,
        batch_size=args.batch_size,
        eval_batch_size=4 * args.batch_size,  # no gradients kept: larger batches fit
        run_dir=args.run_dir,
        resume=args.resume,
    )
    return trainer, train_set


@torch.no_grad()
def sample(model: CharLM, prompt: str, chars: int, seed: int = 0) -> str:
    """``prompt`` continued by ``chars`` characters drawn from the model (seeded)."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    ids = encode(prompt).unsqueeze(0)
    for _ in range(chars):
        logits = model(ids[:, -model.config.block :])[0, -1].float()
        next_id = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=g)
        ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    model.train()
    return decode(ids[0])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The examples' command line (as :func:`tandem.examples.common.parse_args`), plus the LM's."""
    parser = argparse.ArgumentParser(description="Train the character-level LM with tandem.")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16, help="per process and micro-batch")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--run-dir", default="runs/lm", help="checkpoints and metrics")
    parser.add_argument("--save-every", type=int, default=1, help="checkpoint every N epochs")
    parser.add_argument(
        "--resume", default=None, help="'latest' (of --run-dir) or a checkpoint path"
    )
    parser.add_argument("--max-steps", type=int, default=None, help="stop after N optimizer steps")
    parser.add_argument("--eval-every", type=int, default=None, help="evaluate every N steps")
    parser.add_argument(
        "--tensorboard", action="store_true", help="also log to RUN_DIR/tensorboard"
    )
    lm = parser.add_argument_group("language model")
    lm.add_argument("--chars", type=int, default=None, help="corpus size (default: all of it)")
    lm.add_argument("--block", type=int, default=64, help="context length in characters")
    lm.add_argument("--dim", type=int, default=128)
    lm.add_argument("--layers", type=int, default=4)
    lm.add_argument("--heads", type=int, default=4)
    lm.add_argument("--grad-accum", type=int, default=2, help="micro-batches per step")
    lm.add_argument("--warmup", type=int, default=50, help="warm-up optimizer steps")
    lm.add_argument("--clip", type=float, default=1.0, help="global gradient norm")
    lm.add_argument(
        "--precision",
        default="bf16-mixed",
        choices=["32-true", "bf16-mixed", "fp16-mixed", "bf16-true"],
    )
    lm.add_argument("--sample", type=int, default=200, help="characters to draw at the end")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> float | None:
    """Train, print one line per epoch and a sample on rank 0; return the final test loss."""
    args = parse_args(argv)
    # Several processes on a few cores: one intra-op thread each, or they fight over the cores.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    w = tandem.init()
    try:
        trainer, train_set = build(args)
        if w.is_main:
            print(
                f"lm: {len(train_set)} training sequences of {args.block} characters on "
                f"{w.world_size} process(es), {len(trainer.sampler)} per process, batch size "
                f"{args.batch_size} per process x {args.grad_accum} accumulated, "
                f"{sum(p.numel() for p in trainer.module.parameters())} parameters, "
                f"precision {trainer.precision}",
                flush=True,
            )
        summary = trainer.train()
        if w.is_main and summary.stopped_by is None and summary.eval_loss is not None:
            if args.sample > 0:
                module = trainer.module
                assert isinstance(module, CharLM)
                print(f"sample: {sample(module, 'The ', args.sample)!r}", flush=True)
            bits = summary.eval_loss / math.log(2)
            print(
                f"final test loss {summary.eval_loss:.4f} ({bits:.3f} bits per character)",
                flush=True,
            )
        return summary.eval_loss
    finally:
        tandem.shutdown()


if __name__ == "__main__":
    main()
