"""The end of a tandem.DDP backward on the CPU: the check that rides in the last bucket, and
the means handed over as views of the buckets.

- No rank missed a gradient and none has a request: the step issues its bucket all-reduces and
  nothing else (the check rides in the last one).
- One rank alone misses gradients: it marks the last bucket, and every rank raises
  UnusedParametersError naming that rank's parameters.
- A NaN gradient where the mark goes (the last bucket's first element): no error, and the
  gradients equal torch's DDP, NaN for NaN, bit for bit elsewhere.
- A rider's request on one rank at world size 3 (where the sum's order depends on how the
  backend splits the buffer): every rank is delivered the sums at that step and zeros at the
  others, and the parameters end bit for bit where torch's DDP ends.
- Large gradients become views of their bucket's buffer: a gradient a user keeps from one step
  is never overwritten by the next; the buffer comes back to the bucket when ``zero_grad`` drops
  the gradients (the same buffer every step), and with kept gradients a spare takes turns with it.
Oracles: torch's DDP on the same seeds and data, and tandem's collective records.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import tandem
from tandem.doctor import records
from tandem.parallel.ddp.end_of_backward import UnusedParametersError
from tests import models
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed

CHECK = "DDP end-of-backward check"


def _checks_since(before: int) -> list[str]:
    return [r.context for r in records.recent()[before:] if (r.context or "").startswith(CHECK)]


def _plain_steps() -> dict:
    rank = dist.get_rank()
    model = tandem.DDP(models.wide(seed=rank), bucket_cap_mb=0.5)  # several buckets
    before = len(records.recent())
    for step in range(3):
        model.zero_grad()
        x, y = models.batch(step, rank, 6, (10,))
        F.cross_entropy(model(x), y).backward()
    done = records.recent()[before:]
    return {
        "buckets": len(model.reducer.buckets),
        "contexts": [r.context for r in done],
    }


def test_a_plain_step_issues_its_buckets_and_nothing_else():
    for result in run_ranks(_plain_steps, 2):
        contexts, buckets = result["contexts"], result["buckets"]
        assert buckets >= 2, result
        # step 1: one bucket (the ready order is unknown); steps 2, 3: the rebuild, then buckets
        assert contexts == [
            "DDP bucket 0, step 1",
            "DDP bucket rebuild, step 2",
            *[f"DDP bucket {k}, step 2" for k in range(buckets)],
            *[f"DDP bucket {k}, step 3" for k in range(buckets)],
        ], contexts


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(10, 16)
        self.left = nn.Linear(16, 3)
        self.right = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, both: bool) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        return self.left(h) + self.right(h) if both else self.left(h)


def _one_rank_misses() -> str:
    rank = dist.get_rank()
    model = tandem.DDP(_TwoHeads())
    x, y = models.batch(0, rank, 4, (10,), torch.float32)
    F.cross_entropy(model(x, both=True), y).backward()  # a good step first
    with pytest.raises(UnusedParametersError) as info:
        F.cross_entropy(model(x, both=rank == 1), y).backward()
    return str(info.value)


def test_one_rank_that_misses_gradients_fails_every_rank():
    for message in run_ranks(_one_rank_misses, 2, timeout=30):
        assert "rank 0: right.weight, right.bias" in message, message
        assert "rank 1:" not in message, message


def _nan_gradient() -> dict:
    rank = dist.get_rank()
    ours = tandem.DDP(models.mlp(seed=rank, dtype=torch.float32))
    theirs = TorchDDP(models.mlp(seed=rank, dtype=torch.float32))
    before = len(records.recent())
    grads: dict[str, list[list[torch.Tensor]]] = {"ours": [], "theirs": []}
    for step in range(3):
        x, y = models.batch(step, rank, 6, (10,), torch.float32)
        if step == 1 and rank == 1:
            x[0, 0] = float("nan")  # every gradient of this step is NaN somewhere
        for name, model in (("ours", ours), ("theirs", theirs)):
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            grads[name].append([p.grad.clone() for p in model.parameters()])
    last = ours.reducer.buckets[-1]
    first = ours.module.get_parameter(ours.reducer.names[last.params[0]])
    return {
        "grads": grads,
        "checks": _checks_since(before),
        "marked_is_nan": bool(first.grad.flatten()[0].isnan()),
    }


def test_a_nan_gradient_where_the_check_rides_trains_as_under_torch():
    for result in run_ranks(_nan_gradient, 2):
        for ours, theirs in zip(result["grads"]["ours"], result["grads"]["theirs"], strict=True):
            for a, b in zip(ours, theirs, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        assert any(g.isnan().any() for g in result["grads"]["ours"][1])
        assert result["marked_is_nan"] is False  # step 3's are numbers again
        # Only the NaN step summed the counts and the first element again.
        assert result["checks"] == [CHECK, f"{CHECK}, first element again"], result["checks"]


class _Rider:
    """Asks (on rank 2, in step 2) for what the Trainer asks for: a stop or a checkpoint."""

    def __init__(self, rank: int) -> None:
        self.rank, self.steps = rank, 0
        self.delivered: list[list[int]] = []

    def values(self) -> list[int]:
        self.steps += 1
        return [int(self.rank == 2 and self.steps == 2), 0]

    def deliver(self, sums: list[int]) -> None:
        self.delivered.append(list(sums))


def _request_at_world_3() -> dict:
    rank = dist.get_rank()
    ours = tandem.DDP(models.wide(seed=rank, dtype=torch.float32))
    theirs = TorchDDP(models.wide(seed=rank, dtype=torch.float32))
    rider = _Rider(rank)
    ours.reducer.end_of_backward.rider = rider
    before = len(records.recent())
    opts = [models.make_optimizer("sgd", m.parameters()) for m in (ours, theirs)]
    for step in range(4):
        x, y = models.batch(step, rank, 5, (10,), torch.float32)
        for model, opt in zip((ours, theirs), opts, strict=True):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    return {
        "diff": models.max_diff(ours.module, theirs.module),
        "delivered": rider.delivered,
        "checks": _checks_since(before),
    }


def test_a_request_riding_in_the_bucket_leaves_the_step_bit_for_bit():
    for result in run_ranks(_request_at_world_3, 3):
        assert result["delivered"] == [[0, 0], [1, 0], [0, 0], [0, 0]], result["delivered"]
        assert result["checks"] == [CHECK, f"{CHECK}, first element again"], result["checks"]
        assert result["diff"] == 0.0, result


def _kept_gradients() -> dict:
    rank = dist.get_rank()
    model = tandem.DDP(models.wide(seed=rank))
    big, small = model.module[2].weight, model.module[4].bias  # 512 x 512, and 3
    kept = []
    for step in range(3):
        model.zero_grad(set_to_none=True)
        x, y = models.batch(step, rank, 6, (10,))
        F.cross_entropy(model(x), y).backward()
        kept.append((big.grad, big.grad.clone(), small.grad, small.grad.clone()))
    return {
        "unchanged": [torch.equal(g, c) and torch.equal(s, d) for g, c, s, d in kept],
        "big_is_a_view": big.grad._base is not None,
        "small_is_a_view": small.grad._base is not None,
    }


def test_large_means_are_views_and_a_kept_gradient_is_never_overwritten():
    for result in run_ranks(_kept_gradients, 2):
        assert result["unchanged"] == [True, True, True], result
        assert (result["big_is_a_view"], result["small_is_a_view"]) == (True, False), result


def _buffers_used(set_to_none: bool) -> list[int]:
    rank = dist.get_rank()
    model = tandem.DDP(models.wide(seed=rank))
    big = model.module[2].weight
    pointers = []
    for step in range(6):
        model.zero_grad(set_to_none=set_to_none)
        x, y = models.batch(step, rank, 6, (10,))
        F.cross_entropy(model(x), y).backward()
        pointers.append(big.grad.data_ptr())  # the pointer only: the gradient is not kept
    return pointers[1:]  # step 1 ran with one bucket, before the rebuild


@pytest.mark.parametrize("set_to_none", [True, False])
def test_buffers_come_back_when_the_gradients_are_dropped(set_to_none):
    for pointers in run_ranks(_buffers_used, 2, args=(set_to_none,)):
        if set_to_none:  # zero_grad dropped the gradients: the same buffer every step
            assert len(set(pointers)) == 1, pointers
        else:  # the gradients are kept (and accumulated into): the bucket and its spare take turns
            assert len(set(pointers)) == 2 and pointers[0::2] == [pointers[0]] * 3, pointers
