"""Distributed evaluation with EvalSampler and tandem.metrics equals one-process evaluation.

Proves, against an oracle computed in this process with plain torch on the full batch (a fixed
float64 MLP on 10 samples, 3 classes): on 4 ranks (shards 3, 3, 2, 2) and on 2 ranks, every rank
gets the same mean loss (within 1e-12), exactly the same accuracy, and per-sample predictions,
hits (bool) and losses gathered in data set order, both as tensors and as lists; with a 3-sample
data set on 4 ranks (one rank empty, passing an empty float tensor) as well. It also shows the
bias this removes, on the same example: torch's DistributedSampler pads 10 samples to 12 by
repeating samples 0 and 1, and its accuracy (6/12, the labels make exactly samples 0, 1, 2, 5
right) and mean loss differ from the true ones (4/10); on 4 ranks the mean of the ranks' means
differs from the mean too. Gathering with torch's sampler raises ValueError on every rank,
naming the repeated samples. The one-process path (no process group) gives the oracle's values
and raises on a shard that does not cover the data set or on values and indices of different
lengths.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, Sampler, TensorDataset

from tandem import metrics
from tandem.data import EvalSampler
from tests.harness import run_ranks
from tests.models import mlp

N = 10
RIGHT = (0, 1, 2, 5)  # the samples the labels make the model get right


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    """10 inputs, and labels that make exactly the samples in RIGHT correctly predicted."""
    x = torch.randn(N, 10, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        pred = mlp(0)(x).argmax(-1)
    y = torch.where(torch.isin(torch.arange(N), torch.tensor(RIGHT)), pred, (pred + 1) % 3)
    return x, y


def _oracle(x: torch.Tensor, y: torch.Tensor) -> dict:
    """One process, full batch, plain torch: what distributed evaluation must reproduce."""
    with torch.no_grad():
        logits = mlp(0)(x)
    losses = F.cross_entropy(logits, y, reduction="none")
    pred = logits.argmax(-1)
    hits = pred == y
    return {
        "loss": losses.mean().item(),
        "accuracy": hits.sum().item() / len(y),
        "pred": pred,
        "hits": hits,
        "losses": losses,
    }


def _evaluate(dataset: TensorDataset, sampler: Sampler[int]) -> dict:
    """The evaluation loop a user writes with tandem: batches of 2, reduce once at the end."""
    model = mlp(0).eval()
    mean, acc, preds, hits, losses = metrics.Mean(), metrics.Accuracy(), [], [], []
    with torch.no_grad():
        for x, y in DataLoader(dataset, batch_size=2, sampler=sampler):
            logits = model(x)
            batch_losses = F.cross_entropy(logits, y, reduction="none")
            mean.update(batch_losses)
            acc.update(logits, y)
            preds.append(logits.argmax(-1))
            hits.append(logits.argmax(-1) == y)
            losses.append(batch_losses)
    # An empty shard passes an empty (float32) tensor: the others' dtype and row shape are used.
    empty = torch.empty(0)
    return {
        "loss": mean.compute(),
        "accuracy": acc.compute(),
        "pred": metrics.gather_in_order(torch.cat(preds) if preds else empty, sampler),
        "hits": metrics.gather_in_order(torch.cat(hits) if hits else empty, sampler),
        "losses": metrics.gather_in_order(torch.cat(losses) if losses else empty, sampler),
        "loss_list": metrics.gather_in_order(
            [v for b in losses for v in b.tolist()], list(sampler)
        ),
    }


def _padded_torch_eval(dataset: TensorDataset) -> dict:
    """The same loop with torch's DistributedSampler: exact reductions, padded (biased) data."""
    sampler = DistributedSampler(dataset, shuffle=False)
    model = mlp(0).eval()
    mean, acc, preds = metrics.Mean(), metrics.Accuracy(), []
    with torch.no_grad():
        for x, y in DataLoader(dataset, batch_size=2, sampler=sampler):
            logits = model(x)
            mean.update(F.cross_entropy(logits, y, reduction="none"))
            acc.update(logits, y)
            preds.append(logits.argmax(-1))
    try:
        metrics.gather_in_order(torch.cat(preds), sampler)
        error = None
    except ValueError as exc:
        error = str(exc)
    return {"loss": mean.compute(), "accuracy": acc.compute(), "gather_error": error}


def _mean_of_means(dataset: TensorDataset) -> float:
    """The common mistake: average the ranks' own mean losses."""
    x, y = dataset.tensors
    shard = list(EvalSampler(dataset))
    with torch.no_grad():
        local = F.cross_entropy(mlp(0)(x[shard]), y[shard]).reshape(1)
    dist.all_reduce(local)
    return local.item() / dist.get_world_size()


def _body(x: torch.Tensor, y: torch.Tensor) -> dict:
    full, small = TensorDataset(x, y), TensorDataset(x[:3], y[:3])
    return {
        "full": _evaluate(full, EvalSampler(full)),
        "small": _evaluate(small, EvalSampler(small)),
        "torch": _padded_torch_eval(full),
        "mean_of_means": _mean_of_means(full),
    }


def _assert_matches(got: dict, want: dict) -> None:
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-12, rel=0)
    assert got["accuracy"] == want["accuracy"]
    assert torch.equal(got["pred"], want["pred"])
    assert torch.equal(got["hits"], want["hits"])
    torch.testing.assert_close(got["losses"], want["losses"], atol=1e-12, rtol=0)
    torch.testing.assert_close(
        torch.tensor(got["loss_list"], dtype=torch.float64), want["losses"], atol=1e-12, rtol=0
    )


def _check_ranks(results: list[dict]) -> None:
    x, y = _data()
    want_full, want_small = _oracle(x, y), _oracle(x[:3], y[:3])
    assert want_full["accuracy"] == len(RIGHT) / N
    for got in results:  # every rank holds the full, ordered results
        _assert_matches(got["full"], want_full)
        _assert_matches(got["small"], want_small)


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_four_ranks_equal_one_process_and_torch_padding_is_biased() -> None:
    results = run_ranks(_body, world_size=4, args=_data())
    _check_ranks(results)
    x, y = _data()
    want = _oracle(x, y)
    for got in results:
        # 12 padded samples: 0 and 1 (both right) counted twice.
        assert got["torch"]["accuracy"] == (len(RIGHT) + 2) / (N + 2) != want["accuracy"]
        padded = torch.cat([want["losses"], want["losses"][:2]]).mean().item()
        assert got["torch"]["loss"] == pytest.approx(padded, abs=1e-12, rel=0)
        assert abs(got["torch"]["loss"] - want["loss"]) > 1e-6
        # Shards of 3, 3, 2, 2: averaging the ranks' means over-weights the short shards.
        assert abs(got["mean_of_means"] - want["loss"]) > 1e-6
        assert "indices [0, 1] were evaluated more than once" in got["torch"]["gather_error"]


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_two_ranks_equal_one_process() -> None:
    _check_ranks(run_ranks(_body, world_size=2, args=_data()))


def test_one_process_without_group_equals_oracle() -> None:
    assert not (dist.is_available() and dist.is_initialized())
    x, y = _data()
    full, small = TensorDataset(x, y), TensorDataset(x[:3], y[:3])
    _assert_matches(_evaluate(full, EvalSampler(full)), _oracle(x, y))
    _assert_matches(_evaluate(small, EvalSampler(small)), _oracle(x[:3], y[:3]))
    assert metrics.reduce_sum(torch.tensor([1, 2, 3])) == 6
    assert metrics.reduce_sum(torch.tensor([0.5, 0.25])) == 0.75
    assert metrics.accuracy(torch.tensor([True, False, True, True]), 4) == 0.75


def test_one_process_errors_name_the_values() -> None:
    half = EvalSampler(range(N), num_replicas=2, rank=0)  # a shard alone: 5..9 never evaluated
    with pytest.raises(ValueError, match=r"missing \[5, 6, 7, 8, 9\]"):
        metrics.gather_in_order(torch.zeros(5), half)
    with pytest.raises(ValueError, match="rank 0 passed 2 values for 3 indices"):
        metrics.gather_in_order([1, 2], [0, 1, 2])
    with pytest.raises(ValueError, match="global count 0"):
        metrics.Mean().compute()
    with pytest.raises(ValueError, match="correct 3 of count 2"):
        metrics.accuracy(3, 2)
    with pytest.raises(ValueError, match=r"got torch\.float32"):
        metrics.accuracy(torch.tensor([1.0]), 1)
