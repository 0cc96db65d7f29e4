"""The soak test's worker: a Run over 96 numbered samples that records, on every rank, the
samples of each step it committed, and loses ranks on cue.

    python -m tests.recovery.soak_worker OUT [--kill RANK:STEP:WHERE ...] [--stop-after K]
                                             [--resume FILE] [--epochs E]

As ``recovery_worker`` (the same WHEREs, ``OUT.pid-RANK``, ``OUT.killed-RANK``, the oracle's
``--stop-after`` / ``--resume`` halves and the record rank 0 writes to OUT), and every rank
appends a line per committed step to ``OUT.samples-RANK`` (JSON: epoch, step, the sample ids
it trained on), flushed at once: a rank lost later has left its committed steps behind.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import tandem
from tandem.checkpoint.rng import restore_rng_state
from tandem.recovery import Run
from tests.recovery.recovery_worker import finish, kill_spec

SAMPLES = 96  # a multiple of 4, 3, 2 and 1 ranks x 4 per rank... see the test's schedule


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(SAMPLES, 6, generator=g)
    y = (x.sum(1) > 0).long()
    return TensorDataset(x, y, torch.arange(SAMPLES))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--kill", type=kill_spec, action="append", default=[])
    parser.add_argument("--stop-after", type=int, default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    me = int(os.environ["RANK"])
    Path(f"{args.out}.pid-{me}").write_text(str(os.getpid()))
    tandem.init()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.25), nn.Linear(16, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(100 + me)
    run = Run(net, opt, data(), batch_size=4, epochs=args.epochs, seed=5)
    if args.resume:
        saved = torch.load(args.resume, weights_only=True)
        net.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        run.load_state_dict(saved["run"])
        restore_rng_state(saved["rng"][tandem.world().rank])
    mine = {where: step for rank, step, where in args.kill if rank == me}

    trained: list[int] = []
    log = open(f"{args.out}.samples-{me}", "a")  # noqa: SIM115 (written to until the end)

    def note(epoch: int, step: int) -> None:
        log.write(json.dumps({"epoch": epoch, "step": step, "ids": trained}) + "\n")
        log.flush()

    def lose(where: str) -> None:
        if mine.get(where) != run.step_count:
            return
        if where == "step":  # inside the optimizer step: this step is committed everywhere
            note(run.epoch, run.step_count)
        record = {"where": where, "step": run.step_count, "world_size": run.world_size}
        Path(f"{args.out}.killed-{me}").write_text(json.dumps(record))
        os.kill(os.getpid(), signal.SIGSTOP if where == "hang" else signal.SIGKILL)

    opt.register_step_pre_hook(lambda *_: lose("step"))

    def train_step(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> float:
        x, y, ids = batch
        trained[:] = ids.tolist()  # a redo replaces what the failed attempt took
        loss = F.cross_entropy(model(x), y)
        lose("forward")
        lose("hang")
        loss.backward()
        lose("commit")
        return loss.item()

    while not run.finished and run.step_count != args.stop_after:
        epoch = run.epoch
        run.step(train_step)  # committed (and stepped) when it returns
        note(epoch, run.step_count - 1)
    log.close()
    finish(run, net, opt, args.out)


if __name__ == "__main__":
    main()
