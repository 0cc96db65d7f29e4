"""A worker of the recovery tests: a small DDP loop written with tandem.recovery.Run.

    python -m tests.recovery.recovery_worker OUT [--kill RANK:STEP:WHERE ...] [--stop-after K]
                                                 [--resume FILE] [--epochs E]
                                                 [--bucket-cap-mb MB] [--step-sleep S]
                                                 [--no-backward STEP ...]

``--kill`` (repeatable: several ranks may be lost) makes launch rank RANK lose itself at step
STEP, WHERE =

- ``forward``: SIGKILL before its backward (the others wait in the gradient all-reduce);
- ``backward``: SIGKILL inside its backward, from a hook on the first layer's weight gradient
  (computed last): with ``--bucket-cap-mb`` small, the buckets of the later layers are
  all-reduced already (launched on every rank), the first layer's are not;
- ``voted``: SIGKILL inside its backward right after its last gradient bucket's all-reduce
  completed there (``tandem.recovery.vote._after_vote``): the step's vote, which rides in that
  all-reduce, passed here, so every member had entered it;
- ``commit``: SIGKILL after its backward (its vote passed: the others commit the step, apply it
  and meet the loss at the next one);
- ``step``: SIGKILL inside ``optimizer.step`` (a step pre-hook): every member voted (``Run``
  steps the optimizer only then), so the others apply that step and meet the loss at the next
  one;
- ``hang``: SIGSTOP before its backward (alive, silent, its connections open);
- ``handover``: SIGKILL as it enters ``Recoverer.hand_over`` (an admission's hand-over of the
  run: a member about to hand it, or a replacement about to take it); STEP is the run's step
  count then, or ``*`` for the first hand-over it takes part in (a replacement's count is 0
  until it has the run).
- ``form``: SIGKILL right after it said it is here to form a re-formed generation's group
  (``tandem.job.join.meet`` returned), before its part of the formation: the others, past
  their own word, wait in the formation for its address.

``--split RANK:STEP`` (repeatable) makes launch rank RANK raise as if its vote on step STEP had
failed, right after it completed there (``tandem.recovery.vote._after_vote``): the vote then
completed on some members and not on others, as when a member dies in the middle of Gloo's ring.
It first adds 1 to every gradient it holds: the vote rides in the gradient all-reduce, whose
sum a failed ring leaves partial, so a rank that went on with its own gradients would end
elsewhere. It writes ``OUT.split-RANK`` (JSON: step) as it raises. A new generation's start
commit votes on the step it starts from again (STEP is then the last step committed), a
replacement's in its take-over, inside its ``Run`` constructor.

``--replacement-barrier`` makes a replacement call ``dist.barrier()`` before it makes its
``Run`` (a script's own collective before training, which the members are past).

``--no-backward STEP`` (repeatable) makes every rank's step STEP a forward without a backward
(under ``torch.no_grad``: no DDP backward, so the commit votes in a collective of its own).

``--pause RANK:STEP`` (repeatable) makes launch rank RANK stop before its backward at step STEP
(beating, its connections open): it writes ``OUT.paused-RANK`` (JSON: step, world size) and
waits until ``OUT.go-RANK`` exists, then goes on (the partition tests cut its network
meanwhile, so that the cut comes at a known step).

Before it goes, the victim writes ``OUT.killed-RANK`` (JSON: where, step, the world size it was
in, and for ``backward`` the buckets launched and in all). Every worker writes its process id
to ``OUT.pid-RANK`` at its start (the test checks that none is left at the end).

``--await STEP:N`` (repeatable) makes every rank wait before its backward at step STEP until it
has seen N replacements queued (the heartbeat's count): the step's vote then admits them, at a
step the test knows, whenever the replacements' processes got there.

``--late-read RANK:OTHER`` (repeatable) makes launch rank RANK, in a generation with newcomers
where OTHER is a member too, read the states of the last commit (``Recoverer.committed_states``)
only once OTHER has left its own state for that generation's start commit (``Membership.publish``
returned there: OTHER writes ``OUT.published-OTHER``, a JSON line per call: step, generation),
waiting up to 60 s: a member that reads late, as a slow newcomer under load does. It writes
``OUT.late-RANK`` (JSON: generation, step, whether OTHER's state was seen).

``--step-sleep S`` sleeps S seconds in every step (a replacement has time to start and join).
A ``--resume`` at a larger world size seeds the ranks the saved run had not as an admitted
replacement is seeded (``tandem.recovery.newcomer_seed``).

``--stop-after K`` saves the state after K committed steps to OUT and exits (the oracle's first
half; K = 0 saves before any step); ``--resume FILE`` loads it (the second half, at another
world size). Rank 0 writes the final parameters and the run's record to OUT.
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
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import tandem
import tandem.recovery
import tandem.recovery.membership
import tandem.recovery.vote
from tandem.checkpoint.rng import capture_rng_state, restore_rng_state, seed_rng
from tandem.recovery import Run, newcomer_seed

WHERES = ("forward", "backward", "voted", "commit", "step", "hang", "handover", "form")
ANY = -1  # a --kill STEP of ``*``: the first time this rank gets there


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(60, 6, generator=g)
    y = (x.sum(1) > 0).long()
    return TensorDataset(x, y)


def kill_spec(text: str) -> tuple[int, int, str]:
    rank, step, where = text.split(":")
    if where not in WHERES:
        raise argparse.ArgumentTypeError(f"WHERE is one of {', '.join(WHERES)}, not {where!r}")
    return int(rank), ANY if step == "*" else int(step), where


def pause_spec(text: str) -> tuple[int, int]:
    rank, step = text.split(":")
    return int(rank), int(step)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--kill", type=kill_spec, action="append", default=[])
    parser.add_argument("--pause", type=pause_spec, action="append", default=[])
    parser.add_argument("--split", type=pause_spec, action="append", default=[])
    parser.add_argument("--await", dest="awaits", type=pause_spec, action="append", default=[])
    parser.add_argument("--late-read", type=pause_spec, action="append", default=[])
    parser.add_argument("--stop-after", type=int, default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--bucket-cap-mb", type=float, default=None)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--no-backward", type=int, action="append", default=[])
    parser.add_argument("--replacement-barrier", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    me = int(os.environ["RANK"])
    Path(f"{args.out}.pid-{me}").write_text(str(os.getpid()))
    tandem.init()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.25), nn.Linear(16, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(100 + me)  # every rank draws its own dropout masks
    ddp_kwargs = {} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb}
    mine = {where: step for rank, step, where in args.kill if rank == me}
    made: list[Run] = []  # the run, once made (a replacement takes over in its constructor)
    hand_over = tandem.recovery.Recoverer.hand_over

    def lose(where: str, **details: int) -> None:
        """SIGKILL (SIGSTOP for ``hang``) this rank if it is to be lost here at this step."""
        step = made[0].step_count if made else 0
        if where not in mine or mine[where] not in (step, ANY):
            return
        record = {"where": where, "step": step}
        if made:
            record["world_size"] = made[0].world_size
        Path(f"{args.out}.killed-{me}").write_text(json.dumps({**record, **details}))
        os.kill(os.getpid(), signal.SIGSTOP if where == "hang" else signal.SIGKILL)

    def handing_over(self: tandem.recovery.Recoverer, *a: object, **k: object) -> object:
        lose("handover", world_size=self.world_size)
        return hand_over(self, *a, **k)

    tandem.recovery.Recoverer.hand_over = handing_over
    meet = tandem.job.join.meet

    def meeting(*a: Any, **k: Any) -> set[int]:
        gone = meet(*a, **k)
        lose("form")
        return gone

    tandem.job.join.meet = meeting
    splits = {step for rank, step in args.split if rank == me}

    def after_vote(step: int) -> None:
        """The vote on ``step`` completed here: at a --split step, spoil the gradients (as a
        failed ring leaves them) and raise as if it had not (once); a ``voted`` victim dies."""
        lose("voted")
        if step in splits:
            splits.discard(step)
            with torch.no_grad():
                for p in net.parameters():
                    if p.grad is not None:
                        p.grad.add_(1.0)
            Path(f"{args.out}.split-{me}").write_text(json.dumps({"step": step}))
            raise tandem.recovery.membership._Lost(
                f"test: rank {me}'s vote on step {step} 'failed'"
            )

    # Before the run is made: a replacement votes in its constructor (its take-over).
    tandem.recovery.vote._after_vote = after_vote
    read_late(args.out, me, args.late_read)
    if args.replacement_barrier and tandem.recovery.replacing():
        dist.barrier()  # the script's own collective before training: refused on a replacement
    run = Run(net, opt, data(), batch_size=4, epochs=args.epochs, seed=3, ddp_kwargs=ddp_kwargs)
    made.append(run)
    if args.resume:
        saved = torch.load(args.resume, weights_only=True)
        net.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        run.load_state_dict(saved["run"])
        # As a resume at another world size maps them: new rank r continues saved rank r's.
        rank = tandem.world().rank
        if rank < len(saved["rng"]):
            restore_rng_state(saved["rng"][rank])
        else:  # a rank the saved run had not: seeded as a replacement admitted there is
            seed_rng(newcomer_seed(3, run.step_count, rank))
    pauses = {step for rank, step in args.pause if rank == me}
    awaits = {step: count for step, count in args.awaits}

    def pause() -> None:
        """Wait for the test's go (it cuts this rank's network first) at a --pause step."""
        if run.step_count not in pauses:
            return
        pauses.discard(run.step_count)
        record = {"step": run.step_count, "world_size": run.world_size}
        Path(f"{args.out}.paused-{me}").write_text(json.dumps(record))
        while not Path(f"{args.out}.go-{me}").exists():
            time.sleep(0.02)

    def in_backward(grad: torch.Tensor) -> None:
        if "backward" in mine:
            reducer = run.model.reducer  # type: ignore[union-attr]
            lose("backward", launched=reducer.next_bucket, buckets=len(reducer.buckets))

    # A tensor hook fires as the gradient is computed, before tandem.DDP's hook (after it is
    # accumulated) can launch its bucket; the first layer's weight gradient comes last.
    net[0].weight.register_hook(in_backward)
    opt.register_step_pre_hook(lambda *_: lose("step"))

    def train_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        time.sleep(args.step_sleep)  # a slower step: a replacement has time to start
        x, y = batch
        if run.step_count in args.no_backward:
            with torch.no_grad():
                loss = F.cross_entropy(model(x), y)  # the dropout masks are drawn all the same
            lose("forward")
            return loss.item()
        loss = F.cross_entropy(model(x), y)
        lose("forward")
        lose("hang")  # hung: alive, silent, holding its sockets
        pause()
        if run.step_count in awaits:  # every member sees the replacements queued by its vote
            deadline = time.monotonic() + 120
            while run.recoverer._seen() < awaits[run.step_count]:
                assert time.monotonic() < deadline, f"no replacement {awaits[run.step_count]}"
                time.sleep(0.02)
        loss.backward()
        lose("commit")
        return loss.item()

    while not run.finished and run.step_count != args.stop_after:
        run.step(train_step)
    finish(run, net, opt, args.out)


def read_late(out: str, me: int, pairs: list[tuple[int, int]]) -> None:
    """``--late-read``: OTHER marks each publish of its own state; RANK waits for OTHER's of
    the start commit of its generation before it reads the last commit's states."""
    if any(other == me for _, other in pairs):
        publish = tandem.recovery.Membership.publish

        def publishing(self: tandem.recovery.Membership, step: int, *a: Any, **k: Any) -> None:
            publish(self, step, *a, **k)
            with open(f"{out}.published-{me}", "a") as marks:
                marks.write(json.dumps({"step": step, "generation": self.generation}) + "\n")

        tandem.recovery.Membership.publish = publishing
    others = [other for rank, other in pairs if rank == me]
    if not others:
        return
    committed_states = tandem.recovery.Recoverer.committed_states

    def reading(self: tandem.recovery.Recoverer) -> list[str]:
        members, last = self.members, self.last_commit
        assert members is not None and last is not None
        for other in others:
            if not members.newcomers or other not in members.members:
                continue
            mark = {"step": last[0], "generation": members.generation}
            marks = Path(f"{out}.published-{other}")
            deadline, seen = time.monotonic() + 60, False
            while not seen and time.monotonic() < deadline:
                lines = marks.read_text().splitlines() if marks.exists() else []
                seen = any(json.loads(line) == mark for line in lines if line)
                time.sleep(0.02)
            Path(f"{out}.late-{me}").write_text(json.dumps({**mark, "seen": seen}))
        return committed_states(self)

    tandem.recovery.Recoverer.committed_states = reading


def finish(run: Run, net: nn.Module, opt: torch.optim.Optimizer, out: str) -> None:
    """Rank 0 writes the run's record to ``out`` (every rank's generators, the parameters, the
    optimizer, the run's place, its recoveries); then the loop ends."""
    states: list[object] = [capture_rng_state()]
    if dist.is_initialized():  # one process resumed alone has no group
        states = [None] * dist.get_world_size()
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
        torch.save(record, out)
    run.close()
    tandem.shutdown()


if __name__ == "__main__":
    main()
