"""A worker of the Trainer's recovery tests: an unchanged Trainer script, with a fault injected.

    python -m tests.recovery.trainer_worker RUN_DIR [--kill RANK:STEP:WHERE ...]
                                                    [--max-steps K] [--resume] [--epochs E]
                                                    [--step-sleep S] [--pids DIR]
                                                    [--newcomer-seed-mutant]

The script is what a user writes (a Trainer over an MLP with dropout, SGD with momentum, an
evaluation set, a step log, checkpoints every 3 steps and at the end); nothing in it knows of
recovery. ``--kill`` makes launch rank RANK die at optimizer step STEP (while ``trainer.step ==
STEP``), WHERE = ``forward`` (SIGKILL in its training step, before the backward), ``step``
(SIGKILL inside the optimizer step: after the step committed), ``save`` (SIGKILL while rank 0
writes the checkpoint of step STEP), ``hang`` (SIGSTOP before the backward) or ``redo`` (SIGKILL
in its training step once the world has shrunk: in the redo after another rank's loss, a second
loss before that redo commits) or ``handover`` (SIGKILL as it enters the hand-over of the run to
a replacement, at any step: STEP is ``*``); ``--kill`` may be repeated. ``--split RANK:STEP``
makes launch rank RANK raise as if its commit's vote of optimizer step STEP had failed, right
after it completed there (``tandem.recovery.vote._after_vote``, inside the backward: the vote
rides in the gradient all-reduce), its gradients spoilt as a broken ring leaves them: a vote
split between the survivors; the rank writes ``RUN_DIR/split-<RANK>.json`` (the step) as it
raises.
``--max-steps K`` trains K steps and stops (the oracle's first half: it saves at the end);
``--resume`` continues from the latest checkpoint (the second half, at another world size).
``--epochs E``: the run's ``max_epochs`` (default 2).

For the replacement test: ``--step-sleep S`` sleeps S seconds in every training step while the
world is smaller than the job started (a replacement has time to start and be admitted);
``--pids DIR`` makes every worker write its process id to ``DIR/<launch rank>`` as it starts
(a replacement too, before it waits to be admitted); ``--newcomer-seed-mutant`` seeds the
generators of a rank that a resume at a larger world size adds (the one an admitted replacement
takes the place of) otherwise: a mutant the test's comparison must catch.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import tandem
import tandem.recovery
import tandem.recovery.membership
import tandem.recovery.vote
from tandem.checkpoint import checkpointer
from tandem.train import run_state


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = (x.sum(1) > 0).long()
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--kill", action="append", default=[])
    parser.add_argument("--split", action="append", default=[])
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--pids", default=None)
    parser.add_argument("--newcomer-seed-mutant", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    me = int(os.environ["RANK"])
    if args.pids:
        Path(args.pids, str(me)).write_text(str(os.getpid()))
    if args.newcomer_seed_mutant:
        seed = run_state.derived_seed
        run_state.derived_seed = lambda *parts: seed(*parts) + 1  # type: ignore[assignment]
    tandem.init()
    mine = [kill.split(":")[1:] for kill in args.kill if int(kill.split(":")[0]) == me]
    splits = {int(s.split(":")[1]) for s in args.split if int(s.split(":")[0]) == me}

    def split(vote: int) -> None:  # the vote on optimizer step STEP commits step number STEP + 1
        if vote - 1 in splits:
            splits.discard(vote - 1)
            # The vote rides in the gradient all-reduce, whose sum a broken ring leaves partial:
            # spoilt gradients here, so that stepping with them would end elsewhere.
            with torch.no_grad():
                for p in net.parameters():
                    if p.grad is not None:
                        p.grad.add_(1.0)
            # Said where the test looks: a hook that stopped firing would leave a plain kill,
            # whose run ends the same, and the split would go untested.
            Path(args.run_dir, f"split-{me}.json").write_text(json.dumps({"step": vote - 1}))
            raise tandem.recovery.membership._Lost(f"test: rank {me}'s vote {vote} 'failed'")

    tandem.recovery.vote._after_vote = split
    at, where = mine[0] if mine else ("-1", "")
    at = "-1" if at == "*" else at  # handover's: whichever step it comes at
    dies = bool(mine)
    size = int(os.environ["WORLD_SIZE"])
    # A replacement's WORLD_SIZE is not the job's: it joins a full world and never sleeps.
    started = 0 if os.environ.get("TANDEM_RECOVER_JOIN") else size

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.25), nn.Linear(16, 2))
    torch.manual_seed(100 + me)  # every rank draws its own dropout masks

    def training_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if tandem.world().world_size < started:
            time.sleep(args.step_sleep)
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        if dies and trainer.step == int(at) and where == "forward":
            os.kill(os.getpid(), signal.SIGKILL)
        if dies and trainer.step == int(at) and where == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        if (
            dies
            and trainer.step == int(at)
            and where == "redo"
            and tandem.world().world_size < size
        ):
            os.kill(os.getpid(), signal.SIGKILL)
        return loss

    trainer = tandem.Trainer(
        net,
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        data(96, 7),
        eval_data=data(20, 8),
        batch_size=4,
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        eval_every=4,
        log_every=2,
        save_every_steps=3,
        loggers=["jsonl"],
        run_dir=args.run_dir,
        seed=3,
        training_step=training_step,
        resume="latest" if args.resume else None,
        progress=False,
    )
    if dies and where == "handover":
        hand_over = tandem.recovery.Recoverer.hand_over

        def handing_over(self: tandem.recovery.Recoverer, *a: Any, **k: Any) -> Any:
            os.kill(os.getpid(), signal.SIGKILL)
            return hand_over(self, *a, **k)

        tandem.recovery.Recoverer.hand_over = handing_over  # type: ignore[method-assign]
    if dies and where == "step":

        def die(optimizer: torch.optim.Optimizer, *_: object) -> None:
            if trainer.step == int(at):
                os.kill(os.getpid(), signal.SIGKILL)

        trainer.optimizer.register_step_pre_hook(die)
    if dies and where == "save":
        write = checkpointer.save_checkpoint

        def dying_write(state, run_dir, *, epoch, step, keep):  # type: ignore[no-untyped-def]
            if step == int(at):
                os.kill(os.getpid(), signal.SIGKILL)
            return write(state, run_dir, epoch=epoch, step=step, keep=keep)

        checkpointer.save_checkpoint = dying_write  # type: ignore[assignment]
    trainer.train()


if __name__ == "__main__":
    main()
