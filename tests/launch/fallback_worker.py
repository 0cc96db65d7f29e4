"""A worker of the fall-back test: an unchanged Trainer script whose set-up cannot be recovered in
memory (tandem.ShardedOptimizer: each rank holds only its shard of the optimizer state), with a
rank that kills itself once.

    python -m tests.launch.fallback_worker RUN_DIR [--kill RANK:STEP]
        [--kill-node RANK:STEP:RESTART] [--keep N] [--resume PATH]

A Trainer over a small MLP with dropout (every rank its own masks), SGD with momentum sharded
by tandem.ShardedOptimizer, a checkpoint every 2 optimizer steps and at the end, and
``resume="latest"``: run again, it goes on from the newest checkpoint. ``--kill RANK:STEP``:
launch rank RANK SIGKILLs itself in its training step of optimizer step STEP (before the
backward), in the first attempt only (``TORCHELASTIC_RESTART_COUNT`` 0): restarted, it trains
to the end. ``--kill-node RANK:STEP:RESTART``: the same at restart RESTART, but it SIGKILLs its
launcher first (its parent, `tandem run`): its whole node is gone. ``--keep N``: the
checkpoints kept (3). ``--resume PATH``: the Trainer's ``resume`` (``latest``): a checkpoint to
start from, as a save-and-resume oracle does.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import tandem


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x.sum(1) > 0).long())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--kill", default=None)
    parser.add_argument("--kill-node", default=None)
    parser.add_argument("--keep", type=int, default=3)
    parser.add_argument("--resume", default="latest")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tandem.init()
    me = int(os.environ["RANK"])
    victim, at = (int(v) for v in args.kill.split(":")) if args.kill else (-1, -1)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    dies = me == victim and restart == "0"
    node, node_at, node_restart = (int(v) for v in (args.kill_node or "-1:-1:-1").split(":"))
    takes_node = me == node and restart == str(node_restart)

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Dropout(0.25), nn.Linear(8, 2))
    optimizer = tandem.ShardedOptimizer(net.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    torch.manual_seed(100 + me)  # every rank draws its own dropout masks

    def training_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        if dies and trainer.step == at:
            os.kill(os.getpid(), signal.SIGKILL)
        if takes_node and trainer.step == node_at:
            os.kill(os.getppid(), signal.SIGKILL)  # the launcher: this node is gone
            os.kill(os.getpid(), signal.SIGKILL)
        return F.cross_entropy(model(x), y)

    trainer = tandem.Trainer(
        net,
        optimizer,
        data(48, 7),
        batch_size=4,
        max_epochs=2,
        save_every_steps=2,
        run_dir=args.run_dir,
        seed=3,
        training_step=training_step,
        resume=args.resume,
        keep_checkpoints=args.keep,
        progress=False,
    )
    trainer.train()


if __name__ == "__main__":
    main()
