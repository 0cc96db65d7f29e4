"""The model, the contenders and the memory counting of benchmarks/sharded.py.

``benchmarks/sharded.py`` (the command line, its worker processes, the interleaved rounds, the
summaries and tables) imports this module by name: ``benchmarks/`` is not a package, and the
script's own folder is first on ``sys.path`` in the launcher and in every process
``tandem.spawn`` starts (which inherit the launcher's path). What is measured, and how, is in
that script's docstring.
"""

from __future__ import annotations

import argparse
import gc
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

import tandem

LR = 1e-3

MEMORY_CONTENDERS = ("DDP", "DDP (bucket view)", "stage 1", "stage 2", "stage 3")
THROUGHPUT_CONTENDERS = (
    "tandem.DDP",
    "stage 1",
    "stage 2",
    "stage 3",
    "torch DDP",
    "torch ZeRO-1",
    "torch FSDP2",
    "torch FSDP1",
)
# Opt-in (--contenders): stage 3 with the whole model as one unit, gathered once per step (the
# root unit stays gathered from forward through backward): the cost of per-block collectives.
EXTRA_CONTENDERS = ("stage 3 (one unit)",)
# Bytes per element in float32 with AdamW: (params, grads, state) as functions of N.
FORMULAS_FP32: dict[str, tuple[str, Callable[[int], tuple[float, float, float]]]] = {
    "DDP": ("16P", lambda n: (4, 4, 8)),
    "DDP (bucket view)": ("16P", lambda n: (4, 4, 8)),
    "stage 1": ("8P+8P/N", lambda n: (4, 4, 8 / n)),
    "stage 2": ("4P+12P/N", lambda n: (4 + 4 / n, 4 / n, 8 / n)),
    "stage 3": ("16P/N", lambda n: (4 / n, 4 / n, 8 / n)),
}
FORMULAS_PAPER = {  # mixed precision, Adam: the ZeRO paper's (Rajbhandari et al., 2020)
    "DDP": "16P",
    "DDP (bucket view)": "16P",
    "stage 1": "4P+12P/N",
    "stage 2": "2P+14P/N",
    "stage 3": "16P/N",
}


# -- the model ---------------------------------------------------------------------------------


class Block(nn.Module):
    """x + fc2(relu(fc1(norm(x)))): the unit each sharded engine wraps on its own."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.relu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block(width) for _ in range(blocks)])
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def make_net(args: argparse.Namespace) -> Net:
    torch.manual_seed(0)  # the same initial weights for every contender
    return Net(args.width, args.blocks)


def batches(args: argparse.Namespace, rank: int, n: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [
        (
            torch.randn(args.batch, args.width, generator=g),
            torch.randint(0, 10, (args.batch,), generator=g),
        )
        for _ in range(n)
    ]


# -- contenders --------------------------------------------------------------------------------


@dataclass
class Contender:
    name: str
    model: nn.Module
    opt: torch.optim.Optimizer
    full_params: Callable[[], dict[str, torch.Tensor] | None] = field(repr=False)


def _plain_params(module: nn.Module) -> Callable[[], dict[str, torch.Tensor]]:
    return lambda: {n: p.detach().clone() for n, p in module.named_parameters()}


def build(name: str, args: argparse.Namespace) -> Contender:
    """A fresh contender on the current process group (seed 0 weights)."""
    net = make_net(args)
    if name in ("DDP", "tandem.DDP", "DDP (bucket view)", "stage 1"):
        model = tandem.DDP(net, gradient_as_bucket_view=name == "DDP (bucket view)")
        if name == "stage 1":
            opt: torch.optim.Optimizer = tandem.ShardedOptimizer(
                model.parameters(), torch.optim.AdamW, lr=LR
            )
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=LR)
        return Contender(name, model, opt, _plain_params(net))
    if name in ("stage 2", "stage 3", "stage 3 (one unit)"):
        stage = 2 if name == "stage 2" else 3
        wrap = None if name == "stage 3 (one unit)" else {Block}
        fsdp = tandem.FullyShardedDataParallel(net, stage=stage, auto_wrap=wrap)
        opt = torch.optim.AdamW(fsdp.parameters(), lr=LR)
        return Contender(name, fsdp, opt, fsdp.full_state_dict)
    if name in ("torch DDP", "torch ZeRO-1"):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(net)
        if name == "torch ZeRO-1":
            opt = ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR
            )
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=LR)
        return Contender(name, model, opt, _plain_params(net))
    if name == "torch FSDP2":
        from torch.distributed.fsdp import fully_shard

        for block in net.blocks:
            fully_shard(block)
        fully_shard(net)
        opt = torch.optim.AdamW(net.parameters(), lr=LR)

        def full() -> dict[str, torch.Tensor]:
            return {n: p.full_tensor().detach().clone() for n, p in net.named_parameters()}

        return Contender(name, net, opt, full)
    if name == "torch FSDP1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FullyShardedDataParallel(
            net, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=None
        )
        opt = torch.optim.AdamW(model.parameters(), lr=LR)

        def full1() -> dict[str, torch.Tensor]:
            with FullyShardedDataParallel.summon_full_params(model, writeback=False):
                return {
                    n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                    for n, p in model.named_parameters()
                }

        return Contender(name, model, opt, full1)
    raise ValueError(f"unknown contender {name!r}")


def train_step(c: Contender, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float]:
    """One step; seconds spent in zero_grad + forward, in backward and in the optimizer."""
    t0 = time.perf_counter()
    c.opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(c.model(x), y)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    c.opt.step()
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2


# -- memory ------------------------------------------------------------------------------------


def _storages(tensors: list[torch.Tensor]) -> dict[int, int]:
    """``{storage data pointer: bytes}`` of the tensors' storages, each once; empty ones out."""
    out: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes() > 0:
            out[s.data_ptr()] = s.nbytes()
    return out


def live_storages() -> dict[int, int]:
    """Every tensor storage the garbage collector can reach in this process."""
    gc.collect()
    found = []
    with warnings.catch_warnings():  # isinstance on deprecated module proxies warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor) and obj.device.type != "meta":
                    found.append(obj)
            except Exception:  # some objects fail isinstance checks (lazy proxies)
                continue
    return _storages(found)


def held_bytes(c: Contender) -> dict[str, int]:
    """Bytes this rank holds per category (see the module docstring); storages counted once."""
    if isinstance(c.model, tandem.FullyShardedDataParallel):
        params = [u.shard for u in c.model.units] + [u.full for u in c.model.units]
        params += list(c.model.module.parameters())  # frozen or left-over ones (none here)
    else:
        params = list(c.model.parameters())
    opt_params = [p for g in c.opt.param_groups for p in g["params"]]
    grads = [p.grad for p in opt_params if p.grad is not None]
    inner = c.opt.optimizer if isinstance(c.opt, tandem.ShardedOptimizer) else c.opt
    state = [t for s in inner.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    elementwise = [t for t in state if t.numel() > 1]
    scalars = [t for t in state if t.numel() <= 1]
    buckets: list[torch.Tensor] = []
    if isinstance(c.model, tandem.DDP):
        buckets = [b.flat for b in c.model.reducer.buckets]
    seen: set[int] = set()
    out = {}
    for key, tensors in (
        ("params", params),
        ("grads", grads),
        ("state", elementwise),
        ("step", scalars),
        ("buckets", buckets),
    ):
        storages = {k: v for k, v in _storages(tensors).items() if k not in seen}
        seen.update(storages)
        out[key] = sum(storages.values())
    return out
