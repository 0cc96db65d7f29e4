"""The Trainer's clipping is global, its steps take any batch, and its evaluation stays exact.

Proves, on 2 ranks (Gloo, real processes), float64 throughout:

- ``clip_grad_norm`` with tandem.DDP, DDP + ShardedOptimizer, FullyShardedDataParallel stage 2
  and stage 3 trains to the parameters of one process running SGD on the full batch (both
  ranks' batches) with ``torch.nn.utils.clip_grad_norm_``, and ``last_grad_norm`` is that
  process's last norm. Clipping binds at every step (the one-process norms all exceed the
  threshold). The tolerance is 1e-10 relative: the two ranks' half-batch mean gradients,
  averaged, equal the full batch's mean gradient only up to the order of float64 additions
  (about 1e-16 relative per step), and the sharded engines add their shards' squares in
  another order than torch does; four steps of SGD keep that far below 1e-10, while a norm
  taken over one rank's shard only, or in float32, would miss by more than 1e-8;
- ``training_step`` with dict batches and with namedtuple batches (three fields) trains
  ``torch.equal`` to the default step on ``(inputs, targets)`` of the same data, with equal
  losses; a step returning ``"count"`` (tokens under a mask) weighs batches by it: with a
  learning rate of 0 the reported train loss, eval loss and eval metric equal the token means
  over the whole sets computed in one process (1e-12);
- an FSDP stage 3 model with parameters at its root evaluates exactly although the ranks have
  unequal numbers of evaluation batches (9 samples in batches of 4: 2 and 1), with the default
  step and with an ``eval_step`` returning a metric (1e-12 against one process);
- bad input is the same ValueError on both ranks: an optimizer factory over other
  parameters (before training), a batch the default step cannot split (at the first step).
"""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, DistributedSampler, TensorDataset

import tandem
from tandem.train.trainer import Trainer
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed

BATCH = 4
CLIP = 0.05
Item = namedtuple("Item", "x y index")


def _data(n: int = 32, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64) * 2
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long())


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3)).double()


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def _zero1(params) -> torch.optim.Optimizer:
    return tandem.ShardedOptimizer(params, torch.optim.SGD, lr=0.5, momentum=0.9)


def _frozen(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.0)  # the model stays as built: one process's oracle


def _build(model: nn.Module, optimizer, data: Dataset, run_dir: str, **kwargs) -> Trainer:
    kwargs = {"max_epochs": 1, "save_every": 1, **kwargs}
    return Trainer(
        model, optimizer, data, batch_size=BATCH, run_dir=run_dir, progress=False, **kwargs
    )


# -- clipping ---------------------------------------------------------------------------------


def _clipped(run_dir: str, kind: str) -> dict:
    net, optimizer = _net(), _sgd
    if kind.startswith("fsdp"):
        net = tandem.FullyShardedDataParallel(net, stage=int(kind[-1]), auto_wrap={nn.Linear})
    elif kind == "zero1":
        optimizer = _zero1
    trainer = _build(net, optimizer, _data(), run_dir, loss_fn=F.cross_entropy, clip_grad_norm=CLIP)
    trainer.train()
    if isinstance(net, tandem.FullyShardedDataParallel):
        with net.gathered(writeback=False) as plain:  # in _net()'s parameter order
            params = [t.detach().clone() for m in (plain[0], plain[2]) for t in (m.weight, m.bias)]
    else:
        params = [p.detach().clone() for p in trainer.module.parameters()]
    return {"params": params, "norm": trainer.last_grad_norm, "steps": trainer.step}


def _one_process_clipped() -> tuple[list[torch.Tensor], list[float]]:
    """SGD on both ranks' batches at once, clipped by torch: what the 2 ranks must do."""
    data = _data()
    x, y = data.tensors
    net = _net()
    opt = _sgd(net.parameters())
    orders = []
    for rank in range(2):
        sampler = DistributedSampler(data, 2, rank, shuffle=True, seed=0)
        sampler.set_epoch(0)
        orders.append(list(sampler))
    norms = []
    for start in range(0, len(orders[0]), BATCH):
        index = orders[0][start : start + BATCH] + orders[1][start : start + BATCH]
        F.cross_entropy(net(x[index]), y[index]).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in net.parameters()], norms


@pytest.mark.parametrize("kind", ["ddp", "zero1", "fsdp2", "fsdp3"])
def test_clipping_is_global_and_equals_one_process(tmp_path, kind):
    want, norms = _one_process_clipped()
    assert min(norms) > CLIP, norms  # clipping changed every step
    for result in run_ranks(_clipped, 2, args=(str(tmp_path), kind), timeout=90):
        assert result["steps"] == len(norms)
        assert result["norm"] == pytest.approx(norms[-1], rel=1e-10, abs=0)
        for a, b in zip(result["params"], want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# -- any batch --------------------------------------------------------------------------------


class _Dicts(Dataset):
    def __init__(self, data: TensorDataset) -> None:
        self.x, self.y = data.tensors

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i], "name": f"sample {i}"}


class _Items(_Dicts):
    def __getitem__(self, i: int) -> Item:
        return Item(self.x[i], self.y[i], i)


class _Tokens(Dataset):
    """Sequences of 5 positions of which 1 to 5 count (the mask): a token-level loss."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 5, 6, generator=g, dtype=torch.float64)
        self.y = (self.x[..., 0] > 0).long()
        lengths = torch.randint(1, 6, (n,), generator=g)
        self.mask = torch.arange(5)[None, :] < lengths[:, None]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i], "mask": self.mask[i]}


def _token_step(model: nn.Module, batch: dict) -> dict:
    logits = model(batch["x"])[batch["mask"]]
    targets = batch["y"][batch["mask"]]
    right = (logits.argmax(-1) == targets).double().mean()
    return {"loss": F.cross_entropy(logits, targets), "right": right, "count": targets.numel()}


def _steps(run_dir: str) -> dict:
    def run(name: str, data: Dataset, **kwargs) -> tuple[list[torch.Tensor], list[float]]:
        trainer = _build(_net(), _sgd, data, f"{run_dir}/{name}", max_epochs=2, **kwargs)
        summary = trainer.train()
        params = [p.detach().clone() for p in trainer.module.parameters()]
        return params, [r["train_loss"] for r in summary.history]

    def dict_step(model: nn.Module, batch: dict) -> torch.Tensor:
        return F.cross_entropy(model(batch["x"]), batch["y"])

    tokens = _build(
        _net(),
        _frozen,
        _Tokens(24, 1),
        f"{run_dir}/tokens",
        training_step=_token_step,
        eval_data=_Tokens(9, 2),
    )
    return {
        "default": run("default", _data(), loss_fn=F.cross_entropy),
        "dicts": run("dicts", _Dicts(_data()), training_step=dict_step),
        "items": run("items", _Items(_data()), training_step=_item_step),
        "tokens": tokens.train().history[0],
    }


def _item_step(model: nn.Module, batch: Item) -> torch.Tensor:
    assert type(batch).__name__ == "Item" and batch.index.dtype == torch.long
    return F.cross_entropy(model(batch.x), batch.y)


def _token_means(data: _Tokens) -> tuple[float, float]:
    net = _net()
    with torch.no_grad():
        logits, targets = net(data.x)[data.mask], data.y[data.mask]
        loss = F.cross_entropy(logits, targets).item()
    return loss, (logits.argmax(-1) == targets).double().mean().item()


def test_any_batch_structure_and_counts(tmp_path):
    for result in run_ranks(_steps, 2, args=(str(tmp_path),), timeout=90):
        params, losses = result["default"]
        for name in ("dicts", "items"):
            got_params, got_losses = result[name]
            assert got_losses == losses, name
            assert all(torch.equal(a, b) for a, b in zip(got_params, params, strict=True)), name
        record = result["tokens"]
        train_loss, _ = _token_means(_Tokens(24, 1))
        eval_loss, eval_right = _token_means(_Tokens(9, 2))
        assert record["train_loss"] == pytest.approx(train_loss, abs=1e-12)
        assert record["eval_loss"] == pytest.approx(eval_loss, abs=1e-12)
        assert record["eval_right"] == pytest.approx(eval_right, abs=1e-12)
        assert record["eval_accuracy"] is None  # a user's step names its own metrics


# -- FSDP evaluation in lock step -------------------------------------------------------------


class _Rooted(nn.Module):
    """Linear units and a parameter of the root's own, which only the wrapper's forward
    gathers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
        self.scale = nn.Parameter(torch.tensor([1.5, 0.5, 1.0]))
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.scale


def _squares_step(model: nn.Module, batch: list) -> dict:
    out = model(batch[0])
    return {"loss": F.cross_entropy(out, batch[1]), "sq": (out**2).mean()}


def _fsdp_eval(run_dir: str) -> list[dict]:
    results = []
    for eval_step in (None, _squares_step):
        model = tandem.FullyShardedDataParallel(_Rooted(), stage=3, auto_wrap={nn.Linear})
        trainer = _build(
            model,
            _frozen,
            _data(16),
            run_dir,
            loss_fn=F.cross_entropy,
            eval_data=_data(9, seed=1),
            eval_step=eval_step,
        )
        results.append(trainer.train().history[0])
    return results


def test_fsdp_evaluation_runs_in_lock_step_over_unequal_shards(tmp_path):
    x, y = _data(9, seed=1).tensors
    with torch.no_grad():
        out = _Rooted()(x)
    want_loss, want_sq = F.cross_entropy(out, y).item(), (out**2).mean(-1).mean().item()
    want_accuracy = (out.argmax(-1) == y).double().mean().item()
    for default, custom in run_ranks(_fsdp_eval, 2, args=(str(tmp_path),), timeout=90):
        assert default["eval_loss"] == pytest.approx(want_loss, abs=1e-12)
        assert default["eval_accuracy"] == want_accuracy
        assert custom["eval_loss"] == pytest.approx(want_loss, abs=1e-12)
        assert custom["eval_sq"] == pytest.approx(want_sq, abs=1e-12)


# -- bad input on every rank ------------------------------------------------------------------


def _errors(run_dir: str) -> list[str]:
    other = nn.Linear(6, 3).double()
    triples = TensorDataset(*_data().tensors, _data().tensors[0])
    messages = []
    for optimizer, data in ((lambda ps: _sgd(other.parameters()), _data()), (_sgd, triples)):
        try:
            _build(_net(), optimizer, data, run_dir, loss_fn=F.cross_entropy).train()
        except ValueError as e:
            messages.append(str(e))
        dist.barrier()
    return messages


def test_bad_input_is_the_same_error_on_every_rank(tmp_path):
    first, second = run_ranks(_errors, 2, args=(str(tmp_path),), timeout=60)
    assert first == second and len(first) == 2, (first, second)
    factory, batch = first
    assert "over 2 parameter(s) that are not the model's" in factory
    assert "this batch is a list of 3 items" in batch and "training_step=" in batch
