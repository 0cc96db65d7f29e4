"""Models, data and helpers shared by the FullyShardedDataParallel tests.

- models: ``Net`` (a root parameter, a Linear, a nested bias-free Linear, a buffer), ``MLP`` (given
  widths and biases), built seeded by ``seeded`` or ``make_net``; used in one process
  (tests/parallel/fsdp/test_fsdp_single.py) and in several ranks;
- in several ranks (tests/parallel/fsdp/test_fsdp.py, test_fsdp_state.py): the data (``batch``,
  every rank's slice of a global batch, and ``mse``), one optimizer step (``train_step``), FSDP
  and its tandem.DDP oracle built and trained side by side (``side_by_side``, ``train``), and
  how their results compare (``gathered_tensors``, ``diff``, ``same_everywhere``, ``params``,
  ``compare``, ``optim_match``, ``optim_ok``, ``refused``). The rank functions that use these
  stay module-level in the test modules: ``run_ranks`` pickles them by reference.
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tandem

FSDP = tandem.FullyShardedDataParallel
TOL = 1e-6
PER_RANK = 4
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}


def seeded(cls, *args, seed: int = 0) -> nn.Module:
    """``cls(*args)`` built right after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return cls(*args)


class Net(nn.Module):
    """A root parameter, a Linear, a nested bias-free Linear and a buffer (state_dict order:
    offset, shift, inp.weight, inp.bias, block.0.weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.offset = nn.Parameter(0.1 * torch.randn(3))
        self.inp = nn.Linear(6, 5)
        self.block = nn.Sequential(nn.Linear(5, 3, bias=False), nn.Tanh())
        self.register_buffer("shift", torch.arange(3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(torch.tanh(self.inp(x))) + self.offset + self.shift


class MLP(nn.Module):
    """Linears of the given widths (bias or not) nested in a Sequential, and a root scale."""

    def __init__(self, widths: list[int], biases: list[bool]) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for (a, b), bias in zip(itertools.pairwise(widths), biases, strict=False):
            layers += [nn.Linear(a, b, bias=bias), nn.Tanh()]
        self.body = nn.Sequential(*layers)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, widths[-1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale


def make_net(seed: int = 0) -> nn.Module:
    return seeded(Net, seed=seed)


# -- data and training, in ranks ------------------------------------------------------------------


def batch(step: int, rank: int, ws: int, micro: int = 0, din: int = 6, dout: int = 3):
    """This rank's slice of the global batch of ``step`` (every rank can compute every slice)."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(PER_RANK * ws, din, generator=g)
    y = torch.randn(PER_RANK * ws, dout, generator=g)
    mine = slice(PER_RANK * rank, PER_RANK * (rank + 1))
    return x[mine], y[mine]


def mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


def train_step(model, opt, step: int, data=batch, loss=mse) -> float:
    rank, ws = dist.get_rank(), dist.get_world_size()
    x, y = data(step, rank, ws)
    opt.zero_grad()
    value = loss(model, x, y)
    value.backward()
    opt.step()
    return value.item()


def adamw(params) -> torch.optim.Optimizer:
    cls, kwargs = OPTIMIZERS["adamw"]
    return cls(params, **kwargs)


def side_by_side(make, optimizer: str, stage: int, auto_wrap):
    """FSDP over ``make()`` and the oracle, tandem.DDP over another ``make()``, each with its own
    optimizer named ``optimizer``: (model, opt, oracle, ref)."""
    model = FSDP(make(), stage=stage, auto_wrap=auto_wrap)
    oracle = tandem.DDP(make())
    cls, kwargs = OPTIMIZERS[optimizer]
    return model, cls(model.parameters(), **kwargs), oracle, cls(oracle.parameters(), **kwargs)


def train(model, opt, oracle, ref, steps: int, **step) -> list[tuple[float, float]]:
    """Steps 0 to ``steps - 1`` of both, side by side; the losses, (ours, DDP's) per step."""
    return [
        (train_step(model, opt, s, **step), train_step(oracle, ref, s, **step))
        for s in range(steps)
    ]


# -- reading results ------------------------------------------------------------------------------


def _lookup(module: nn.Module, key: str) -> torch.Tensor:
    return functools.reduce(getattr, key.split("."), module)


def gathered_tensors(model: FSDP, keys) -> dict[str, torch.Tensor]:
    """Every rank: the whole tensors named ``keys``, read through ``gathered()``."""
    with model.gathered(writeback=False) as net:
        return {k: _lookup(net, k).detach().clone() for k in keys}


def diff(a: dict, b: dict) -> float:
    assert list(a) == list(b), (list(a), list(b))
    return max(((a[k].double() - b[k].double()).abs().max().item() for k in a), default=0.0)


def same_everywhere(tensors) -> bool:
    flat = torch.cat([t.detach().double().reshape(-1) for t in tensors])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    return all(torch.equal(flat, other) for other in everyone)


def params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def compare(model: FSDP, expected: dict[str, torch.Tensor]) -> dict:
    """The gathered tensors named like ``expected``: how far from it, and the same on every rank."""
    values = gathered_tensors(model, expected)
    return {"diff": diff(values, expected), "same_everywhere": same_everywhere(values.values())}


def optim_match(full: dict, reference: dict) -> dict:
    """How a full optimizer state dict compares with the plain optimizer's ``state_dict()``."""
    keys = {i: sorted(s) for i, s in full["state"].items()}
    return {
        "groups": full["param_groups"] == reference["param_groups"],
        "keys": keys == {i: sorted(s) for i, s in reference["state"].items()},
        "diff": max(
            (
                (torch.as_tensor(full["state"][i][k]).double() - torch.as_tensor(v).double())
                .abs()
                .max()
                .item()
                for i, s in reference["state"].items()
                for k, v in s.items()
                if k in full["state"].get(i, {})
            ),
            default=0.0,
        ),
    }


def optim_ok(match: dict) -> bool:
    return match["groups"] and match["keys"] and match["diff"] <= TOL


def refused(fn, *args) -> str | None:
    """The message of the ValueError that ``fn(*args)`` raises, or None if it raises none."""
    try:
        fn(*args)
    except ValueError as e:
        return str(e)
    return None


#: Token ids of :class:`Tied` are below this.
VOCAB = 13


class ScaledMLP(nn.Module):
    """Three Linears (``mid`` wide: pick one the world sizes do not divide) and a root scale,
    for the parity tests with torch's ``fully_shard`` (units ``inp``, ``mid``, ``out``)."""

    def __init__(self, mid: int = 10) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 10)
        self.mid = nn.Linear(10, mid)
        self.out = nn.Linear(mid, 3)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(torch.tanh(self.inp(x))))
        return self.out(h) * self.scale


class Tied(nn.Module):
    """Embedding and output projection share one weight; ``mid`` is sharded on its own."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, VOCAB)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.embed(tokens))))


class TinyTransformer(nn.Module):
    """Token embedding, two encoder layers (``layers.0``, ``layers.1``: the units of their own in
    the tests) and an output head, no dropout; tokens below :data:`VOCAB`."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(8, 2, dim_feedforward=12, dropout=0.0, batch_first=True)
            for _ in range(2)
        )
        self.head = nn.Linear(8, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def as_nodes(per_node: int) -> None:
    """Describe this rank as a launcher of ``per_node`` ranks per node would (torchrun's
    LOCAL_WORLD_SIZE, LOCAL_RANK and GROUP_RANK), for ``tandem.world()`` to read."""
    import os

    rank = dist.get_rank()
    os.environ.update(
        LOCAL_WORLD_SIZE=str(per_node),
        LOCAL_RANK=str(rank % per_node),
        GROUP_RANK=str(rank // per_node),
    )
