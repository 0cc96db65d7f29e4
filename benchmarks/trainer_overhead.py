"""tandem.Trainer against a hand-written loop over the same engine: the Trainer's cost per step.

Both sides train the example LM (:mod:`tandem.examples.lm`: same model, same initial weights,
same corpus) on WORLD ranks with Gloo on the CPU, one intra-op thread per rank, with the same
recipe: bf16-mixed autocast, ``--accum`` micro-batches per optimizer step, the gradient clipped
to norm 1 over all ranks, AdamW over the example's parameter groups, warm-up + cosine stepped
every step. The loop is what a user writes over the Trainer's own engine
(``tandem.parallel.engine.make_engine``, so tandem.DDP on both sides) with the same
``tandem.data.DistributedSampler`` and DataLoader batch size; the two see the same batches in
the same order. Like the Trainer with its default ``log_every=10``, the loop logs the loss
averaged over all ranks every 10 steps (one all-reduce, rank 0 writes a line;
``--loop-log-every 0``: a loop that logs nothing).

One round is one epoch of ``--steps`` optimizer steps: for the Trainer a
``train(max_epochs=k)`` call, for the loop one pass over its loader. Both call the training
step through the same clock (:class:`StepClock`), which marks the wall time and the process's
CPU time as each optimizer step begins: from a round's first mark to its last lie ``steps - 1``
whole steps, with everything each side does per step (for the Trainer: moving and checking the
batch, the loss's ``item()``, the request agreement, the step log and the progress bar), and
nothing it does per call (the Trainer's evaluation, checkpoint and plot at an epoch's end, which
a real run pays once per epoch and this one at every call). A round counts the slowest rank's
wall time and the ranks' mean CPU time. Rounds alternate, A B then B A, so drift in the
machine's load hits both alike, after ``--warmup`` uncounted rounds of each. Reported, for wall
and CPU time: the median time per optimizer step of each side, and the median of the per-pair
ratios Trainer / loop (the issue's target: wall <= 1.03). The CPU figures are the steadier
ones on a machine shared with other jobs: another process's burst lengthens a round's wall
time, not this process's CPU time. At the end the two models' parameters are compared: the
same work gives the same bits.

Run::

    python benchmarks/trainer_overhead.py                 # 21 pairs x 20 steps
    python benchmarks/trainer_overhead.py --profile   # and cProfile rank 0's steps, both sides
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import io
import json
import os
import platform
import pstats
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader

import tandem
from ddp_throughput import RESULTS  # every benchmark's JSON in one folder
from tandem.data import DistributedSampler
from tandem.examples.lm import (
    CharChunks,
    LMConfig,
    adamw,
    encode,
    lm_step,
    load_corpus,
    make_model,
    warmup_cosine,
)
from tandem.parallel.engine import Engine, make_engine
from tandem.train.trainer import Trainer

SIDES = ("trainer", "loop")
CLIP = 1.0
LR = 1e-3


def _data(args: argparse.Namespace, world: int) -> CharChunks:
    """Exactly ``steps`` full optimizer steps per rank per epoch: no short last step."""
    sequences = args.steps * args.accum * args.batch * world
    return CharChunks(encode(load_corpus(sequences * args.block + 1)), args.block)


def _config(args: argparse.Namespace) -> LMConfig:
    return LMConfig(block=args.block, dim=args.dim, layers=args.layers, heads=args.heads)


def _schedule(args: argparse.Namespace) -> functools.partial:
    rounds = args.warmup + args.pairs  # each side trains this many epochs
    return functools.partial(warmup_cosine, warmup=args.steps, total=rounds * args.steps)


class StepClock:
    """The training step both sides call, marking when each optimizer step starts.

    A mark (wall clock, this process's CPU time) is taken as each optimizer step's first
    micro-batch enters the step function; from a round's first mark to its last, the side has
    run ``steps - 1`` whole optimizer steps, each with whatever its loop does between steps
    (clipping, the optimizer, the scheduler, the Trainer's agreement, logging and progress, the
    next batch's loading). What a round does before its first step and after its last (the
    Trainer's evaluation, checkpoint and plot at an epoch's end) is outside.

    With ``profile``, rank 0's profiler runs from a round's first mark to its last: the
    profile holds the per-step work only.
    """

    def __init__(self, accum: int, steps: int, profile: cProfile.Profile | None) -> None:
        self.accum, self.steps, self.profile = accum, steps, profile
        self.calls = 0
        self.marks: list[tuple[float, float]] = []

    def step(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict:
        if self.calls % self.accum == 0:
            self.marks.append((time.perf_counter(), time.process_time()))
            if self.profile is not None and len(self.marks) == 1:
                self.profile.enable()
            if self.profile is not None and len(self.marks) == self.steps:
                self.profile.disable()
        self.calls += 1
        return lm_step(model, batch)

    def take(self) -> tuple[float, float]:
        """Wall and CPU seconds per optimizer step of the round just run; start the next."""
        assert len(self.marks) == self.steps, f"{len(self.marks)} steps, not {self.steps}"
        (wall0, cpu0), (wall1, cpu1) = self.marks[0], self.marks[-1]
        self.calls, self.marks = 0, []
        return (wall1 - wall0) / (self.steps - 1), (cpu1 - cpu0) / (self.steps - 1)


def _over_ranks(wall: float, cpu: float) -> tuple[float, float]:
    """The slowest rank's wall time (a data-parallel step is as slow as its slowest rank) and
    the ranks' mean CPU time."""
    t = torch.tensor([wall, cpu], dtype=torch.float64)
    most, total = t.clone(), t.clone()
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    dist.all_reduce(total)
    return most[0].item(), total[1].item() / dist.get_world_size()


class Loop:
    """The hand-written loop: the same recipe as the Trainer's, over the same engine."""

    def __init__(self, args: argparse.Namespace, data: CharChunks) -> None:
        model = make_model(_config(args))
        self.engine: Engine = make_engine(model, adamw(list(model.parameters()), LR))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.engine.optimizer, _schedule(args))
        self.sampler = DistributedSampler(data, seed=0)
        self.loader = DataLoader(data, args.batch, sampler=self.sampler)
        self.profile = cProfile.Profile() if args.profile else None
        self.clock = StepClock(args.accum, args.steps, None)
        self.epoch = 0
        self.log_every = args.loop_log_every
        self.log = io.StringIO()  # rank 0's log lines (a file's write, without the disk)

    def round(self) -> tuple[float, float]:
        """Train one epoch; this rank's wall and CPU seconds per optimizer step."""
        engine, accum = self.engine, self.clock.accum
        model = engine.model
        model.train()
        self.sampler.set_epoch(self.epoch)
        window = torch.zeros(2, dtype=torch.float64)  # loss sum and micro-batches since the log
        steps = 0
        for i, batch in enumerate(self.loader):
            last = (i + 1) % accum == 0
            # Micro-batches before a step's last sum their gradients locally: one all-reduce.
            with contextlib.nullcontext() if last else engine.no_sync():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = self.clock.step(model, batch)["loss"]
                # The mean over the step's micro-batches, as one big batch's gradient.
                (loss * (1 / accum)).backward()
            if self.log_every:
                window += torch.tensor([loss.item(), 1.0], dtype=torch.float64)
            if last:
                engine.clip_grad_norm_(CLIP)
                engine.optimizer.step()
                engine.optimizer.zero_grad()
                self.scheduler.step()
                steps += 1
                if self.log_every and steps % self.log_every == 0:
                    # The mean loss over all ranks, logged by rank 0: what a loop that logs does.
                    dist.all_reduce(window)
                    if dist.get_rank() == 0:
                        print(f"step {steps} loss {window[0] / window[1]:.4f}", file=self.log)
                    window.zero_()
        self.epoch += 1
        return self.clock.take()


class TrainerSide:
    """The same run through :class:`tandem.Trainer`, one epoch per ``train()`` call."""

    def __init__(self, args: argparse.Namespace, data: CharChunks, run_dir: str) -> None:
        self.profile = cProfile.Profile() if args.profile else None
        self.clock = StepClock(args.accum, args.steps, None)
        self.trainer = Trainer(
            make_model(_config(args)),
            lambda params: adamw(params, LR),
            data,
            scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _schedule(args)),
            scheduler_interval="step",
            training_step=self.clock.step,
            precision="bf16-mixed",
            clip_grad_norm=CLIP,
            grad_accum_steps=args.accum,
            max_epochs=0,
            save_every=10**6,
            keep_checkpoints=1,
            check_every=args.check_every,
            batch_size=args.batch,
            run_dir=run_dir,
        )

    def round(self) -> tuple[float, float]:
        """Train one epoch; this rank's wall and CPU seconds per optimizer step."""
        trainer = self.trainer
        # The epoch's printed line is the Trainer's report, not this benchmark's table.
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.train(max_epochs=trainer.epoch + 1)
        return self.clock.take()


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    torch.set_num_threads(args.threads)
    tandem.init(backend="gloo")
    data = _data(args, world)
    trainer_side, loop = TrainerSide(args, data, args.run_dir), Loop(args, data)
    sides = {"trainer": trainer_side, "loop": loop}
    for _ in range(args.warmup):  # bucket rebuild, allocator, first-call costs
        for side in SIDES:
            sides[side].round()
    if rank == 0:  # the counted rounds only
        trainer_side.clock.profile = trainer_side.profile
        loop.clock.profile = loop.profile
    wall: dict[str, list[float]] = {s: [] for s in SIDES}
    cpu: dict[str, list[float]] = {s: [] for s in SIDES}
    for pair in range(args.pairs):
        # A B, then B A: neither side always runs right after the other's allocations.
        order = SIDES if pair % 2 == 0 else SIDES[::-1]
        for side in order:
            w, c = _over_ranks(*sides[side].round())
            wall[side].append(w)
            cpu[side].append(c)
    trained = trainer_side.trainer.module.state_dict()
    looped = loop.engine.module.state_dict()
    max_diff = max((trained[k].float() - looped[k].float()).abs().max().item() for k in trained)

    def summary(times: dict[str, list[float]]) -> dict:
        ratios = [a / b for a, b in zip(times["trainer"], times["loop"], strict=True)]
        return {
            "ms_per_step": {s: 1e3 * statistics.median(times[s]) for s in SIDES},
            "rounds_ms_per_step": {s: [1e3 * t for t in times[s]] for s in SIDES},
            "ratio_trainer_over_loop": statistics.median(ratios),
            "ratios": ratios,
        }

    report = {
        "params": sum(p.numel() for p in loop.engine.module.parameters()),
        "tensors": len(list(loop.engine.module.parameters())),
        "wall": summary(wall),
        "cpu": summary(cpu),
        "params_bitwise_equal": max_diff == 0.0,
        "params_max_abs_diff": max_diff,
    }
    if rank == 0 and args.profile:
        report["profile"] = {}
        for name, side in sides.items():
            assert side.profile is not None
            # Raw stats beside the JSON, for pstats or snakeviz; the top lines in the report.
            side.profile.dump_stats(args.json.with_suffix(f".{name}.prof"))
            text = io.StringIO()
            stats = pstats.Stats(side.profile, stream=text)
            stats.sort_stats(args.profile_sort).print_stats(args.profile_lines)
            report["profile"][name] = text.getvalue()
    if rank == 0:
        Path(out).write_text(json.dumps(report))
    dist.barrier()  # Gloo may abort a rank whose peer tears down mid-operation
    tandem.shutdown()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=21)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per round (>= 2)")
    parser.add_argument("--warmup", type=int, default=1, help="uncounted rounds of each side")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per micro-batch")
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument(
        "--check-every",
        type=int,
        default=1,
        help="the Trainer's check_every (its request agreement: one all-reduce every N steps)",
    )
    parser.add_argument(
        "--loop-log-every",
        type=int,
        default=10,
        help="the loop logs the loss averaged over ranks every N steps, as the Trainer's "
        "default log_every does (0: it logs nothing)",
    )
    parser.add_argument("--json", type=Path, default=RESULTS / "trainer_overhead.json")
    parser.add_argument("--profile", action="store_true", help="cProfile rank 0's steps")
    parser.add_argument("--profile-lines", type=int, default=40)
    parser.add_argument("--profile-sort", default="tottime", help="a pstats sort key")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (a round times its steps 2..N), got {args.steps}")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    tmp = str(args.json) + ".part"
    with tempfile.TemporaryDirectory(prefix="tandem-trainer-overhead-") as run_dir:
        args.run_dir = run_dir  # the Trainer's checkpoints and metrics, thrown away
        mp.spawn(_worker, args=(args.world, port, args, tmp), nprocs=args.world, join=True)
    report = json.loads(Path(tmp).read_text())
    os.remove(tmp)
    profile = report.pop("profile", None)
    meta = {
        "world": args.world,
        "backend": "gloo",
        "device": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "threads_per_rank": args.threads,
        "pairs": args.pairs,
        "steps_per_round": args.steps,
        "batch_per_rank": args.batch,
        "grad_accum_steps": args.accum,
        "trainer_check_every": args.check_every,
        "loop_log_every": args.loop_log_every,
        "model": {"block": args.block, "dim": args.dim, "layers": args.layers,
                  "heads": args.heads},
        "recipe": "bf16-mixed, clip 1.0, AdamW, warm-up + cosine per step",
        "torch": torch.__version__,
    }  # fmt: skip
    result = {"meta": meta, "lm": report}
    args.json.write_text(json.dumps(result, indent=2))

    wall, cpu = report["wall"], report["cpu"]
    print(
        f"Trainer overhead, {meta['world']} ranks, gloo, {meta['device']}, {args.pairs} pairs x "
        f"{args.steps} steps (median ms per optimizer step; batch {args.batch} x {args.accum} "
        f"accumulated per rank, bf16-mixed, clipping; Trainer check_every={args.check_every}, "
        f"loop logging every {args.loop_log_every or 'never'})"
    )
    print(
        "| model | params | Trainer wall | loop wall | Trainer/loop wall | Trainer CPU | "
        "loop CPU | Trainer/loop CPU | same params |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    same = "bitwise" if report["params_bitwise_equal"] else report["params_max_abs_diff"]
    print(
        f"| char LM {args.layers}x{args.dim} | {report['params'] / 1e6:.2f} M | "
        f"{wall['ms_per_step']['trainer']:.2f} | {wall['ms_per_step']['loop']:.2f} | "
        f"{wall['ratio_trainer_over_loop']:.3f} | {cpu['ms_per_step']['trainer']:.2f} | "
        f"{cpu['ms_per_step']['loop']:.2f} | {cpu['ratio_trainer_over_loop']:.3f} | {same} |"
    )
    for name, text in (profile or {}).items():
        print(f"\ncProfile of rank 0's {name}, its counted steps only:\n{text}")
        print(f"(raw: {args.json.with_suffix(f'.{name}.prof')})")
    print(f"JSON: {args.json}")
    return result


if __name__ == "__main__":
    main()
