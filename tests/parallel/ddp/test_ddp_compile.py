"""``torch.compile(tandem.DDP(model))``: no graph break from tandem, the same losses as eager.

Two ranks, Gloo. ``torch._dynamo.explain`` of the wrapped model finds exactly one graph and no
break at every step: the first (one bucket), the second (the buckets are rebuilt: a broadcast
and ``.tolist()``, which would break a traced graph), and later ones, with BatchNorm buffers
broadcast before each forward. Compiled with a counting backend, the module is compiled once
over six steps (no recompilation). With ``aot_eager`` the compiled model's losses and final
parameters equal the eager model's bit for bit (tandem's hooks still average every gradient),
also with many small buckets, which torch's own DDP rejects under torch.compile (its
DDPOptimizer asserts on a first bucket larger than the others). A model that is one of torch's
own containers (``nn.Sequential``), whose frames dynamo does not start a graph in, is compiled
too: one frame with the module's operators in it (no longer nothing at all), and the losses of
``torch.compile(tandem.DDP(m))`` equal those of ``tandem.DDP(torch.compile(m))`` and eager's.
In a fresh interpreter, importing and training with tandem.DDP never imports torch._dynamo
(1-2 s of every rank's start), and compiling the same model afterwards still gives one graph.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import CompileCounter

import tandem
from tests import models
from tests.harness import free_port, run_ranks

pytestmark = pytest.mark.distributed

STEPS = 6


class Net(nn.Module):
    """Defined here, not in torch.nn: dynamo compiles user code, and skips torch's own."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(10, 32)
        self.bn = nn.BatchNorm1d(32)
        self.b = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.bn(self.a(x))))


def _net(seed: int, kind: str = "user") -> nn.Module:
    torch.manual_seed(seed)
    if kind == "sequential":  # torch's own container: its frames are torch's code
        return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 3)).double()
    return Net().double()


def _explain() -> list[tuple[int, int, list[str]]]:
    rank = dist.get_rank()
    model = tandem.DDP(_net(rank), bucket_cap_mb=0.001)
    seen = []
    for step in range(3):
        x, y = models.batch(step, rank, 8, (10,))
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(x)
        seen.append(
            (
                explained.graph_count,
                explained.graph_break_count,
                [str(b.reason) for b in explained.break_reasons],
            )
        )
        F.cross_entropy(model(x), y).backward()
    return seen


def test_explain_finds_one_graph_and_no_break():
    for seen in run_ranks(_explain, 2, timeout=120):
        assert seen == [(1, 0, [])] * 3, seen


def _train(how: str, bucket_cap_mb: float | None, kind: str = "user") -> dict:
    """``how``: "eager", "outside" (torch.compile(tandem.DDP(m))) or "inside"
    (tandem.DDP(torch.compile(m)))."""
    rank = dist.get_rank()
    net = _net(rank, kind)
    torch._dynamo.reset()
    model = tandem.DDP(torch.compile(net, backend="aot_eager") if how == "inside" else net)
    counter = CompileCounter()
    run = torch.compile(model, backend="aot_eager") if how == "outside" else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        x, y = models.batch(step, rank, 8, (10,))
        opt.zero_grad()
        loss = F.cross_entropy(run(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if how == "outside":  # the same model once more through a counting backend: compiled once
        torch._dynamo.reset()
        counted = torch.compile(model, backend=counter)
        for step in range(STEPS):
            x, y = models.batch(step, rank, 8, (10,))
            counted(x).sum().backward()
    return {
        "losses": losses,
        "params": [p.detach().clone() for p in net.parameters()],
        "frames": counter.frame_count,
        "ops": counter.op_count,
    }


def _compiled_vs_eager(bucket_cap_mb: float | None, kind: str) -> dict:
    runs = {how: _train(how, bucket_cap_mb, kind) for how in ("eager", "outside", "inside")}
    return {
        "losses": {how: r["losses"] for how, r in runs.items()},
        "equal": all(
            torch.equal(a, b)
            for how in ("outside", "inside")
            for a, b in zip(runs["eager"]["params"], runs[how]["params"], strict=True)
        ),
        "frames": runs["outside"]["frames"],
        "ops": runs["outside"]["ops"],
    }


@pytest.mark.parametrize(
    ("bucket_cap_mb", "kind"),
    [(None, "user"), (0.001, "user"), (None, "sequential")],
    ids=["default", "small_buckets", "torch_container"],
)
def test_compiled_equals_eager(bucket_cap_mb, kind):
    for r in run_ranks(_compiled_vs_eager, 2, args=(bucket_cap_mb, kind), timeout=180):
        losses = r["losses"]
        assert losses["eager"] == losses["outside"] == losses["inside"], losses
        assert r["equal"]
        # Compiled once, and the graph holds the module's operators (two linears, tanh, ...).
        assert r["frames"] == 1 and r["ops"] >= 3, r


_FRESH = textwrap.dedent(
    """
    import os, sys
    import torch
    import torch.distributed as dist
    from torch import nn

    import tandem

    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    model = tandem.DDP(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)))
    x = torch.randn(3, 4)
    for _ in range(2):  # the second forward rebuilds the buckets
        model(x).sum().backward()
    print("DYNAMO", "torch._dynamo" in sys.modules)
    import torch._dynamo

    explained = torch._dynamo.explain(model)(x)
    print("GRAPHS", explained.graph_count, "BREAKS", explained.graph_break_count)
    dist.destroy_process_group()
    """
)


@pytest.mark.timeout(120)
def test_training_never_imports_dynamo_and_compiling_later_still_gives_one_graph():
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    done = subprocess.run(
        [sys.executable, "-c", _FRESH], env=env, capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, done.stderr
    assert "DYNAMO False" in done.stdout, done.stdout
    assert "GRAPHS 1 BREAKS 0" in done.stdout, done.stdout
