"""tandem against torch on one GPU: step time and peak memory of DDP and FSDP at world size 1.

One process makes a process group of one rank (NCCL on ``cuda:0``; ``--device cpu``: Gloo)
and trains each row's model under both engines, built from the same initial weights and fed
the same batch. Rows:

- ``gpt2``: ``tandem.DDP`` against torch's ``DistributedDataParallel`` on a GPT-2-small-sized
  transformer written here in plain torch (12 layers, d=768, 12 heads, vocab 50257, 1024
  positions, head tied to the embedding: 124.4 M parameters in 148 tensors), AdamW;
- ``deep400``: the same pair on 200 ``Linear(256, 256)`` + Tanh (400 parameter tensors, 13 M
  parameters), SGD with momentum: the per-tensor cost of the engines, where the step is short
  and mostly launches (Python hooks against torch's C++ ones);
- ``resnet50``: the same pair on ``torchvision.models.resnet50(weights=None)`` (161 tensors,
  25.6 M parameters, 53 BatchNorms whose buffers DDP broadcasts), SGD with momentum; "skipped:
  torchvision not installed" without torchvision, and the run goes on;
- ``fsdp_gpt2``: ``tandem.FullyShardedDataParallel`` (stage 3, each transformer block a unit
  of its own, the rest in the root's) against torch's FSDP2 (``fully_shard`` on each block,
  then on the root) on the ``gpt2`` model, AdamW.

Default batches, chosen for steps of 10-60 ms on an H100 (estimates; the table gives the
measured ms): ``gpt2`` and ``fsdp_gpt2`` 16 sequences of 512 tokens (about 6.6 TFLOP per step
in bf16, with flash attention: 20-40 ms); ``deep400`` 1024 samples (some 2,000 small kernels
and 400 hooks a step: bound by the host's launches and hooks, 15-30 ms); ``resnet50`` 64
images of 224x224 (about 0.8 TFLOP per step and a memory-bound BatchNorm pass per conv: 25-40
ms). ``--tiny`` shrinks everything (GPT 2x32 with vocab 100, 20 tensors of 16, ResNet-50 on
32x32 images, batches of 2-8) for a rehearsal on the CPU.

What each engine runs at world size 1 (read from both engines' code):

- ``tandem.DDP``: a post-accumulate-grad hook per parameter (Python), gradients copied into
  the buckets (one bucket at the first step, rebuilt at the second in the order gradients
  came), but no all-reduce (a one-rank reducer hands back an already-completed future), no
  buffer broadcast and no bucket-order broadcast; the bucket contents are then handed back to
  ``.grad`` (large gradients become views of the bucket, small ones copied back in one call);
  the end-of-backward check keeps its counts on the host (no collective, no copy).
- torch DDP: its C++ reducer, the same hooks, bucket copies and rebuild, plus one NCCL
  all-reduce per bucket on a one-rank communicator, and a broadcast of the module's buffers
  before each forward (ResNet-50's BatchNorm statistics; the other models have no buffers).
- ``tandem.FullyShardedDataParallel`` stage 3: per unit, forward copies the shard into the
  gathered buffer (no all-gather at one rank), frees it after forward, copies it again in
  backward; the flat gradient is the shard's gradient (no reduce-scatter, no division).
- torch FSDP2: at one rank it skips its collectives too (torch's world-size-1 path, since
  about 2.9): per unit, the shard is copied into the unsharded parameters before forward and
  again before backward, and the gradients are copied into the reduce-scatter buffer and from
  it into the shard's gradient.

Rather than trust this reading, the second table shows the collectives one step of each engine
issues (the ``c10d::`` operators in torch's profiler) and, on a GPU, the host synchronizations
in one step (below).

Once a tandem engine is built, tandem records every ``torch.distributed`` collective of the
process (``tandem.doctor.records``); the records are switched off while torch's engines run,
so that FSDP2's Python collectives do not pay for tandem's bookkeeping.

Method: each engine warms up (``--warmup`` steps: the bucket rebuild at the second, the
allocator's cache), then pairs: ``--steps`` steps of one engine then of the other, which one
goes first alternating each pair; each round of steps is timed with ``torch.cuda.synchronize()``
before and after. A step is ``zero_grad(set_to_none=True)``, forward and loss under bf16
autocast (``--precision``; parameters, gradients and optimizer state stay float32; TF32
matmuls on for both engines), backward and ``optimizer.step()`` (``fused=False``, torch's
default foreach implementation on CUDA). Reported per row: each engine's median ms per step
over the pairs, the median of the per-pair ratios torch ms / tandem ms (tandem's throughput
over torch's: above 1 means tandem is faster) with its range, and whether it meets the issue's
target, at least 0.98.

Peak memory: before either engine is built, two forward and backward passes of the bare model
take the one-time allocations (cuBLAS workspaces, cuDNN's algorithm search); then each engine,
as it warms up just after it is built (so the engine built first is not counted in the other's
number): ``torch.cuda.reset_peak_memory_stats()`` after its first step, then
``torch.cuda.max_memory_allocated()`` over its next warm-up steps (the bucket rebuild among
them), minus what the process held before the engine was built: the engine's own model,
gradients, optimizer state, buckets and activations at their peak. Reported in MiB with the
difference tandem - torch.

Host synchronizations: one more step of each engine under
``torch.cuda.set_sync_debug_mode("warn")``, whose warnings are counted (blocking copies and
stream synchronizations; an event's ``synchronize()`` is not reported): a step that makes the
host wait for the GPU leaves the GPU idle while the host launches the next kernels.

Time: ``--budget-s`` (default 140 s, counted from after the imports, which take a few seconds
more) bounds the run: each row gets an equal share of what is left when it starts, and stops
adding pairs when the next pair would pass its share; a row that starts after the budget is
spent is reported as skipped. The defaults (9 pairs x 10 steps, steps of 10-40 ms) should take
about 45-70 s on an H100, most of it building and warming up.

Run::

    python benchmarks/gpu.py                          # on the GPU machine (NCCL, cuda:0)
    python benchmarks/gpu.py --rows gpt2 fsdp_gpt2 --pairs 15 --steps 20 --budget-s 300
    python benchmarks/gpu.py --precision fp32 --gpt-batch 8
    python benchmarks/gpu.py --device cpu --tiny      # seconds, Gloo: keeps the script alive
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import os
import platform
import socket
import statistics
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import tandem
from tandem.doctor import records

RESULTS = Path(__file__).resolve().parent / "results"
MIB = 2**20
TARGET = 0.98  # tandem/torch throughput, every row (issue 24)
ENGINES = ("tandem", "torch")
ROWS = ("gpt2", "deep400", "resnet50", "fsdp_gpt2")

WHAT_RUNS = {
    "DDP": {
        "tandem": "Python hooks, bucket copies and rebuild, no all-reduce or buffer broadcast at "
        "one rank, buckets handed back to .grad",
        "torch": "C++ reducer: hooks, bucket copies and rebuild, one NCCL all-reduce per bucket "
        "(one rank), buffers broadcast before each forward",
    },
    "FSDP stage 3": {
        "tandem": "per unit: shard copied into the gathered buffer (forward and backward), freed "
        "after each; no collective at one rank",
        "torch": "FSDP2 per unit: no collective at one rank (torch skips them): shard copied "
        "into the unsharded parameters forward and backward, gradients copied through the "
        "reduce-scatter buffer",
    },
}


# -- the models --------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
            for z in self.qkv(x).split(d, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # flash attention on a GPU
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """One pre-norm GPT-2 block: 12 parameter tensors; each engine's FSDP unit."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """GPT-2's shape: token and position embeddings, blocks, final LayerNorm, tied head."""

    def __init__(self, vocab: int, positions: int, d: int, layers: int, heads: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(positions, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight
        for m in self.modules():  # GPT-2's initialization
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def deep(tensors: int, width: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(tensors // 2):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


@dataclass
class Sizes:
    vocab: int = 50257
    positions: int = 1024
    d: int = 768
    layers: int = 12
    heads: int = 12
    context: int = 512
    gpt_batch: int = 16
    deep_tensors: int = 400
    deep_width: int = 256
    deep_batch: int = 1024
    resnet_batch: int = 64
    resnet_image: int = 224


TINY = Sizes(
    vocab=100, positions=16, d=32, layers=2, heads=2, context=16, gpt_batch=2,
    deep_tensors=20, deep_width=16, deep_batch=8, resnet_batch=2, resnet_image=32,
)  # fmt: skip


@dataclass
class Workload:
    """One row: the model (built once, copied for each engine), its batch and its loss."""

    row: str
    kind: str  # "DDP" or "FSDP stage 3"
    model: str  # what the table shows
    base: nn.Module  # on the CPU; each engine trains a deep copy
    batch: tuple[torch.Tensor, torch.Tensor]  # on the device
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    optimizer: str  # "adamw" or "sgd"
    batch_desc: str


def _lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def workload(row: str, sizes: Sizes, device: torch.device) -> Workload | str:
    """The row's workload, or why it cannot run here."""
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    if row in ("gpt2", "fsdp_gpt2"):
        s = sizes
        base: nn.Module = GPT(s.vocab, s.positions, s.d, s.layers, s.heads)
        shape = (s.gpt_batch, s.context)
        x = torch.randint(0, s.vocab, shape, generator=g)
        y = torch.randint(0, s.vocab, shape, generator=g)
        kind = "FSDP stage 3" if row == "fsdp_gpt2" else "DDP"
        name = f"GPT {s.layers}x{s.d}, {s.heads} heads, vocab {s.vocab}"
        return Workload(
            row, kind, name, base, (x.to(device), y.to(device)), _lm_loss, "adamw",
            f"{s.gpt_batch}x{s.context} tokens",
        )  # fmt: skip
    if row == "deep400":
        base = deep(sizes.deep_tensors, sizes.deep_width)
        x = torch.randn(sizes.deep_batch, sizes.deep_width, generator=g)
        y = torch.randint(0, sizes.deep_width, (sizes.deep_batch,), generator=g)
        name = f"{sizes.deep_tensors // 2} x Linear({sizes.deep_width}, {sizes.deep_width})+Tanh"
        return Workload(
            row, "DDP", name, base, (x.to(device), y.to(device)), F.cross_entropy, "sgd",
            str(sizes.deep_batch),
        )  # fmt: skip
    if row == "resnet50":
        try:
            import torchvision
        except ImportError:
            return "skipped: torchvision not installed"
        base = torchvision.models.resnet50(weights=None)
        side = sizes.resnet_image
        x = torch.randn(sizes.resnet_batch, 3, side, side, generator=g)
        y = torch.randint(0, 1000, (sizes.resnet_batch,), generator=g)
        return Workload(
            row, "DDP", "torchvision ResNet-50", base, (x.to(device), y.to(device)),
            F.cross_entropy, "sgd", f"{sizes.resnet_batch}x3x{side}x{side}",
        )  # fmt: skip
    raise ValueError(f"unknown row {row!r}")


# -- the engines -------------------------------------------------------------------------------


@dataclass
class Engine:
    model: nn.Module
    opt: torch.optim.Optimizer


def build(w: Workload, engine: str, device: torch.device, mesh: Any) -> Engine:
    module = copy.deepcopy(w.base).to(device)
    if w.kind == "DDP":
        ids = [device.index] if device.type == "cuda" else None
        if engine == "tandem":
            model: nn.Module = tandem.DDP(module, device_ids=ids)
        else:
            model = TorchDDP(module, device_ids=ids)
    elif engine == "tandem":
        model = tandem.FullyShardedDataParallel(module, stage=3, auto_wrap={Block})
    else:
        from torch.distributed.fsdp import fully_shard

        for block in module.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(module, mesh=mesh)
        model = module
    if w.optimizer == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=False)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, fused=False)
    return Engine(model, opt)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_steps(
    e: Engine, w: Workload, n: int, autocast: Any, device: torch.device, sync: bool = True
) -> float:
    """Seconds for ``n`` steps, the device synchronized before and after (unless ``sync`` is
    false)."""
    x, y = w.batch
    if sync:
        _sync(device)
    start = time.perf_counter()
    for _ in range(n):
        e.opt.zero_grad(set_to_none=True)
        with autocast():
            loss = w.loss(e.model(x), y)
        loss.backward()
        e.opt.step()
    if sync:
        _sync(device)
    return time.perf_counter() - start


@contextmanager
def _in_engine(engine: str) -> Iterator[None]:
    """tandem's collective records on for tandem's steps only (see the module doc)."""
    records.enabled = engine == "tandem"
    try:
        yield
    finally:
        records.enabled = True


def plain_warmup(w: Workload, autocast: Any, device: torch.device) -> None:
    """Two forward and backward passes of the bare model, before either engine is built: the
    one-time allocations (cuBLAS workspaces, cuDNN's algorithm search) then fall on neither
    engine's peak memory."""
    module = copy.deepcopy(w.base).to(device)
    x, y = w.batch
    for _ in range(2):
        with autocast():
            loss = w.loss(module(x), y)
        loss.backward()
    del module, loss
    _sync(device)


def count_syncs(
    e: Engine, w: Workload, autocast: Any, device: torch.device
) -> tuple[int, list[str]]:
    """Host-device synchronizations in one step, as torch.cuda.set_sync_debug_mode("warn")
    reports them (the blocking copies and stream synchronizations c10 checks; not every
    kind of wait: an event's synchronize is not reported), and the Python lines that made
    each distinct one (innermost last), for the log."""
    _sync(device)
    sites: list[str] = []
    shown = warnings.showwarning

    def seen(message: Any, *args: Any, **kwargs: Any) -> None:
        if "synchroniz" in str(message):
            stack = traceback.format_stack()[:-2]
            sites.append("".join(stack[-4:]))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = seen
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run_steps(e, w, 1, autocast, device, sync=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown
    _sync(device)
    return len(sites), sorted(set(sites))


def count_collectives(e: Engine, w: Workload, autocast: Any, device: torch.device) -> dict:
    """The collectives one step issues to the backend, ``{op: count}``: torch's profiler
    (CPU activity only) records every ``c10d::`` operator, whichever thread calls it (torch
    DDP's reducer calls from autograd's)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_steps(e, w, 1, autocast, device)
    found = [ev.name.removeprefix("c10d::") for ev in prof.events() if ev.name.startswith("c10d::")]
    return {op: found.count(op) for op in sorted(set(found))}


def profile_steps(e: Engine, w: Workload, autocast: Any, device: torch.device) -> str:
    """torch's profiler over 3 steps: the operators that cost the host most (and, on a GPU,
    the device's busy time), as a table for the log: where a row's gap comes from."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        run_steps(e, w, 3, autocast, device)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)
    return str(table)


# -- one row -----------------------------------------------------------------------------------


def measure(
    w: Workload, args: argparse.Namespace, device: torch.device, mesh: Any, deadline: float
) -> dict[str, Any]:
    """Warm both engines up (peak memory on the way), then time pairs until done or the
    row's deadline."""
    if device.type == "cuda" and args.precision == "bf16":

        def autocast() -> Any:
            return torch.autocast("cuda", dtype=torch.bfloat16)
    else:
        autocast = nullcontext
    params = {id(p): p for p in w.base.parameters()}
    row: dict[str, Any] = {
        "row": w.row,
        "engines": w.kind,
        "model": w.model,
        "params": sum(p.numel() for p in params.values()),
        "tensors": len(params),
        "batch": w.batch_desc,
        "optimizer": "AdamW(fused=False)" if w.optimizer == "adamw" else "SGD(momentum=0.9)",
        "what_runs": WHAT_RUNS[w.kind],
    }
    plain_warmup(w, autocast, device)
    engines: dict[str, Engine] = {}
    peak: dict[str, float | None] = dict.fromkeys(ENGINES)
    syncs: dict[str, int | None] = dict.fromkeys(ENGINES)
    sync_sites: dict[str, list[str]] = {}
    collectives: dict[str, dict[str, int]] = {}
    for name in ENGINES:
        for built in engines.values():  # its gradients would be freed during the next's steps
            built.opt.zero_grad(set_to_none=True)
        gc.collect()
        _sync(device)
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        engines[name] = e = build(w, name, device, mesh)
        with _in_engine(name):
            run_steps(e, w, 1, autocast, device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            run_steps(e, w, args.warmup - 1, autocast, device)
            if device.type == "cuda":
                peak[name] = (torch.cuda.max_memory_allocated(device) - before) / MIB
                syncs[name], sync_sites[name] = count_syncs(e, w, autocast, device)
            collectives[name] = count_collectives(e, w, autocast, device)
    w.base = nn.Module()  # the CPU copy is no longer needed
    ms: dict[str, list[float]] = {n: [] for n in ENGINES}
    ratios: list[float] = []
    last_pair = 0.0
    stopped = None
    for pair in range(args.pairs):
        now = time.monotonic()
        if pair > 0 and now + last_pair > deadline:
            stopped = f"time budget: {pair} of {args.pairs} pairs"
            break
        order = ENGINES if pair % 2 == 0 else ENGINES[::-1]
        for name in order:
            with _in_engine(name):
                spent = run_steps(engines[name], w, args.steps, autocast, device)
            ms[name].append(spent / args.steps * 1e3)
        ratios.append(ms["torch"][-1] / ms["tandem"][-1])
        last_pair = time.monotonic() - now
    if w.row in args.profile:
        row["profile"] = {
            name: profile_steps(engines[name], w, autocast, device) for name in ENGINES
        }
    median = statistics.median(ratios)
    row.update(
        {
            "ms_per_step": {n: statistics.median(ms[n]) for n in ENGINES},
            "pairs_ms_per_step": ms,
            "ratio_tandem_over_torch": median,
            "ratios": ratios,
            "ratio_range": [min(ratios), max(ratios)],
            "pairs": len(ratios),
            "steps_per_round": args.steps,
            "meets_target": median >= TARGET,
            "stopped": stopped,
            "peak_mib": peak,
            "host_syncs_in_one_step": syncs,
            "host_sync_sites": sync_sites,
            "collectives_in_one_step": collectives,
            "peak_mib_tandem_minus_torch": (
                peak["tandem"] - peak["torch"]  # type: ignore[operator]
                if device.type == "cuda"
                else None
            ),
        }
    )
    engines.clear()
    del e
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


# -- the process -------------------------------------------------------------------------------


def _meta(args: argparse.Namespace, device: torch.device, sizes: Sizes) -> dict[str, Any]:
    nccl = None
    if device.type == "cuda":
        try:
            version = torch.cuda.nccl.version()  # (major, minor, patch); an int in old torch
            nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception as exc:  # a build without NCCL
            nccl = f"unknown ({type(exc).__name__})"
    return {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({platform.processor() or platform.machine()})",
        "backend": "nccl" if device.type == "cuda" else "gloo",
        "world_size": 1,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "python": platform.python_version(),
        "precision": (
            "bf16 autocast, float32 parameters/gradients/optimizer state, TF32 matmuls"
            if device.type == "cuda" and args.precision == "bf16"
            else "float32" + (", TF32 matmuls" if device.type == "cuda" else "")
        ),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "cpus": os.cpu_count(),
        "arguments": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "sizes": vars(sizes),
        "target_tandem_over_torch": TARGET,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    parser.add_argument("--tiny", action="store_true", help="tiny models (a rehearsal)")
    parser.add_argument("--pairs", type=int, default=None, help="default 9 (--tiny: 2)")
    parser.add_argument("--steps", type=int, default=None, help="per round; 10 (--tiny: 2)")
    parser.add_argument("--warmup", type=int, default=3, help="steps per engine, at least 2")
    parser.add_argument(
        "--budget-s", type=float, default=140.0, help="seconds from after the imports"
    )
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--gpt-batch", type=int, default=None, help="sequences (default 16)")
    parser.add_argument("--context", type=int, default=None, help="tokens (default 512)")
    parser.add_argument("--deep-batch", type=int, default=None, help="default 1024")
    parser.add_argument("--resnet-batch", type=int, default=None, help="default 64")
    parser.add_argument(
        "--profile",
        nargs="*",
        choices=ROWS,
        default=[],
        help="rows whose engines are also profiled (3 steps each, tables in the output)",
    )
    parser.add_argument("--json", type=Path, default=RESULTS / "gpu.json")
    args = parser.parse_args(argv)
    if args.pairs is None:
        args.pairs = 2 if args.tiny else 9
    if args.steps is None:
        args.steps = 2 if args.tiny else 10
    args.warmup = max(2, args.warmup)  # the bucket rebuild happens at the second step
    sizes = copy.copy(TINY) if args.tiny else Sizes()
    for key in ("gpt_batch", "context", "deep_batch", "resnet_batch"):
        if getattr(args, key) is not None:
            setattr(sizes, key, getattr(args, key))
    sizes.positions = max(sizes.positions, sizes.context)

    start = time.monotonic()
    deadline = start + args.budget_s
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("no CUDA device visible: pass --device cpu (with --tiny for a rehearsal)")
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    else:
        device = torch.device("cpu")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    if device.type == "cuda":
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    rows: list[dict[str, Any]] = []
    try:
        mesh = None
        if "fsdp_gpt2" in args.rows:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(device.type, (1,))
        for i, row in enumerate(args.rows):
            now = time.monotonic()
            if now >= deadline:
                rows.append(
                    {"row": row, "skipped": "skipped: the time budget (--budget-s) was spent"}
                )
                continue
            w = workload(row, sizes, device)
            if isinstance(w, str):
                rows.append({"row": row, "skipped": w})
                continue
            share = (deadline - now) / (len(args.rows) - i)
            t0 = time.monotonic()
            try:
                result = measure(w, args, device, mesh, min(deadline, now + share))
            except Exception as exc:  # one row's failure costs the others nothing
                traceback.print_exc()
                result = {"row": row, "skipped": f"failed: {type(exc).__name__}: {exc}"[:300]}
                records.enabled = True
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            result["seconds"] = time.monotonic() - t0
            rows.append(result)
            del w
    finally:
        dist.destroy_process_group()
    meta = _meta(args, device, sizes)
    meta["total_s"] = time.monotonic() - start
    result = {"meta": meta, "rows": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    _print(result)
    print(f"JSON: {args.json}")
    return result


def _row(cells: list[str]) -> None:
    print("| " + " | ".join(cells) + " |")


def _ops(counts: dict[str, int]) -> str:
    return ", ".join(f"{op} x{n}" for op, n in counts.items()) or "none"


def _print(result: dict[str, Any]) -> None:
    for row in result["rows"]:
        for engine, sites in row.get("host_sync_sites", {}).items():
            for site in sites:
                print(f"\nhost sync in one step of {row['row']}, {engine}, at:\n{site}")
        for engine, table in row.get("profile", {}).items():
            print(f"\nprofile of {row['row']}, {engine} (3 steps):\n{table}")
    meta, rows = result["meta"], result["rows"]
    args = meta["arguments"]
    print(
        f"tandem vs torch at world size 1 ({meta['backend']}), {meta['device']}, torch "
        f"{meta['torch']}, CUDA {meta['cuda']}, NCCL {meta['nccl']}; {meta['precision']}; "
        f"{args['pairs']} pairs x {args['steps']} steps, engines alternating A B / B A; "
        f"{meta['total_s']:.0f} s in all"
    )
    print(
        "| row | engines | model | tensors | params | batch | optimizer | tandem ms/step "
        f"| torch ms/step | tandem/torch | range | pairs | >= {TARGET} |"
    )
    print("|---|---|---|---:|---:|---|---|---:|---:|---:|---|---:|---|")
    for r in rows:
        if "skipped" in r:
            _row([r["row"], r["skipped"].replace("|", "/").replace("\n", " "), *["-"] * 11])
            continue
        ms = r["ms_per_step"]
        _row(
            [
                r["row"], r["engines"], r["model"], str(r["tensors"]),
                f"{r['params'] / 1e6:.1f} M", r["batch"], r["optimizer"],
                f"{ms['tandem']:.2f}", f"{ms['torch']:.2f}",
                f"{r['ratio_tandem_over_torch']:.3f}",
                "{:.3f}-{:.3f}".format(*r["ratio_range"]),
                str(r["pairs"]) + (" (budget)" if r["stopped"] else ""),
                "yes" if r["meets_target"] else "NO",
            ]
        )  # fmt: skip
    print(
        "tandem/torch: the median over the pairs of torch ms / tandem ms, i.e. throughput "
        "(> 1: tandem faster); range: the pairs' lowest and highest."
    )
    print()
    print(
        "| row | peak MiB tandem | peak MiB torch | tandem - torch | collectives/step tandem "
        "| collectives/step torch | host syncs/step tandem | host syncs/step torch |"
    )
    print("|---|---:|---:|---:|---|---|---:|---:|")
    for r in rows:
        if "skipped" in r:
            continue
        peak, syncs, ops = r["peak_mib"], r["host_syncs_in_one_step"], r["collectives_in_one_step"]
        mem = ["-", "-", "-"]
        if peak["tandem"] is not None:
            diff = r["peak_mib_tandem_minus_torch"]
            mem = [f"{peak['tandem']:.0f}", f"{peak['torch']:.0f}", f"{diff:+.0f}"]
        shown = ["-" if syncs[e] is None else str(syncs[e]) for e in ENGINES]
        _row([r["row"], *mem, _ops(ops["tandem"]), _ops(ops["torch"]), *shown])
    print(
        "Peak: torch.cuda.max_memory_allocated over warm-up steps 2.., above what was held "
        "before the engine was built (MiB). Collectives: c10d operators in one step (torch's "
        "profiler). Host syncs: torch.cuda.set_sync_debug_mode warnings in one step."
    )
    print("What runs at world size 1:")
    for kind, engines in WHAT_RUNS.items():
        for engine, what in engines.items():
            print(f"- {kind}, {engine}: {what}")


if __name__ == "__main__":
    main()
