"""The soak tests' worker: a Run over numbered samples that records, on every rank, the samples
of each step it committed and loses ranks on cue or at random; and the oracle of such a run,
its chain of saves and resumes, in one launch.

    python -m tests.recovery.soak_worker OUT [--kill RANK:STEP:WHERE ...] [--plan SEED]
        [--stop-after K] [--short-sleep S] [--epochs E] [--samples N] [--batch-size B]
        [--bucket-cap-mb MB]
    python -m tests.recovery.soak_worker OUT --chain SEGMENTS [the same data arguments]

Losses, each recorded first in ``OUT.killed-RANK`` (JSON: where, signal, step, generation,
its members, group rank and world size, the plan's failure, the time):

- ``--kill RANK:STEP:WHERE`` (``recovery_worker``'s spec; repeatable): launch rank RANK loses
  itself at step STEP, WHERE = ``forward`` (SIGKILL before its forward), ``backward`` (SIGKILL
  inside its backward, from a hook on the first layer's weight gradient, computed last),
  ``commit`` (SIGKILL after its backward: its vote, which rides in the gradient all-reduce,
  passed, so that step is committed everywhere), ``step`` (SIGKILL inside ``optimizer.step``:
  that step is committed everywhere too) or ``hang`` (SIGSTOP before its forward).
- ``--plan SEED`` (with ``--stop-after``): the failures :func:`plan` draws from SEED. Failure k
  strikes in generation 2k, the membership whole (:data:`WORLD` ranks: the first generation,
  or one a replacement completed), at the first of its steps from the failure's planned one
  (:func:`strikes`): the member of the failure's group rank loses itself at the failure's WHERE
  (``forward``, ``backward``, ``commit`` or ``step``) by its signal (SIGKILL, or SIGSTOP:
  hung). So the membership goes 4 -> 3 -> 4 -> 3 ... as the replacements join; a failure
  planned before the previous one's replacement joined waits for it.
- ``--short-sleep S``: sleep S seconds before each step trained short of :data:`WORLD` ranks
  (a replacement is on its way): the replacement joins within a few steps (the time it takes
  to start, whatever S, is what that stretch lasts), while the whole membership trains at full
  speed.

Every worker writes its process id to ``OUT.pid-RANK`` at its start (replacements too), and a
line per committed step to ``OUT.samples-RANK`` (JSON: epoch, step, the sample ids it trained
on, and its group rank, generation and members (launch ranks) as it committed the step, the
time), flushed at once: a rank lost later has left its committed steps behind. ``--stop-after
K`` stops after K steps (else at the end of the epochs); rank 0 then writes the run's record
to OUT (``recovery_worker.finish``).

``--chain SEGMENTS`` (JSON, ``[[size, stop], ...]``; stop null: ``--stop-after``) runs the
oracle of a run whose generations had those sizes and ended after those steps, in one launch
of ``max(size)`` processes: for segment j, processes 0 to size - 1 start as a fresh launch at
that size would (``tandem.init`` over a file store of their own; the others go on to a later
segment), resume from segment j - 1's checkpoint through ``tandem.checkpoint.load`` (a resume
at another world size; a rank the saved run had not is seeded as an admitted replacement is,
``tandem.recovery.newcomer_seed``), train to the segment's stop and save ``OUT.ckpt-j.pt``
through ``tandem.checkpoint.save``; the last writes the record to OUT. Its samples lines name
the segment as the generation.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import tandem
import tandem.checkpoint
from tandem.checkpoint.rng import seed_rng
from tandem.recovery import Run, newcomer_seed
from tests.recovery.recovery_worker import finish, kill_spec

SEED = 5  # the sampler's
WORLD = 4  # a planned failure strikes a membership of as many ranks
POINTS = ("forward", "backward", "commit", "step")  # where in its step a planned failure strikes
SIGNALS = ("SIGKILL", "SIGSTOP")
GAP = (15, 30)  # steps from one planned failure to the next
ROOM = 40  # steps after the last planned failure: time for its replacement to join
LATE = 10  # a failure still waiting for a join this close to the end does not strike


@dataclass(frozen=True)
class Failure:
    """A planned failure: the member of group rank ``rank`` loses itself by ``signal`` at
    ``where`` of step ``step``, or of a later one (:func:`strikes`)."""

    step: int
    rank: int
    where: str
    signal: str


def plan(seed: int, steps: int) -> list[Failure]:
    """The failures of a soak of ``steps`` steps at :data:`WORLD` ranks, drawn from ``seed``:
    one every 15 to 30 steps (:data:`GAP`), none in the last :data:`ROOM` steps.

    Example::

        >>> plan(27, 200)[0]
        Failure(step=30, rank=2, where='commit', signal='SIGKILL')
    """
    draw = random.Random(seed)
    failures: list[Failure] = []
    step = draw.randint(*GAP)
    while step <= steps - ROOM:
        rank, where, how = draw.randrange(WORLD), draw.choice(POINTS), draw.choice(SIGNALS)
        failures.append(Failure(step, rank, where, how))
        step += draw.randint(*GAP)
    return failures


def strikes(failure: Failure, whole_from: int, steps: int) -> int | None:
    """The step at which ``failure`` strikes, its generation whole from step ``whole_from``, in
    a run of ``steps`` steps: its planned step, or the generation's first if that came later;
    None (it does not strike) when that is in the last :data:`LATE` steps."""
    step = max(failure.step, whole_from)
    return step if step < steps - LATE else None


def data(samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(samples, 6, generator=g)
    y = (x.sum(1) > 0).long()
    return TensorDataset(x, y, torch.arange(samples))


class Saboteur:
    """Decides where in its step this process loses itself (``--kill``, ``--plan``), and does
    it, leaving its record in ``OUT.killed-RANK`` first."""

    def __init__(
        self,
        run: Run,
        out: str,
        kills: Sequence[tuple[int, int, str]],
        failures: Sequence[Failure],
        steps: int | None,
    ) -> None:
        self.run, self.out, self.failures, self.steps = run, out, failures, steps
        self.me = int(os.environ["RANK"])  # the launch rank, which kills name
        self.kills = {where: step for rank, step, where in kills if rank == self.me}
        self.starts: dict[int, int] = {}  # generation -> its first step

    @property
    def generation(self) -> int:
        return self.run.members.generation if self.run.members is not None else 0

    def attempt(self) -> None:
        """An attempt at a step starts: notes the first step of each generation."""
        self.starts.setdefault(self.generation, self.run.step_count)

    def due(self, where: str) -> tuple[str, int | None] | None:
        """The signal (and the plan's failure) by which this process loses itself at ``where``
        of this step, or None."""
        step = self.run.step_count
        if where == "forward" and self.kills.get("hang") == step:
            return "SIGSTOP", None
        if self.kills.get(where) == step:
            return "SIGKILL", None
        k, short = divmod(self.generation, 2)
        if short or k >= len(self.failures) or self.run.world_size != WORLD:
            return None
        failure = self.failures[k]
        assert self.steps is not None
        at = strikes(failure, self.starts[self.generation], self.steps)
        if (failure.rank, failure.where, at) == (self.run.rank, where, step):
            return failure.signal, k
        return None

    def lose(self, where: str, before: Callable[[], None] | None = None) -> None:
        """Lose this process here if it is due (``before()`` first: the step's own record)."""
        due = self.due(where)
        if due is None:
            return
        if before is not None:
            before()
        how, failure = due
        members = self.run.members.members if self.run.members is not None else []
        record = {
            "where": where, "signal": how, "step": self.run.step_count,
            "generation": self.generation, "members": members, "rank": self.run.rank,
            "world_size": self.run.world_size, "failure": failure, "time": time.time(),
        }  # fmt: skip
        Path(f"{self.out}.killed-{self.me}").write_text(json.dumps(record))
        os.kill(os.getpid(), getattr(signal, how))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--kill", type=kill_spec, action="append", default=[])
    parser.add_argument("--plan", type=int, default=None)
    parser.add_argument("--chain", type=json.loads, default=None)
    parser.add_argument("--stop-after", type=int, default=None)
    parser.add_argument("--short-sleep", type=float, default=0.0)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--bucket-cap-mb", type=float, default=None)
    parser.add_argument("--off-path", action="store_true", help="TANDEM_COMMIT_OFF_PATH=1")
    args = parser.parse_args()
    if args.off_path:
        os.environ["TANDEM_COMMIT_OFF_PATH"] = "1"
    if args.plan is not None and args.stop_after is None:
        parser.error("--plan needs --stop-after: the plan is drawn for that many steps")
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    me = int(os.environ["RANK"])
    Path(f"{args.out}.pid-{me}").write_text(str(os.getpid()))
    with open(f"{args.out}.samples-{me}", "a") as log:
        if args.chain is not None:
            chain(args, log, me)
            return
        tandem.init()
        failures = plan(args.plan, args.stop_after) if args.plan is not None else []
        train(args, log, args.stop_after, kills=args.kill, failures=failures)


def chain(args: argparse.Namespace, log: TextIO, me: int) -> None:
    """The oracle: each segment a fresh start at its size, resumed from the previous one's
    checkpoint (see the module doc)."""
    last = len(args.chain) - 1
    for j, (size, stop) in enumerate(args.chain):
        if me >= size:
            continue  # on to a segment it is in: this one's ranks start without it
        # As a launch at this size would start it: its own variables, its own rendezvous.
        os.environ.update(WORLD_SIZE=str(size), LOCAL_WORLD_SIZE=str(size))
        tandem.init(init_method=f"file://{args.out}.store-{j}")
        resume = f"{args.out}.ckpt-{j - 1}.pt" if j else None
        save = f"{args.out}.ckpt-{j}.pt" if j < last else None
        train(args, log, args.stop_after if stop is None else stop, resume, save, segment=j)


def train(
    args: argparse.Namespace,
    log: TextIO,
    stop: int | None,
    resume: str | None = None,
    save: str | None = None,
    *,
    segment: int | None = None,
    kills: Sequence[tuple[int, int, str]] = (),
    failures: Sequence[Failure] = (),
) -> None:
    """One run (or segment): build, resume, train to ``stop`` (losing ranks as told), then
    save to ``save`` for the next segment, or write the record to OUT."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.25), nn.Linear(16, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(100 + tandem.world().rank)  # every rank draws its own dropout masks
    ddp_kwargs = {} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb}
    run = Run(
        net, opt, data(args.samples), batch_size=args.batch_size, epochs=args.epochs,
        seed=SEED, ddp_kwargs=ddp_kwargs,
    )  # fmt: skip
    state: dict[str, Any] = {
        "model": net, "optimizer": opt, "run": run, "rng": tandem.checkpoint.RNG(),
        "world_size": run.world_size,
    }  # fmt: skip
    if resume is not None:
        tandem.checkpoint.load(state, resume)
        if run.rank >= state["world_size"]:  # the saved run's: seeded as a replacement is
            seed_rng(newcomer_seed(SEED, run.step_count, run.rank))
        state["world_size"] = run.world_size  # this segment's, for its own save
    saboteur = Saboteur(run, args.out, kills, failures, args.stop_after)
    trained: dict[str, Any] = {}  # of the step's attempt under way

    def note() -> None:
        """This rank committed the step it trained ``trained`` in."""
        log.write(json.dumps({**trained, "time": time.time()}) + "\n")
        log.flush()

    # Inside optimizer.step, so after the commit: this step is committed everywhere.
    opt.register_step_pre_hook(lambda *_: saboteur.lose("step", before=note))
    # A tensor hook fires as the gradient is computed, before tandem.DDP's hook can launch its
    # bucket; the first layer's weight gradient comes last.
    net[0].weight.register_hook(lambda grad: saboteur.lose("backward"))

    def train_step(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> float:
        saboteur.attempt()
        saboteur.lose("forward")
        x, y, ids = batch
        # As this attempt sees it (a redo replaces it; a replacement admitted after the step
        # is no member of it).
        members = run.members.members if run.members is not None else range(run.world_size)
        trained.update(
            epoch=run.epoch, step=run.step_count, ids=ids.tolist(), rank=run.rank,
            generation=saboteur.generation if segment is None else segment,
            members=list(members),
        )  # fmt: skip
        loss = F.cross_entropy(model(x), y)
        trained["loss"] = loss.item()
        loss.backward()
        # After the backward, so after its vote (in the gradient all-reduce) passed here: this
        # step is committed everywhere.
        saboteur.lose("commit", before=note)
        return trained["loss"]

    while not run.finished and run.step_count != stop:
        if args.short_sleep and run.world_size < WORLD:
            time.sleep(args.short_sleep)  # a replacement is on its way
        run.step(train_step)  # committed (and stepped) when it returns
        note()
    if save is None:
        finish(run, net, opt, args.out)
        return
    tandem.checkpoint.save(state, save)
    run.close()
    tandem.shutdown()


if __name__ == "__main__":
    main()
