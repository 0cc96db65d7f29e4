"""tandem.DataParallel beside the plain module and tandem.DDP: training steps per second.

Every engine trains the same model (same initial weights) on the same global batches, SGD with
momentum, cross-entropy:

- *module*: the plain module, one intra-op thread (the baseline of the ratios);
- *module 2t*: the plain module with two intra-op threads (torch's own use of two cores);
- *DP*: tandem.DataParallel, 2 CPU replicas, one thread each, loss on the gathered output;
- *DP balanced*: the same with ``loss_fn``: each replica computes its slice's loss;
- *DDP*: tandem.DDP, 2 processes (Gloo), each on half of the global batch.

One intra-op thread everywhere else (``torch.set_num_threads(1)``), so that every engine but
*module* uses two cores exactly once. Measurements alternate, A B C D E then E D C B A, so that
drift in the machine's load hits all alike; each round is ``--steps`` steps after a warm-up.
Reported: median steps/s of each engine over the rounds, and the median of the per-round
ratios engine/module. The DDP ranks run in their own processes and wait on a queue while the
others run; a round's time is the slower rank's.

Second table: bytes gathered onto the output device per step, plain DP against balanced, for
the benchmark models and an output-heavy "LM head" (on a GPU also the output device's peak
memory over a training step, ``torch.cuda.max_memory_allocated``).

With the GIL and 2 cores, CPU replicas overlap only inside torch kernels, and torch's autograd
engine runs all CPU backward work in the calling thread: on the CPU, DataParallel can overlap
only the forward. On a GPU machine (``--device cuda``) the engines are the plain module,
torch.nn.DataParallel and tandem.DataParallel (both modes) over all GPUs.

Run::

    python benchmarks/dp.py --pairs 7 --steps 20
    python benchmarks/dp.py --device cuda --pairs 7     # on a GPU machine
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import tandem
from ddp_throughput import MODELS  # the same MLP and conv net as the DDP benchmark
from tandem.parallel.dp.wrapper import DataParallel

RESULTS = Path(__file__).resolve().parent / "results"
# Global batch per model: twice ddp_throughput's per-rank batch, so DDP's ranks see the same.
GLOBAL_BATCH = {"mlp": 128, "convnet": 64}
CPU_ENGINES = ("module", "module 2t", "DP", "DP balanced", "DDP")
CUDA_ENGINES = ("module", "torch DP", "DP", "DP balanced")


def lm_head() -> nn.Module:
    """Small body, wide output: the gathered output dwarfs everything else on the device."""
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 16384))


def _batches(name: str, steps: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    _, shape, _ = MODELS[name]
    g = torch.Generator().manual_seed(1)
    n = GLOBAL_BATCH[name]
    return [
        (torch.randn(n, *shape, generator=g).to(device), torch.randint(0, 10, (n,), generator=g))
        for _ in range(steps)
    ]


def _step_fn(engine: str, model: nn.Module):
    """The training step's loss for each engine; the balanced mode computes it in the replicas."""
    if engine == "DP balanced":
        return lambda x, y: model.loss(x, target=y)
    return lambda x, y: F.cross_entropy(model(x), y.to(x.device))


def _build(engine: str, name: str, device: torch.device) -> tuple:
    torch.manual_seed(0)
    model = MODELS[name][0]().to(device)
    ids = list(range(torch.cuda.device_count())) if device.type == "cuda" else ["cpu", "cpu"]
    if engine == "torch DP":
        model = nn.DataParallel(model, device_ids=ids)
    elif engine.startswith("DP"):
        loss_fn = F.cross_entropy if engine == "DP balanced" else None
        model = DataParallel(model, device_ids=ids, loss_fn=loss_fn)
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def _round(engine: str, model: nn.Module, opt, batches, device: torch.device) -> float:
    """Seconds for one round of steps in this process."""
    torch.set_num_threads(2 if engine == "module 2t" else 1)
    loss_of = _step_fn(engine, model)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss_of(x, y).backward()
        opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    torch.set_num_threads(1)
    return elapsed


def _ddp_worker(rank: int, world: int, port: int, args, commands, results) -> None:
    """One DDP rank: trains on its half of each global batch, one round per "go" command."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for name in args.models:
        torch.manual_seed(0)
        model = tandem.DDP(MODELS[name][0]())
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        half = GLOBAL_BATCH[name] // world
        batches = [
            (x[rank * half : (rank + 1) * half], y[rank * half : (rank + 1) * half])
            for x, y in _batches(name, args.steps, torch.device("cpu"))
        ]
        while commands[rank].get() == "go":
            dist.barrier()  # both ranks start together: a round is the slower rank's time
            elapsed = torch.tensor([_round("DDP", model, opt, batches, torch.device("cpu"))])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if rank == 0:
                results.put(elapsed.item())
    dist.barrier()
    dist.destroy_process_group()


def _throughput(args, device: torch.device) -> dict:
    engines = CUDA_ENGINES if device.type == "cuda" else CPU_ENGINES
    ctx = mp.get_context("spawn")
    commands = [ctx.Queue() for _ in range(2)]
    results = ctx.Queue()
    ddp = None
    if "DDP" in engines:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        worker_args = (2, port, args, commands, results)
        ddp = mp.start_processes(
            _ddp_worker, worker_args, nprocs=2, join=False, start_method="spawn"
        )

    def ddp_round() -> float:
        for q in commands:
            q.put("go")
        return results.get(timeout=600)

    report = {}
    for name in args.models:
        batches = _batches(name, args.steps, device)
        local = {e: _build(e, name, device) for e in engines if e != "DDP"}
        for e, (model, opt) in local.items():
            _round(e, model, opt, batches[: args.warmup], device)
        if ddp is not None:
            ddp_round()  # warm-up (and bucket rebuild) of the DDP ranks
        times: dict[str, list[float]] = {e: [] for e in engines}
        for pair in range(args.pairs):
            for e in engines if pair % 2 == 0 else engines[::-1]:
                times[e].append(
                    ddp_round() if e == "DDP" else _round(e, *local[e], batches, device)
                )
        if ddp is not None:
            for q in commands:
                q.put("next model")
        rate = {e: [args.steps / t for t in times[e]] for e in engines}
        report[name] = {
            "params": sum(p.numel() for p in MODELS[name][0]().parameters()),
            "global_batch": GLOBAL_BATCH[name],
            "steps_per_s": {e: statistics.median(rate[e]) for e in engines},
            "ratio_over_module": {
                e: statistics.median(a / b for a, b in zip(rate[e], rate["module"], strict=True))
                for e in engines
            },
            "rounds_steps_per_s": rate,
        }
    if ddp is not None:
        ddp.join()
    return report


def _gathered(args, device: torch.device) -> dict:
    """Bytes gathered onto the output device per step (and, on CUDA, its peak memory)."""
    ids = list(range(torch.cuda.device_count())) if device.type == "cuda" else ["cpu", "cpu"]
    cases = {name: (MODELS[name][0], _batches(name, 1, device)[0]) for name in args.models}
    g = torch.Generator().manual_seed(2)
    x = torch.randn(args.lm_batch, 256, generator=g).to(device)
    cases["lm_head"] = (lm_head, (x, torch.randint(0, 16384, (args.lm_batch,), generator=g)))
    report = {}
    for name, (factory, (x, y)) in cases.items():
        torch.manual_seed(0)
        row = {}
        for mode in ("DP", "DP balanced"):
            model = DataParallel(
                factory().to(device),
                device_ids=ids,
                loss_fn=F.cross_entropy if mode == "DP balanced" else None,
            )
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(model.output_device)
            _step_fn(mode, model)(x, y.to(device)).backward()
            row[mode] = {"gathered_bytes": model.last_gathered_bytes}
            if device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(model.output_device)
                row[mode]["output_device_peak_bytes"] = peak
        report[name] = row
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--models", nargs="+", default=list(GLOBAL_BATCH), choices=GLOBAL_BATCH)
    parser.add_argument("--lm-batch", type=int, default=256)
    parser.add_argument("--json", type=Path, default=RESULTS / "dp.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")

    load_before = os.getloadavg()[0]
    throughput = _throughput(args, device)
    gathered = _gathered(args, device)
    meta = {
        # On a shared machine other jobs' load skews every engine, the two-thread ones most.
        "load_average_1min": [load_before, os.getloadavg()[0]],
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.machine(),
        "devices": torch.cuda.device_count() if device.type == "cuda" else 2,
        "cpus": os.cpu_count(),
        "pairs": args.pairs,
        "steps_per_round": args.steps,
        "torch": torch.__version__,
    }
    result = {"meta": meta, "throughput": throughput, "gathered": gathered}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))

    engines = list(next(iter(throughput.values()))["steps_per_s"])
    print(
        f"Training steps/s, {meta['device']} ({meta['cpus']} CPUs, load average "
        f"{load_before:.1f} -> {meta['load_average_1min'][1]:.1f}), "
        f"{args.pairs} rounds x {args.steps} steps (median; ratio = median of per-round "
        "ratios to module)"
    )
    print("| model | params | global batch | " + " | ".join(engines) + " |")
    print("|---|---:|---:|" + "---:|" * len(engines))
    for name, r in throughput.items():
        cells = [f"{r['steps_per_s'][e]:.1f} ({r['ratio_over_module'][e]:.2f}x)" for e in engines]
        row = [name, f"{r['params'] / 1e6:.2f} M", str(r["global_batch"]), *cells]
        print("| " + " | ".join(row) + " |")
    print()
    print("Gathered onto the output device per step (plain DP against balanced)")
    peak = device.type == "cuda"
    head = " | peak DP | peak balanced" if peak else ""
    print(f"| model | DP bytes | balanced bytes | ratio{head} |")
    print("|---|---:|---:|---:|" + ("---:|---:|" if peak else ""))
    for name, r in gathered.items():
        a, b = r["DP"]["gathered_bytes"], r["DP balanced"]["gathered_bytes"]
        cells = [f"{a:,}", f"{b:,}", f"{a / b:,.0f}x"]
        if peak:
            cells += [f"{r[m]['output_device_peak_bytes'] / 2**20:.1f} MiB" for m in r]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"JSON: {args.json}")
    return result


if __name__ == "__main__":
    main()
