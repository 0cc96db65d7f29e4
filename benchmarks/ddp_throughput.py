"""tandem.DDP against torch's DDP: training throughput, side by side in the same processes.

Both engines train the same model (same weights, same batches) on WORLD ranks with Gloo on the
CPU, one intra-op thread per rank. Measurements alternate, A B A B ..., so that drift in the
machine's load hits both alike; each round is `--steps` steps after the engines have warmed up
(bucket rebuild included). Reported: median samples/s of each engine over the rounds, and the
median of the per-pair ratios tandem/torch.

``--interleave step`` alternates at every step instead (a pair is then ``--steps`` steps of
each engine, taken in turns, each after a barrier and timed on its own, the slowest rank's
time): load that drifts over a round then falls on both engines alike, which makes the ratio
several times steadier than with whole rounds (where single pairs spread by +-10% on a 2-core
machine), at the price of engines that share the caches step by step.

Run::

    python benchmarks/ddp_throughput.py --pairs 7 --steps 30
    python benchmarks/ddp_throughput.py --device cuda --world 1   # on a GPU machine (NCCL)
    python benchmarks/ddp_throughput.py --records-overhead --models deep_200x16 mlp
    python benchmarks/ddp_throughput.py --interleave step --pairs 15 --steps 40

``--records-overhead`` adds a third engine, tandem.DDP with the collective records
(``tandem.doctor.records``) switched off during its rounds, and prints recorded/unrecorded.

``--recovery-overhead`` adds tandem.DDP with what ``--recover in-memory`` costs a Trainer while
nothing fails: every step commits (:meth:`tandem.recovery.Recoverer.commit`, its vote riding in
the gradient all-reduce: this rank's generators, when they changed, and its loss sums left in
the job's store, taken and sent on a thread from the start of the backward, the last bucket
waiting for it only if it is not done) and a heartbeat thread beats; and the same commit on the
step's path (``tandem_committed_inline``: the state taken and sent right before the last
bucket). Which of the two ``--recover in-memory`` takes by default depends on the cores a rank
has (:func:`tandem.recovery.commit_off_path`); the table says which. It prints committed/plain
for both, each pair's ratio summarized as its median and a bootstrap 95% interval of that
median (resampling the pairs), and the time each commit spends on the step's path, timed
inside every step (the vote's calls from the reducer and the commit after the backward; the
slowest rank's, median over the steps) beside the median step. Run it with ``--interleave
step`` (the step times come from there).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import tandem
from tandem.doctor import records

RESULTS = Path(__file__).resolve().parent / "results"


def mlp() -> nn.Module:
    # 784-1024-1024-1024-10: 2.9 M parameters, the "about 3 M" MLP of the issue
    return nn.Sequential(
        nn.Linear(784, 1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
        nn.ReLU(),
        nn.Linear(1024, 10),
    )


def convnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 8 * 8, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


def deep(tensors: int, width: int):
    """``tensors / 2`` layers of Linear(width, width) + Tanh: many small parameter tensors,
    where the engine's per-parameter cost is all there is (a GPT-2 has ~150 tensors, a 7B
    Llama ~290)."""

    def build() -> nn.Module:
        layers: list[nn.Module] = []
        for _ in range(tensors // 2):
            layers += [nn.Linear(width, width), nn.Tanh()]
        return nn.Sequential(*layers)

    return build


MODELS = {
    "mlp": (mlp, (784,), 64),
    "convnet": (convnet, (3, 32, 32), 32),
    "deep_200x16": (deep(200, 16), (16,), 8),
    "deep_800x16": (deep(800, 16), (16,), 8),
    "deep_800x256": (deep(800, 256), (256,), 8),
}
ENGINES = ("tandem", "torch")
# With --records-overhead: tandem.DDP again, with the collective records switched off for its
# rounds (tandem.doctor.records), to measure what recording costs.
UNRECORDED = "tandem_unrecorded"
# With --recovery-overhead: tandem.DDP committing every step as under --recover in-memory (the
# state taken and sent off the step's path), and the same on the path.
COMMITTED = "tandem_committed"
INLINE = "tandem_committed_inline"


def _wrap(engine: str, model: nn.Module, device: torch.device) -> nn.Module:
    ids = [device.index] if device.type == "cuda" else None
    if engine in ("tandem", UNRECORDED, COMMITTED, INLINE):
        return tandem.DDP(model, device_ids=ids)
    return TorchDDP(model, device_ids=ids)


class _Commit:
    """A Trainer's commit under ``--recover in-memory``, on its own, with the heartbeat, through
    the real :class:`tandem.recovery.Recoverer`: what :class:`tandem.train.in_memory.InMemory`
    does. The vote rides in the model's gradient all-reduce (:meth:`Recoverer.attach`); right
    before the last bucket, this rank's generators (taken anew only when they moved) and loss
    sums (new every step) go to the job's store; the commit after the backward then only checks
    that the vote passed. ``off_path``: the state is taken and sent on a thread from the
    backward's start (:meth:`Recoverer.attach`), else right before the last bucket.

    :attr:`on_path` holds, per step, the seconds its calls took on the step's path: the vote's
    three calls from the reducer (as the backward starts, before the last bucket, once it is
    done) and the commit after the backward."""

    def __init__(self, rank: int, world: int, model: nn.Module, off_path: bool = True) -> None:
        from tandem.recovery import MODE_VARIABLE, Recoverer, RngText

        os.environ[MODE_VARIABLE] = "in-memory"  # the Recoverer is active only under it
        self.recoverer = Recoverer(heartbeat_timeout=10)
        self.rng = RngText()
        self.step = 0
        self.recoverer.attach(model, self.own, off_path=off_path)
        self.recoverer.commit(-1, self.own())  # the start (a vote of its own, as a Trainer's)
        self.on_path: list[float] = []
        self.parts: dict[str, list[float]] = {p: [] for p in PARTS}  # each part, per step
        self._spent = dict.fromkeys(PARTS, 0.0)
        vote = model.reducer.end_of_backward.vote  # type: ignore[union-attr]
        for name in PARTS[:-1]:
            setattr(vote, name, self._timed(name, getattr(vote, name)))

    def _timed(self, name: str, call):
        def timed() -> None:
            start = time.perf_counter()
            try:
                call()
            finally:
                self._spent[name] += time.perf_counter() - start

        return timed

    def own(self) -> str:
        from tandem.train.in_memory import _own_text

        state = {  # what a Trainer's rank state holds (tandem.train.step_log.SavedRun)
            "rng": {},
            "epoch_loss": [0.5 * self.step, 8 * self.step],
            "window": {"sums": [0.25 * self.step, 8, 0, 0]},
        }
        return _own_text(self.rng.value(), state)

    def __call__(self) -> None:
        # As InMemory.commit after a backward that carried the vote: the state is not taken
        # again (the function is called only for a step whose vote rode in no backward).
        start = time.perf_counter()
        self.recoverer.commit(self.step, self.own)
        self._spent["commit"] = time.perf_counter() - start
        self.on_path.append(sum(self._spent.values()))
        for part, seconds in self._spent.items():
            self.parts[part].append(seconds)
        self._spent = dict.fromkeys(PARTS, 0.0)
        self.step += 1

    def close(self) -> None:
        self.recoverer.close()


def _round(model, opt, batches, device) -> float:
    """Seconds for one round of steps, the slowest rank's (the step is as slow as it)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for x, y in batches:
        _step(model, opt, x, y, COMMITS.get(id(model)))
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


# What a commit does on the step's path: the vote's calls from the reducer, then the commit.
PARTS = ("starting", "entering", "passed", "commit")
# The commit of each engine that has one, by id(model).
COMMITS: dict[int, _Commit] = {}


def _step(model, opt, x, y, commit=None) -> None:
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    if commit is not None:
        commit()
    opt.step()


def _interleaved(
    engines: dict, names: tuple[str, ...], batches, device, pair: int
) -> tuple[dict, torch.Tensor]:
    """One pair with ``--interleave step``: seconds per engine, summed over its steps, each
    step the slowest rank's; the engines take turns at every step, in rotating order. And
    every step's seconds (steps x engines)."""
    spent = torch.zeros(len(batches), len(names), dtype=torch.float64)
    for k, (x, y) in enumerate(batches):
        turn = (pair + k) % len(names)
        for e in [*range(turn, len(names)), *range(turn)]:
            model, opt = engines[names[e]]
            records.enabled = names[e] != UNRECORDED
            if device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            _step(model, opt, x, y, COMMITS.get(id(model)))
            if device.type == "cuda":
                torch.cuda.synchronize()
            spent[k, e] = time.perf_counter() - start
            records.enabled = True
    dist.all_reduce(spent, op=dist.ReduceOp.MAX)
    return dict(zip(names, spent.sum(dim=0).tolist(), strict=True)), spent


def interval(ratios: list[float], resamples: int = 10000, seed: int = 0) -> tuple[float, float]:
    """A bootstrap 95% interval of the median of ``ratios`` (the pairs resampled with
    replacement ``resamples`` times; percentile interval, fixed seed: rerunnable)."""
    draw = random.Random(seed)
    medians = sorted(
        statistics.median(draw.choices(ratios, k=len(ratios))) for _ in range(resamples)
    )
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def _recovery_report(engines: dict, rate: dict, step_s: dict) -> dict:
    """--recovery-overhead: each commit's throughput against plain tandem.DDP (pair by pair),
    and its time on the step's path beside its median step (both the slowest rank's)."""
    out: dict = {}
    for engine in (COMMITTED, INLINE):
        pairs = [a / b for a, b in zip(rate[engine], rate["tandem"], strict=True)]
        low, high = interval(pairs)
        # The same pairs as step time, committed/plain: the cost itself (1.02 is 2% slower).
        times = [1 / r for r in pairs]
        time_low, time_high = interval(times)
        commit = COMMITS[id(engines[engine][0])]
        on_path = torch.tensor(commit.on_path, dtype=torch.float64)
        dist.all_reduce(on_path, op=dist.ReduceOp.MAX)
        on_path_ms = statistics.median(on_path.tolist()) * 1e3
        parts = torch.tensor([commit.parts[p] for p in PARTS], dtype=torch.float64)
        dist.all_reduce(parts, op=dist.ReduceOp.MAX)
        rows = zip(PARTS, parts.tolist(), strict=True)
        parts_ms = {p: statistics.median(row) * 1e3 for p, row in rows}
        step_ms = statistics.median(step_s[engine]) * 1e3 if step_s[engine] else None
        out[engine] = {
            "ratio_over_plain": statistics.median(pairs),  # throughput
            "ratio_interval_95": [low, high],
            "ratios": pairs,
            "time_ratio_over_plain": statistics.median(times),  # step time
            "time_ratio_interval_95": [time_low, time_high],
            "on_path_ms": on_path_ms,
            "on_path_parts_ms": parts_ms,  # each part's median (they need not add up)
            "on_path_ms_quartiles": [q * 1e3 for q in statistics.quantiles(on_path.tolist(), n=4)]
            if len(on_path) > 1
            else None,
            "step_ms": step_ms,
            "on_path_share": on_path_ms / step_ms if step_ms else None,
            "plain_step_ms": statistics.median(step_s["tandem"]) * 1e3
            if step_s["tandem"]
            else None,
        }
    return out


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    torch.set_num_threads(args.threads)
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    report = {}
    for name in args.models:
        factory, shape, batch = MODELS[name]
        g = torch.Generator().manual_seed(rank)
        batches = [
            (
                torch.randn(batch, *shape, generator=g).to(device),
                torch.randint(0, 10, (batch,), generator=g).to(device),
            )
            for _ in range(args.steps)
        ]
        engines = {}
        engine_names = ("tandem",) if args.skip_torch else ENGINES
        engine_names += (UNRECORDED,) if args.records_overhead else ()
        engine_names += (COMMITTED, INLINE) if args.recovery_overhead else ()
        for engine in engine_names:
            torch.manual_seed(0)
            model = _wrap(engine, factory().to(device), device)
            if engine in (COMMITTED, INLINE):
                COMMITS[id(model)] = _Commit(rank, world, model, off_path=engine == COMMITTED)
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            _round(model, opt, batches[: args.warmup], device)  # warm-up and bucket rebuild
            engines[engine] = (model, opt)
        for commit in COMMITS.values():
            commit.on_path.clear()  # the warm-up's
            for seconds in commit.parts.values():
                seconds.clear()
        times: dict[str, list[float]] = {e: [] for e in engine_names}
        step_s: dict[str, list[float]] = {e: [] for e in engine_names}
        for pair in range(args.pairs):
            if args.interleave == "step":
                spent, each = _interleaved(engines, engine_names, batches, device, pair)
                for e, engine in enumerate(engine_names):
                    times[engine].append(spent[engine])
                    step_s[engine] += each[:, e].tolist()
                continue
            # A B, then B A: neither engine always runs right after the other's allocations
            order = engine_names if pair % 2 == 0 else engine_names[::-1]
            for engine in order:
                model, opt = engines[engine]
                records.enabled = engine != UNRECORDED
                times[engine].append(_round(model, opt, batches, device))
                records.enabled = True
        samples = world * batch * args.steps
        rate = {e: [samples / t for t in times[e]] for e in engine_names}
        report[name] = {
            "params": sum(p.numel() for p in factory().parameters()),
            "tensors": len(list(factory().parameters())),
            "batch_per_rank": batch,
            "samples_per_s": {e: statistics.median(rate[e]) for e in engine_names},
            "rounds_samples_per_s": rate,
        }
        if not args.skip_torch:
            ratios = [a / b for a, b in zip(rate["tandem"], rate["torch"], strict=True)]
            report[name]["ratio_tandem_over_torch"] = statistics.median(ratios)
            report[name]["ratios"] = ratios
        if args.records_overhead:
            pairs = zip(rate["tandem"], rate[UNRECORDED], strict=True)
            report[name]["ratio_recorded_over_unrecorded"] = statistics.median(
                [a / b for a, b in pairs]
            )
        if args.recovery_overhead:
            report[name]["recovery"] = _recovery_report(engines, rate, step_s)
        # Keyed by id(model): once this model's engines are freed, a later model may get the
        # same id on some ranks and not on others (a commit in one rank's plain engine).
        for commit in COMMITS.values():
            commit.close()
        COMMITS.clear()
    if rank == 0:
        Path(out).write_text(json.dumps(report))
    dist.barrier()  # Gloo may abort a rank whose peer tears down mid-operation
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--json", type=Path, default=RESULTS / "ddp_throughput.json")
    parser.add_argument(
        "--interleave",
        choices=["round", "step"],
        default="round",
        help="alternate the engines every round of --steps steps (default) or every step",
    )
    parser.add_argument(
        "--records-overhead",
        action="store_true",
        help="also run tandem.DDP with the collective records off, and print recording's cost",
    )
    parser.add_argument(
        "--recovery-overhead",
        action="store_true",
        help="also run tandem.DDP committing every step as under --recover in-memory (off the "
        "step's path, and the old way on it), and print their cost",
    )
    parser.add_argument(
        "--skip-torch",
        action="store_true",
        help="leave torch's DDP out (more pairs in the same time for the other comparisons)",
    )
    args = parser.parse_args(argv)

    before = os.getloadavg()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    tmp = str(args.json) + ".part"
    mp.spawn(_worker, args=(args.world, port, args, tmp), nprocs=args.world, join=True)
    report = json.loads(Path(tmp).read_text())
    os.remove(tmp)
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor()
    meta = {
        "world": args.world,
        "backend": "nccl" if args.device == "cuda" else "gloo",
        "device": device or platform.machine(),
        "cpus": os.cpu_count(),
        "threads_per_rank": args.threads,
        "pairs": args.pairs,
        "steps_per_round": args.steps,
        "interleave": args.interleave,
        "torch": torch.__version__,
        "load_average": {"before": before, "after": os.getloadavg()},  # 1, 5, 15 min
    }
    default_off_path = None
    if args.recovery_overhead:
        from tandem.recovery import commit_off_path

        # What --recover in-memory would take for these ranks, all on this machine.
        default_off_path = commit_off_path({**os.environ, "LOCAL_WORLD_SIZE": str(args.world)})
        meta["commit_off_path_by_default"] = default_off_path
    result = {"meta": meta, "models": report}
    args.json.write_text(json.dumps(result, indent=2))

    print(
        f"DDP throughput, {meta['world']} ranks, {meta['backend']}, {meta['device']}, "
        f"{args.pairs} pairs x {args.steps} steps, alternating every {args.interleave} "
        "(median samples/s)"
    )
    print("| model | tensors | params | tandem.DDP | torch DDP | tandem/torch |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in report.items():
        s = r["samples_per_s"]
        torch_rate = f"{s['torch']:.0f}" if "torch" in s else "-"
        ratio = r.get("ratio_tandem_over_torch")
        print(
            f"| {name} | {r['tensors']} | {r['params'] / 1e6:.2f} M | {s['tandem']:.0f} | "
            f"{torch_rate} | {'-' if ratio is None else f'{ratio:.3f}'} |"
        )
    if args.records_overhead:
        print("\nCollective records (tandem.doctor.records): tandem.DDP recorded / unrecorded")
        print("| model | tensors | recorded/unrecorded |")
        print("|---|---:|---:|")
        for name, r in report.items():
            print(f"| {name} | {r['tensors']} | {r['ratio_recorded_over_unrecorded']:.3f} |")
    if args.recovery_overhead:
        print(
            "\nRecovery in memory while nothing fails: tandem.DDP with the commit / without "
            "(median of the pairs, bootstrap 95% interval), and the commit's time on the "
            "step's path (median over the steps, slowest rank) beside its median step"
        )
        print(
            "| model | commit | samples/s committed/plain | step time committed/plain | "
            "its 95% interval | on path (ms) | step (ms) | on path / step |"
        )
        print("|---|---|---:|---:|---|---:|---:|---:|")
        for name, r in report.items():
            for engine, c in r["recovery"].items():
                off = engine == COMMITTED
                way = "off the path" if off else "on the path"
                way += " (the default here)" if off == default_off_path else ""
                low, high = c["time_ratio_interval_95"]
                step = "-" if c["step_ms"] is None else f"{c['step_ms']:.2f}"
                share = "-" if c["on_path_share"] is None else f"{100 * c['on_path_share']:.2f}%"
                print(
                    f"| {name} | {way} | {c['ratio_over_plain']:.3f} | "
                    f"{c['time_ratio_over_plain']:.3f} | {low:.3f} to {high:.3f} | "
                    f"{c['on_path_ms']:.3f} | {step} | {share} |"
                )
    print(f"JSON: {args.json}")
    return result


if __name__ == "__main__":
    main()
