"""How long a checkpoint holds the training loop: synchronous, in the background, torch DCP's.

WORLD ranks (2), Gloo, one intra-op thread each, hold the same model (``Linear(5000, 5000)``
layers: 4 of them are 100M parameters, a 400 MB float32 checkpoint; 16 are 400M, 1.6 GB). The
state saved is ``{"model": model}`` (rank 0 writes it; the others hold the same weights). Each
trial saves it once in each way, A B C then C B A, after a barrier:

- ``sync``: ``tandem.checkpoint.save(state, path)``: the loop is held for the whole save;
- ``async``: ``tandem.checkpoint.save(state, path, async_=True)``: held while the state is
  copied into the staging memory; then ``wait()`` for the background write;
- ``dcp async``: ``torch.distributed.checkpoint.async_save({"model": model.state_dict()},
  checkpoint_id=dir)`` with its default stager (a new copy every save) and writer; then
  ``result()``;
- ``dd``: ``dd if=/dev/zero bs=4M conv=fsync`` of the checkpoint's size into the same folder
  (rank 0): what the disk takes, the limit of any writer.

A trial's held time is the slowest rank's; a write's time runs from the call to the commit
(``wait()``/``result()`` returning). Trial 0 warms up (the staging memory is allocated there,
once) and is not counted. Reported: the medians, the median per-trial ratio async / sync (the
issue's target: <= 0.15) and async / dcp async, each writer's throughput (checkpoint bytes per
second of its write) against dd's, and the staging memory each rank holds.

Then, with ``--step-model``: the step time of tandem.DDP training that model (batch 1 per
rank, SGD) while a write runs beside it, in rounds of phases run back to back (order
alternating; ``--phases`` picks them): no write; tandem's background write (a thread of the
training process, in the idle scheduling class: ``tandem.checkpoint.async_save.yield_cpu``,
each file hashed as it is written: ``tandem.files.write_temp_digested``); and that write with
one thing changed: ``thread, paced`` at most ``--pace`` MB/s (``WRITER.bytes_per_s``);
``thread, read back`` each file read back after its fsync to hash it (the write before it
hashed as it wrote); ``thread, no crc`` without torch's zip crc32 (a global torch setting);
``thread, no yield`` at the training's priority (``WRITER.idle = False``); ``process``: the
same bytes written, fsynced and hashed by another process at the training's priority (no GIL
shared with the training). The steps that began before the write finished are the ones
counted, each with its wall-clock time and the CPU time of the thread that ran it (what the
write's memory traffic costs the step's own work, which other programs' load does not
inflate), and each write's length (call to commit, rank 0) is kept, with each round's load
average: the machine is shared, so a round's phases are compared with each other only.

Run::

    python benchmarks/checkpoint.py                       # 100M and 400M, 5 trials
    python benchmarks/checkpoint.py --models 100M --trials 3 --rounds 2
    python benchmarks/checkpoint.py --models --rounds 8 --json /tmp/steps.json   # steps only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn

import tandem
import tandem.checkpoint
from elastic_reform import free_port  # a script beside this one
from tandem import files
from tandem.checkpoint import run_dir, shards
from tandem.checkpoint.async_save import WRITER

HERE = Path(__file__).resolve().parent
DEFAULT_JSON = HERE.parent / "docs" / "performance" / "checkpoint-cpu.json"
WIDTH = 5000
MODELS = {"tiny": (64, 2), "100M": (WIDTH, 4), "400M": (WIDTH, 16)}  # (width, layers)
ARMS = ("sync", "async", "dcp async", "dd")
PHASES = (
    "none", "thread", "thread, paced", "thread, read back", "thread, no crc", "thread, no yield",
    "process",
)  # fmt: skip

# The other process of the "process" phase: the same bytes, written as tandem writes them.
WRITER_SCRIPT = """
import hashlib, os, sys, time, torch
blob = torch.ones(int(sys.argv[1]), dtype=torch.uint8)
print("ready", flush=True)
for line in sys.stdin:
    path = sys.argv[2]
    begun = time.monotonic()
    with open(path, "wb") as f:
        torch.save(blob, f)
        f.flush()
        os.fsync(f.fileno())
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 << 20):
            digest.update(chunk)
    os.unlink(path)
    print("done", time.monotonic() - begun, flush=True)
"""


def _model(name: str) -> nn.Module:
    width, layers = MODELS[name]
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _dd(folder: Path, nbytes: int) -> float:
    """dd's write rate into ``folder``, bytes/s, with an fsync at the end (counted)."""
    target = folder / "dd.bin"
    blocks = max(1, -(-nbytes // (4 << 20)))
    run = subprocess.run(
        ["dd", "if=/dev/zero", f"of={target}", "bs=4M", f"count={blocks}", "conv=fsync"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    target.unlink()
    found = re.search(r"(\d+) bytes .* copied, ([\d.e+-]+) s", run.stderr)
    assert found is not None, run.stderr
    return int(found[1]) / float(found[2])


def _save(arm: str, state: dict[str, Any], folder: Path) -> tuple[float, float, int]:
    """(seconds held, seconds to the commit, bytes written) of one save, on this rank."""
    begun = time.perf_counter()
    if arm == "sync":
        path = tandem.checkpoint.save(state, folder / "ckpt.pt")
        held = done = time.perf_counter() - begun
    elif arm == "async":
        handle = tandem.checkpoint.save(state, folder / "ckpt.pt", async_=True)
        held = time.perf_counter() - begun
        path = handle.wait()
        done = time.perf_counter() - begun
    else:
        future = dcp.async_save({"model": state["model"].state_dict()}, checkpoint_id=folder)
        held = time.perf_counter() - begun
        future.result()
        done = time.perf_counter() - begun
        path = folder
    written = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if path else 0
    return held, done, written


def _blocked(name: str, args: argparse.Namespace, rank: int) -> dict[str, Any]:
    model = _model(name)
    state = {"model": model}
    params = sum(p.numel() for p in model.parameters())
    root = Path(args.dir) / name
    held: dict[str, list[float]] = {a: [] for a in ARMS}
    done: dict[str, list[float]] = {a: [] for a in ARMS}
    sizes: dict[str, int] = {}
    for trial in range(args.trials + 1):
        order = ARMS if trial % 2 == 0 else ARMS[::-1]
        for arm in order:
            folder = root / f"{arm.replace(' ', '-')}-{trial}"
            if rank == 0:
                folder.mkdir(parents=True)
            dist.barrier()
            if arm == "dd":
                rate = _dd(folder, sizes.get("sync", params * 4)) if rank == 0 else 0.0
                seconds = sizes.get("sync", params * 4) / rate if rank == 0 else 0.0
                h = d = _slowest(seconds)
            else:
                h, d, nbytes = _save(arm, state, folder)
                h, d = _slowest(h), _slowest(d)
                if rank == 0:
                    sizes[arm] = nbytes
            if trial > 0:
                held[arm].append(h)
                done[arm].append(d)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(folder)
    staging = [None] * dist.get_world_size()
    dist.all_gather_object(staging, WRITER.staging.nbytes)
    if rank != 0:
        return {}  # the sizes are rank 0's
    ratio = [a / s for a, s in zip(held["async"], held["sync"], strict=True)]
    over_dcp = [a / s for a, s in zip(held["async"], held["dcp async"], strict=True)]
    nbytes = sizes["sync"]
    return {
        "params": params,
        "checkpoint_bytes": nbytes,
        "held_s": {a: statistics.median(held[a]) for a in ARMS if a != "dd"},
        "write_s": {a: statistics.median(done[a]) for a in ARMS},
        "trials_held_s": held,
        "trials_write_s": done,
        "ratio_async_over_sync": statistics.median(ratio),
        "ratio_async_over_dcp_async": statistics.median(over_dcp),
        "ratios": ratio,
        "write_bytes_per_s": {a: sizes.get(a, nbytes) / statistics.median(done[a]) for a in ARMS},
        "staging_bytes_per_rank": staging,
    }


def _read_back(directory: Path, name: str, write: Any, algorithm: str = "sha256") -> Any:
    """The write before it hashed as it wrote: the file written, then read back to hash it."""
    tmp = files.write_temp(directory, name, write)
    return tmp, files.file_digest(tmp, algorithm)


@contextlib.contextmanager
def _variant(phase: str, pace: float | None) -> Iterator[None]:
    """The writer as ``phase`` writes: ``thread`` is tandem's (idle class, hashed as written,
    not paced); each other thread phase changes one thing of it (``thread, paced``: at most
    ``pace`` bytes/s)."""
    WRITER.idle = phase != "thread, no yield"
    WRITER.bytes_per_s = pace if phase == "thread, paced" else None
    undo: list[tuple[Any, str, Any]] = []
    if phase == "thread, read back":
        for module in (run_dir, shards):
            undo.append((module, "write_temp_digested", module.write_temp_digested))
            module.write_temp_digested = _read_back  # type: ignore[attr-defined]
    crc = torch.serialization.get_crc32_options()
    if phase == "thread, no crc":  # torch's zip records without their crc32 (a pass fewer)
        torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        WRITER.idle, WRITER.bytes_per_s = True, None
        torch.serialization.set_crc32_options(crc)
        for module, attribute, value in undo:
            setattr(module, attribute, value)


def _steps(name: str, args: argparse.Namespace, rank: int) -> dict[str, Any]:
    """Step times of tandem.DDP with no write, a background write (yielding the CPU, and not),
    another process's write; and each write's length."""
    model = tandem.DDP(_model(name))
    opt = torch.optim.SGD(model.parameters(), lr=1e-9)
    x = torch.randn(1, MODELS[name][0])
    state = {"model": model}
    nbytes = 4 * sum(p.numel() for p in model.parameters())
    folder = Path(args.dir) / f"steps-{name}"
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
    other = None
    if rank == 0:
        other = subprocess.Popen(
            [sys.executable, "-c", WRITER_SCRIPT, str(nbytes), str(folder / "other.bin")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert other.stdout is not None and other.stdout.readline().strip() == "ready"

    def step() -> tuple[float, float]:
        """The step's wall-clock seconds, and the CPU seconds of the thread that ran it."""
        begun, cpu = time.perf_counter(), time.thread_time()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - begun, time.thread_time() - cpu

    pace = args.pace * 1e6
    for _ in range(2):
        step()  # warm-up: DDP's bucket rebuild
    tandem.checkpoint.save(state, folder / "warm.pt", async_=True).wait()  # staging allocated
    phases = [p for p in PHASES if p in args.phases]
    times: dict[str, list[float]] = {p: [] for p in phases}
    writes: dict[str, list[float]] = {p: [] for p in phases if p != "none"}
    rounds: list[dict[str, float]] = []  # each round's median step per phase
    rounds_cpu: list[dict[str, float]] = []  # the same, of the steps' CPU seconds
    loads: list[float] = []  # the load average (1 minute) at each round's end
    for round_ in range(args.rounds):
        steps: dict[str, list[float]] = {p: [] for p in phases}
        cpus: dict[str, list[float]] = {p: [] for p in phases}
        order = phases if round_ % 2 == 0 else phases[::-1]
        for phase in order:
            dist.barrier()
            writing: Any = None
            variant = _variant(phase, pace)
            variant.__enter__()
            if phase.startswith("thread"):
                writing = tandem.checkpoint.save(state, folder / "bg.pt", async_=True)
            elif phase == "process" and other is not None:
                assert other.stdin is not None
                other.stdin.write("go\n")
                other.stdin.flush()
            finished = _finished(phase, writing, other)
            for _ in range(args.steps):
                busy = not finished()
                seconds, cpu = step()
                # Only the steps that began while the write ran (all of them with no write).
                counted = _slowest(seconds if (busy or phase == "none") else -1.0)
                if counted >= 0:
                    steps[phase].append(counted)
                    cpus[phase].append(_slowest(cpu))
            if writing is not None:
                writing.wait()
            variant.__exit__(None, None, None)
            while not finished():  # every rank: rank 0 says when the other process is done
                time.sleep(0.01)
            if phase != "none" and rank == 0:
                writes[phase].append(writing.written_s if writing else finished.seconds)
        for phase, taken in steps.items():
            times[phase] += taken
        rounds.append({p: statistics.median(t) for p, t in steps.items() if t})
        rounds_cpu.append({p: statistics.median(t) for p, t in cpus.items() if t})
        loads.append(os.getloadavg()[0])
    if other is not None:
        assert other.stdin is not None
        other.stdin.close()
        other.wait()
    if rank == 0:
        shutil.rmtree(folder)
    median = {p: statistics.median(times[p]) if times[p] else None for p in phases}
    pairs = [(a, "none") for a in phases if a != "none"]
    pairs += [("thread", p) for p in phases if p.startswith(("thread, ", "process"))]

    def paired(rounds: list[dict[str, float]]) -> dict[str, float]:
        """The median of the rounds' ratios: a round's phases ran back to back."""
        return {
            f"{a}/{b}": statistics.median(r[a] / r[b] for r in rounds if a in r and b in r)
            for a, b in pairs
            if any(a in r and b in r for r in rounds)
        }

    numbers = {p: len(times[p]) for p in phases}
    write_s = {p: statistics.median(w) if w else None for p, w in writes.items()}
    return {
        "steps_counted": numbers,
        "step_s": median,
        "ratios": paired(rounds),
        "rounds": rounds,
        # The training thread's CPU time per step: what the write's memory traffic costs the
        # step, without the time other programs' threads took the core (a busy machine).
        "cpu_ratios": paired(rounds_cpu),
        "rounds_cpu": rounds_cpu,
        "load_average_per_round": loads,
        "pace_MB_per_s": args.pace,
        "write_s": write_s,
        "trials_write_s": writes,
    }


class _finished:
    """A check whether this phase's write is done (on rank 0; the others follow it); once it
    is, ``seconds``: how long another process's write took (its own report)."""

    def __init__(self, phase: str, writing: Any, other: Any) -> None:
        self.phase, self.writing, self.other = phase, writing, other
        self.done = phase == "none"
        self.seconds = 0.0

    def __call__(self) -> bool:
        if not self.done:
            if self.writing is not None:
                self.done = self.writing.done()
            elif self.other is not None and select.select([self.other.stdout], [], [], 0)[0]:
                word, seconds = self.other.stdout.readline().split()
                self.done, self.seconds = word == "done", float(seconds)
        flag = torch.tensor([1 if self.done else 0])
        dist.broadcast(flag, 0)  # every rank counts the same steps
        return bool(flag.item())


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, box: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    report = {name: _blocked(name, args, rank) for name in args.models}
    if args.step_model:
        report.setdefault(args.step_model, {})["steps"] = _steps(args.step_model, args, rank)
    if rank == 0:
        box.put(report)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--models", nargs="*", default=["100M", "400M"], choices=list(MODELS))
    parser.add_argument("--trials", type=int, default=5, help="counted trials (after one more)")
    parser.add_argument("--step-model", default="100M", help="'' for no step-time phases")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the step phases")
    parser.add_argument("--steps", type=int, default=4, help="steps per phase")
    parser.add_argument(
        "--pace", type=float, default=100, help="the bound of the 'thread, paced' phase, MB/s"
    )
    parser.add_argument(
        "--phases", nargs="+", default=list(PHASES), choices=PHASES, help="step phases to run"
    )
    parser.add_argument("--dir", type=Path, default=None, help="where to write (a temp dir)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)

    # Rank 0 puts its report in the queue; the ranks are spawned, so torch starts afresh.
    report_box = mp.get_context("spawn").SimpleQueue()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="tandem-ckpt-bench-") as where:
        args.dir = where
        world = (args.world, free_port(), args, report_box)
        mp.spawn(_worker, args=world, nprocs=args.world, join=True)
    report = report_box.get()
    meta = {
        "ranks (Gloo, 1 thread each)": args.world,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "trials, rounds, steps per phase": [args.trials, args.rounds, args.steps],
        "torch": torch.__version__,
        "load_average_before_after": [load_before[0], os.getloadavg()[0]],
        "date": time.strftime("%Y-%m-%d"),
    }
    result = {"meta": meta, "models": report}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))

    print(
        f"Checkpoint saves, {args.world} ranks, Gloo, {meta['machine']} "
        f"(load average {load_before[0]:.1f} before), {args.trials} trials, medians"
    )
    print(
        "| model | checkpoint | sync held s | async held s | dcp async held s | "
        "async/sync | async/dcp | staging per rank |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    saved = {name: r for name, r in report.items() if "held_s" in r}
    for name, r in saved.items():
        h = r["held_s"]
        staging = ", ".join(f"{b / 1e6:.0f} MB" for b in r["staging_bytes_per_rank"])
        print(
            f"| {name} | {r['checkpoint_bytes'] / 1e6:.0f} MB | {h['sync']:.3f} | "
            f"{h['async']:.3f} | {h['dcp async']:.3f} | {r['ratio_async_over_sync']:.3f} | "
            f"{r['ratio_async_over_dcp_async']:.3f} | {staging} |"
        )
    print("\nWrites: seconds from the call to the commit, and checkpoint MB/s (dd: the disk)")
    print(
        "| model | sync s | async s | dcp async s | dd s | sync MB/s | async MB/s | dcp MB/s "
        "| dd MB/s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in saved.items():
        w, rate = r["write_s"], r["write_bytes_per_s"]
        print(
            f"| {name} | {w['sync']:.2f} | {w['async']:.2f} | {w['dcp async']:.2f} | "
            f"{w['dd']:.2f} | " + " | ".join(f"{rate[a] / 1e6:.0f}" for a in ARMS) + " |"
        )
    for name, r in report.items():
        if "steps" not in r:
            continue
        s, n, ratios = r["steps"]["step_s"], r["steps"]["steps_counted"], r["steps"]["ratios"]
        w, cpu = r["steps"]["write_s"], r["steps"]["cpu_ratios"]
        loads = r["steps"]["load_average_per_round"]
        print(f"\nStep time of tandem.DDP on {name} while a checkpoint is written")
        print("(median s (steps counted); ratios: the median over rounds of each round's ratio;")
        print(f" load average over the rounds {min(loads):.1f} to {max(loads):.1f})")
        print("| phase | step s | step / no write | step CPU / no write | write s |")
        print("|---|---:|---:|---:|---:|")
        for phase in s:
            ratio, cpu_ratio = ratios.get(f"{phase}/none"), cpu.get(f"{phase}/none")
            cells = [
                phase,
                f"{s[phase]:.3f} ({n[phase]})" if s[phase] is not None else "-",
                f"{ratio:.3f}" if ratio is not None else "-",
                f"{cpu_ratio:.3f}" if cpu_ratio is not None else "-",
                f"{w[phase]:.2f}" if w.get(phase) is not None else "-",
            ]
            print(f"| {' | '.join(cells)} |")
        for pair, ratio in ratios.items():
            if pair.startswith("thread/"):
                print(f"{pair}: {ratio:.3f}")
    print(f"JSON: {args.json}")
    return result


if __name__ == "__main__":
    main()
