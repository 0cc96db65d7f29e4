"""Sharded data parallelism: per-rank memory by the ZeRO formulas, and training throughput.

The model is a stack of ``--blocks`` residual MLP blocks of width ``--width`` (LayerNorm,
Linear, ReLU, Linear, plus the input) and a 10-way linear head: 4.2 M parameters at the
defaults, float32, AdamW, cross-entropy, Gloo on the CPU. ``P`` is counted from the plain model.

**Memory** (world sizes ``--world-sizes``, one fresh contender at a time in the same ranks):
after two training steps, at rest after ``optimizer.step()`` and before ``zero_grad`` (so the
gradients are still held), each rank counts the bytes of the tensors it holds, every storage
once (deduplicated by its data pointer, a storage resized to zero counting zero):

- *params*: the parameters the model holds: the module's parameters (tandem.DDP, stage 1); the
  flat shards plus every unit's gathered buffer ``unit.full`` while it has storage (stages 2
  and 3: stage 2 keeps them between steps, stage 3 frees them);
- *grads*: the ``.grad`` of the optimizer's parameters;
- *state*: the optimizer state (for ``tandem.ShardedOptimizer`` its inner optimizer's: this
  rank's only); Adam's scalar ``step`` tensors are counted apart (*step*), to show they are
  negligible, and left out of the comparison;
- *buckets*: tandem.DDP's gradient bucket buffers where they are memory of their own (the
  default ``gradient_as_bucket_view=False``: the reducer copies each gradient into its bucket,
  so DDP and stage 1 hold the gradients twice). Not in the ZeRO paper's count, so not compared;
  the row with ``gradient_as_bucket_view=True`` shows the copy is avoidable;
- *all live*: a cross-check that nothing is missed: every tensor storage the garbage collector
  finds in the process that was not there before the contender was built.

The comparison is params + grads + state against the ZeRO paper's formulas. The paper counts
mixed precision with Adam (2 B fp16 parameters, 2 B fp16 gradients, 12 B fp32 master copy and
moments per element): DDP 16P, stage 1 4P+12P/N, stage 2 2P+14P/N, stage 3 16P/N. Everything
here is float32 with no master copy (4 B parameters, 4 B gradients, 8 B for AdamW's two
moments), which gives: DDP 16P, stage 1 8P+8P/N, stage 2 4P+12P/N, stage 3 16P/N. The ratio
measured/formula is taken per rank and its worst rank reported; the target is within 5%.

**Throughput** (world size 2, one intra-op thread per rank): every contender is built in the
same two processes from the same initial weights and trains on the same batches (per rank
``--batch`` samples, different on each rank): tandem.DDP + AdamW, stage 1 (tandem.DDP +
tandem.ShardedOptimizer), tandem.FullyShardedDataParallel stage 2 and stage 3 (each block its
own unit), torch DDP + AdamW (reference), torch DDP + ZeroRedundancyOptimizer, torch FSDP2
(``fully_shard`` per block, then the root) and torch FSDP1 (``FullyShardedDataParallel`` with
``device_id=None``); a contender that cannot be built or run on the CPU is reported with its
exact error instead of a number. After ``--warmup`` steps each, the contenders take turns
step by step (A B C ... then ... C B A, each step started at a barrier and timed on its own),
so that a burst of load from elsewhere on the machine falls on all of them nearly alike;
a round is ``--steps`` such turns, a contender's time in it the sum of its steps, the slower
rank's (``--interleave round`` takes turns every round instead, as ddp_throughput.py does:
noisier on a shared machine). Reported: median steps/s and samples/s over the rounds, the
median of the per-round ratios to tandem.DDP with their range, and rank 0's median
milliseconds per step in forward (with ``zero_grad``), backward and ``optimizer.step()``:
where a sharded engine spends its time against DDP. Target: stage 3 at least 0.8x
tandem.DDP. Every contender has then taken the same steps on the same data, so its
parameters are compared with tandem.DDP's (max absolute difference, and the difference's norm
over the norm of DDP's change from the initial weights): a broken path cannot pass silently.

Processes are started with ``tandem.spawn`` (a failing rank stops the others); every rank arms
``faulthandler.dump_traceback_later(--timeout)``, and collectives time out after as long, so a
hang ends in an error with tracebacks. Results: ``benchmarks/results/sharded.json`` and
markdown tables on stdout.

Run::

    python benchmarks/sharded.py                  # about 2 minutes on 2 cores
    python benchmarks/sharded.py --quick          # a quick pass while iterating
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import platform
import statistics
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import tandem

# benchmarks/ is not a package: this script's folder is on sys.path, here and in every process
# tandem.spawn starts.
from sharded_contenders import (
    EXTRA_CONTENDERS,
    FORMULAS_FP32,
    FORMULAS_PAPER,
    LR,
    MEMORY_CONTENDERS,
    THROUGHPUT_CONTENDERS,
    Contender,
    batches,
    build,
    held_bytes,
    live_storages,
    make_net,
    train_step,
)

RESULTS = Path(__file__).resolve().parent / "results"
MB = 2**20
TOLERANCE = 0.05  # memory: |measured / formula - 1|
TARGET_STAGE3 = 0.8  # throughput: stage 3 / tandem.DDP
PARAMS_RTOL = 1e-3  # sanity: ||p - p_ddp|| / ||p_ddp - p_init||


# -- memory ------------------------------------------------------------------------------------


def _memory(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    data = batches(args, rank, 2)
    rows = []
    for name in MEMORY_CONTENDERS:
        before = live_storages()  # collects garbage first
        c = build(name, args)
        for x, y in data:  # two steps: DDP's buckets are rebuilt at the second
            train_step(c, x, y)
        row: dict[str, Any] = {"contender": name, "N": world, "rank": rank, **held_bytes(c)}
        if isinstance(c.model, tandem.FullyShardedDataParallel):
            row["units_gathered"] = sum(u.is_gathered for u in c.model.units)
            row["padding_elements"] = sum(u.padded - u.numel for u in c.model.units)
        row["all_live"] = sum(v for k, v in live_storages().items() if k not in before)
        rows.append(row)
        dist.barrier()
        del c
    return rows


# -- throughput --------------------------------------------------------------------------------


def _round(c: Contender, data: list[tuple[torch.Tensor, ...]]) -> float:
    """Seconds for one round of steps, the slower rank's."""
    dist.barrier()
    start = time.perf_counter()
    for x, y in data:
        train_step(c, x, y)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _interleaved_round(
    contenders: dict[str, Contender],
    data: list[tuple[torch.Tensor, ...]],
    phases: dict[str, list[tuple[float, float, float]]],
) -> dict[str, float]:
    """One round with the contenders taking turns step by step (A B C ... C B A ...).

    Each step starts at a barrier and is timed on its own; a contender's time is the sum of
    its steps, the slower rank's. A burst of load from elsewhere then falls on every
    contender of the round nearly alike, instead of on whichever ran during it. Each step's
    phases (this rank's) are appended to ``phases[name]``.
    """
    names = list(contenders)
    local = dict.fromkeys(names, 0.0)
    for i, (x, y) in enumerate(data):
        for name in names if i % 2 == 0 else names[::-1]:
            dist.barrier()
            start = time.perf_counter()
            phases[name].append(train_step(contenders[name], x, y))
            local[name] += time.perf_counter() - start
    elapsed = torch.tensor([local[n] for n in names], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return dict(zip(names, elapsed.tolist(), strict=True))


def _agreed(ok: bool) -> bool:
    """True when every rank says ``ok`` (so that all ranks keep or drop a contender alike)."""
    flag = torch.tensor([0 if ok else 1])
    dist.all_reduce(flag)
    return flag.item() == 0


def _error(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(exc)).strip()


def _compare(
    got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], init: dict[str, torch.Tensor]
) -> dict[str, Any]:
    if set(got) != set(ref):
        return {"ok": False, "error": f"names differ: {sorted(set(got) ^ set(ref))[:4]}"}
    diff = max((got[k] - ref[k]).abs().max().item() for k in ref)
    num = sum(((got[k] - ref[k]) ** 2).sum().item() for k in ref) ** 0.5
    moved = sum(((ref[k] - init[k]) ** 2).sum().item() for k in ref) ** 0.5
    rel = num / moved if moved > 0 else float("inf")
    return {"ok": rel <= PARAMS_RTOL, "max_abs_diff": diff, "rel_diff": rel, "ddp_moved": moved}


def _throughput(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    warm = batches(args, rank, args.warmup)
    data = batches(args, rank, args.steps)
    contenders: dict[str, Contender] = {}
    errors: dict[str, str] = {}
    for name in args.contenders:
        c, error = None, None
        try:
            c = build(name, args)
            for x, y in warm:
                train_step(c, x, y)
        except Exception as exc:
            error = _error(exc)
        # A rank that failed must not leave the others in a collective: agree first.
        if _agreed(error is None) and c is not None:
            contenders[name] = c
        else:
            errors[name] = error or "failed on another rank"
    names = list(contenders)
    times: dict[str, list[float]] = {n: [] for n in names}
    phases: dict[str, list[tuple[float, float, float]]] = {n: [] for n in names}
    for r in range(args.rounds):
        if args.interleave == "step":
            for name, t in _interleaved_round(contenders, data, phases).items():
                times[name].append(t)
            continue
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(_round(contenders[name], data))
    steps = {n: [args.steps / t for t in times[n]] for n in names}
    base = steps.get("tandem.DDP")
    report: dict[str, Any] = {"errors": errors, "contenders": {}}
    for n in names:
        ratios = [a / b for a, b in zip(steps[n], base, strict=True)] if base else []
        report["contenders"][n] = {
            "steps_per_s": statistics.median(steps[n]),
            "samples_per_s": statistics.median(steps[n]) * world * args.batch,
            "ratio_over_tandem_ddp": statistics.median(ratios) if ratios else None,
            "ratio_range": [min(ratios), max(ratios)] if ratios else None,
            "rounds_steps_per_s": steps[n],
            "rounds_ratio": ratios,
            "rank0_ms_per_step": {
                phase: statistics.median(p[i] for p in phases[n]) * 1e3
                for i, phase in enumerate(("forward", "backward", "step"))
            }
            if phases[n]
            else None,
        }
    # Sanity: the same steps on the same data, so the same parameters as tandem.DDP.
    init = dict(make_net(args).named_parameters())
    ref = contenders["tandem.DDP"].full_params() if "tandem.DDP" in contenders else None
    for n in names:
        got = contenders[n].full_params()  # a collective for the sharded ones
        if rank == 0 and ref is not None and got is not None:
            report["contenders"][n]["check"] = _compare(got, ref, init)
    if args.profile:
        report["profile"] = _profile(contenders, data, args)
    return report


def _profile(
    contenders: dict[str, Contender], data: list[tuple[torch.Tensor, ...]], args: argparse.Namespace
) -> dict[str, str]:
    """torch.profiler's top operators by self CPU time, one round per profiled contender."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for name in args.profile:
        if name not in contenders:
            continue
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _round(contenders[name], data)
        out[name] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)
    return out


# -- processes ---------------------------------------------------------------------------------


def _worker(rank: int, phase: str, args: argparse.Namespace) -> Any:
    # A hang anywhere (a collective waiting on a dead peer, a deadlock) ends this process with
    # its traceback on stderr; tandem.spawn then stops the others and raises.
    faulthandler.dump_traceback_later(args.timeout, exit=True)
    w = tandem.init(backend="gloo", timeout=args.timeout)
    try:
        if phase == "memory":
            return _memory(rank, w.world_size, args)
        return _throughput(rank, w.world_size, args)
    finally:
        tandem.shutdown()
        faulthandler.cancel_dump_traceback_later()


def _summarize_memory(rows: list[dict[str, Any]], p: int) -> list[dict[str, Any]]:
    """One line per (contender, N): the worst rank's ratio against the float32 formula."""
    out = []
    for name in MEMORY_CONTENDERS:
        for n in sorted({r["N"] for r in rows}):
            ranks = [r for r in rows if r["contender"] == name and r["N"] == n]
            if not ranks:
                continue
            expr, per_element = FORMULAS_FP32[name]
            formula = sum(per_element(n)) * p
            for r in ranks:
                r["compared"] = r["params"] + r["grads"] + r["state"]
                r["ratio"] = r["compared"] / formula
            worst = max(ranks, key=lambda r: abs(r["ratio"] - 1))
            out.append(
                {
                    "contender": name,
                    "N": n,
                    "worst_rank": worst["rank"],
                    **{k: worst[k] for k in ("params", "grads", "state", "step", "buckets")},
                    "all_live": worst["all_live"],
                    "compared": worst["compared"],
                    "formula_fp32": expr,
                    "formula_paper_mixed": FORMULAS_PAPER[name],
                    "formula_bytes": formula,
                    "formula_columns_bytes": [b * p for b in per_element(n)],
                    "ratio": worst["ratio"],
                    "within_5pct": all(abs(r["ratio"] - 1) <= TOLERANCE for r in ranks),
                    "ranks": ranks,
                }
            )
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--throughput-world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank and step")
    every = THROUGHPUT_CONTENDERS + EXTRA_CONTENDERS
    parser.add_argument(
        "--contenders", nargs="+", default=list(THROUGHPUT_CONTENDERS), choices=every
    )
    parser.add_argument(
        "--profile",
        nargs="*",
        default=[],
        choices=every,
        metavar="CONTENDER",
        help="also profile one round of these contenders (top operators, into the JSON)",
    )
    parser.add_argument(
        "--interleave",
        choices=["step", "round"],
        default="step",
        help="contenders take turns every step (default) or every round of --steps steps",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds, per launch")
    parser.add_argument("--quick", action="store_true", help="3 rounds x 5 steps, 1 warm-up")
    parser.add_argument("--json", type=Path, default=RESULTS / "sharded.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 3, 5, 1
    if "tandem.DDP" not in args.contenders:
        args.contenders.insert(0, "tandem.DDP")  # the baseline of every ratio

    p = sum(x.numel() for x in make_net(args).parameters())
    start = time.perf_counter()
    rows = []
    for n in args.world_sizes:
        for ranked in tandem.spawn(_worker, n, args=("memory", args)):
            rows.extend(ranked)
    memory = _summarize_memory(rows, p)
    memory_s = time.perf_counter() - start
    load_before = os.getloadavg()[0]
    throughput = tandem.spawn(_worker, args.throughput_world, args=("throughput", args))[0]
    meta = {
        "params": p,
        "model": f"{args.blocks} residual MLP blocks of width {args.width}, 10-way head",
        "dtype": "float32",
        "optimizer": f"AdamW(lr={LR})",
        "batch_per_rank": args.batch,
        "throughput_world": args.throughput_world,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "interleave": args.interleave,
        "warmup_steps": args.warmup,
        "threads_per_rank": 1,
        "backend": "gloo",
        "device": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_1min": [load_before, os.getloadavg()[0]],
        "torch": torch.__version__,
        "memory_s": memory_s,
        "total_s": time.perf_counter() - start,
        "formulas_fp32": {k: v[0] for k, v in FORMULAS_FP32.items()},
        "formulas_paper_mixed_precision": FORMULAS_PAPER,
    }
    stage3 = throughput["contenders"].get("stage 3", {}).get("ratio_over_tandem_ddp")
    targets = {
        "memory_within_5pct": all(m["within_5pct"] for m in memory),
        "stage3_over_ddp": stage3,
        "stage3_at_least_0.8x": stage3 is not None and stage3 >= TARGET_STAGE3,
    }
    result = {"meta": meta, "targets": targets, "memory": memory, "throughput": throughput}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    _print(result)
    print(f"JSON: {args.json}")
    return result


def _print(result: dict[str, Any]) -> None:
    meta, targets = result["meta"], result["targets"]
    p = meta["params"]
    print(
        f"Per-rank memory at rest after optimizer.step(), {meta['model']}, P = {p:,} "
        f"({p * 4 / MB:.1f} MB of float32 parameters), {meta['optimizer']}, float32"
    )
    print(
        "Formulas (bytes): float32 with AdamW (4 params + 4 grads + 8 moments per element): "
        + ", ".join(f"{k} {v}" for k, v in meta["formulas_fp32"].items() if "view" not in k)
        + "; the ZeRO paper's, mixed precision with Adam: "
        + ", ".join(
            f"{k} {v}" for k, v in meta["formulas_paper_mixed_precision"].items() if "view" not in k
        )
    )
    print(
        "Compared: params + grads + state (MB = 2^20 B, worst rank); buckets (DDP's copy of the "
        "gradients), step (Adam's scalars) and all live (every storage the contender added) "
        "are shown, not compared"
    )
    print(
        "| contender | N | params MB | grads MB | state MB | total MB | formula | formula MB "
        "| ratio | within 5% | buckets MB | step B | all live MB |"
    )
    print("|---|---:|---:|---:|---:|---:|---|---:|---:|---|---:|---:|---:|")
    for m in result["memory"]:
        cells = [
            m["contender"],
            str(m["N"]),
            *(f"{m[k] / MB:.2f}" for k in ("params", "grads", "state", "compared")),
            m["formula_fp32"],
            f"{m['formula_bytes'] / MB:.2f}",
            f"{m['ratio']:.4f}",
            "yes" if m["within_5pct"] else "NO",
            f"{m['buckets'] / MB:.2f}",
            str(m["step"]),
            f"{m['all_live'] / MB:.2f}",
        ]
        print("| " + " | ".join(cells) + " |")
    print()
    t = result["throughput"]
    print(
        f"Throughput, {meta['throughput_world']} ranks, Gloo, {meta['cpus']} CPUs, 1 thread per "
        f"rank, batch {meta['batch_per_rank']} per rank, {meta['rounds']} rounds x "
        f"{meta['steps_per_round']} steps, taking turns every {meta['interleave']} (median; "
        f"ratio = median of per-round ratios; load "
        f"average {meta['load_average_1min'][0]:.1f} -> {meta['load_average_1min'][1]:.1f})"
    )
    print(
        "| contender | steps/s | samples/s | / tandem.DDP | rounds' range "
        "| ms fwd / bwd / opt | params vs tandem.DDP |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, r in t["contenders"].items():
        check = r.get("check")
        if check is None:
            verdict = "-"
        elif "error" in check:
            verdict = f"FAIL: {check['error']}"
        else:
            word = "ok" if check["ok"] else "DIFFERENT"
            verdict = f"{word} (max {check['max_abs_diff']:.1e}, rel {check['rel_diff']:.1e})"
        ratio = r["ratio_over_tandem_ddp"]
        shown_ratio = "-" if ratio is None else f"{ratio:.3f}"
        spread = "-" if r["ratio_range"] is None else "{:.2f}-{:.2f}".format(*r["ratio_range"])
        ms = r["rank0_ms_per_step"]
        split = "-" if ms is None else " / ".join(f"{ms[k]:.1f}" for k in ms)
        print(
            f"| {name} | {r['steps_per_s']:.2f} | {r['samples_per_s']:.0f} | "
            f"{shown_ratio} | {spread} | {split} | {verdict} |"
        )
    for name, error in t["errors"].items():
        short = error.replace("\n", " ").replace("|", "/")
        print(f"| {name} | - | - | - | - | - | does not run: {short} |")
    print()
    ok = "met" if targets["memory_within_5pct"] else "NOT met"
    stage3 = targets["stage3_over_ddp"]
    ok3 = "met" if targets["stage3_at_least_0.8x"] else "NOT met"
    shown = f"{stage3:.3f}x" if stage3 is not None else "n/a"
    print(
        f"Targets: memory within 5% of the formula: {ok}; "
        f"stage 3 {shown} tandem.DDP (>= 0.8x): {ok3}"
    )
    for name, table in t.get("profile", {}).items():
        print(f"\nProfile, one round of {name} (rank 0):\n{table}")


if __name__ == "__main__":
    main()
