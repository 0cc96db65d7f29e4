"""A worker of the recovery tests: a small DDP loop written with tandem.recovery.Run.

    python -m tests.recovery.recovery_worker OUT [--kill RANK:STEP:WHERE] [--stop-after K]
                                                 [--resume FILE] [--epochs E]

``--kill`` makes launch rank RANK lose itself at step STEP, WHERE = ``forward`` (SIGKILL before
its backward: the others wait in the all-reduce), ``commit`` (SIGKILL after it: the others'
all-reduce is done) or ``hang`` (SIGSTOP before its backward: alive, silent, its connections
open). ``--stop-after K`` saves the state after K committed steps to OUT and exits (the
oracle's first half); ``--resume FILE`` loads it (the second half, at another world size).
Rank 0 writes the final parameters and the run's record to OUT.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import tandem
from tandem.checkpoint.rng import capture_rng_state, restore_rng_state
from tandem.recovery import Run


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(60, 6, generator=g)
    y = (x.sum(1) > 0).long()
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--kill", default=None)
    parser.add_argument("--stop-after", type=int, default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    tandem.init()
    me = int(os.environ["RANK"])
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.25), nn.Linear(16, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(100 + me)  # every rank draws its own dropout masks
    run = Run(net, opt, data(), batch_size=4, epochs=args.epochs, seed=3)
    if args.resume:
        saved = torch.load(args.resume, weights_only=True)
        net.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        run.load_state_dict(saved["run"])
        # As a resume at another world size maps them: new rank r continues saved rank r's.
        restore_rng_state(saved["rng"][tandem.world().rank])
    victim, at, where = args.kill.split(":") if args.kill else (None, None, None)

    def train_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        if args.kill and me == int(victim) and run.step_count == int(at) and where == "forward":
            os.kill(os.getpid(), signal.SIGKILL)
        if args.kill and me == int(victim) and run.step_count == int(at) and where == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)  # hung: alive, silent, holding its sockets
        loss.backward()
        if args.kill and me == int(victim) and run.step_count == int(at) and where == "commit":
            os.kill(os.getpid(), signal.SIGKILL)
        return loss.item()

    while not run.finished:
        run.step(train_step)
        if args.stop_after is not None and run.step_count == args.stop_after:
            break
    states = [None] * tandem.world().world_size
    dist.all_gather_object(states, capture_rng_state())
    if tandem.world().rank == 0:
        record = {
            "rng": states,
            "model": {k: v.clone() for k, v in net.state_dict().items()},
            "optimizer": opt.state_dict(),
            "run": run.state_dict(),
            "steps": run.step_count,
            "world_size": run.world_size,
            "recoveries": [r.record() for r in run.recoveries],
        }
        torch.save(record, args.out)
    run.close()
    tandem.shutdown()


if __name__ == "__main__":
    main()
