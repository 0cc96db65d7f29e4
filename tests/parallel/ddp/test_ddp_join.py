"""Uneven inputs: ``tandem.join`` gives torch's ``Join`` semantics and torch's bits.

Oracle: torch's DDP inside torch's ``Join`` on the same seeds and the same uneven data (rank r
holds 3 + 2r batches). After the loop, tandem.DDP's parameters and buffers equal torch's
(``torch.equal``) on every rank, at world sizes 2 and 3, for an MLP and a conv net with
BatchNorm (buffers broadcast from the highest rank still training), with the mean divided by the
initial world size (torch's default) or by the ranks still training, with gradient accumulation
under no_sync, and with a communication hook. Every replica ends identical (the last joiner's
model is broadcast). ``throw_on_early_termination=True`` raises a RuntimeError on every rank at
the same step, as torch's does. torch's own ``Join`` context accepts tandem.DDP as a Joinable.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import tandem
from tests import models
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed

SHAPES = {"mlp": (10,), "conv_bn": (1, 6, 6)}


def _train(engine: str, model_name: str, options: dict) -> dict:
    rank = dist.get_rank()
    factory = getattr(models, model_name)
    wrapper = tandem.DDP if engine == "tandem" else TorchDDP
    model = wrapper(factory(seed=rank), bucket_cap_mb=options.get("bucket_cap_mb"))
    if options.get("hook"):
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    kwargs = {
        "throw_on_early_termination": options.get("throw", False),
        "divide_by_initial_world_size": options.get("divide_initial", True),
    }
    if engine == "tandem" and not options.get("torch_join"):
        context = tandem.join([model], **kwargs)
    else:
        context = Join([model], **kwargs)
    micro = 2 if options.get("no_sync") else 1
    error = None
    steps = 0
    try:
        with context:
            for step in range(3 + 2 * rank):
                opt.zero_grad()
                for m in range(micro):
                    x, y = models.batch(10 * step + m, rank, 4, SHAPES[model_name])
                    if m < micro - 1:
                        with model.no_sync():
                            F.cross_entropy(model(x), y).backward()
                    else:
                        F.cross_entropy(model(x), y).backward()
                opt.step()
                steps += 1
    except RuntimeError as e:
        error = str(e)
    return {"state": model.module.state_dict(), "error": error, "steps": steps}


def _parity(model_name: str, options: dict) -> dict:
    ours = _train("tandem", model_name, options)
    theirs = _train("torch", model_name, options)
    equal = all(torch.equal(ours["state"][k], theirs["state"][k]) for k in ours["state"])
    return {
        "equal": equal,
        "ours": ours,
        "theirs": {"error": theirs["error"], "steps": theirs["steps"]},
    }


CASES = {
    "mlp": ("mlp", {}),
    "conv_bn": ("conv_bn", {}),
    "divide_by_training_ranks": ("mlp", {"divide_initial": False}),
    "no_sync": ("mlp", {"no_sync": True}),
    "hook_small_buckets": ("mlp", {"hook": True, "bucket_cap_mb": 0.0005}),
    "torch_join": ("conv_bn", {"torch_join": True}),
}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_join_equals_torch(case, world_size):
    model_name, options = CASES[case]
    results = run_ranks(_parity, world_size, args=(model_name, options), timeout=90)
    for rank, r in enumerate(results):
        assert r["equal"], rank
        assert r["ours"]["error"] is None and r["theirs"]["error"] is None
        assert r["ours"]["steps"] == 3 + 2 * rank
    # every replica ends with the last joiner's model
    first = results[0]["ours"]["state"]
    for r in results[1:]:
        assert all(torch.equal(first[k], r["ours"]["state"][k]) for k in first)


def test_throw_on_early_termination_raises_on_every_rank():
    results = run_ranks(_parity, 3, args=("mlp", {"throw": True}), timeout=90)
    for rank, r in enumerate(results):
        assert r["equal"], rank
        ours, theirs = r["ours"], r["theirs"]
        assert ours["error"] is not None and theirs["error"] is not None, rank
        assert ours["steps"] == theirs["steps"] == 3, rank  # rank 0 ran out after 3 batches
        if rank == 0:
            assert "exhausted all inputs" in ours["error"]
        else:
            assert "exhausted inputs" in ours["error"]
