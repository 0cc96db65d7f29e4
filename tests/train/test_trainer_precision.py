"""The Trainer's precisions equal a hand-written torch loop, bitwise, and fp16's skips are counted.

Proves:

- on 2 ranks, a Trainer run with ``precision="bf16-mixed"``, ``"fp16-mixed"`` (its GradScaler
  made by the Trainer) and ``"bf16-true"``, with gradient accumulation (2 micro-batches) and
  ``clip_grad_norm`` that binds, ends with parameters ``torch.equal`` to a hand-written loop over
  torch's own DistributedDataParallel with the same autocast, GradScaler (``scale`` ->
  ``unscale_`` -> ``clip_grad_norm_`` -> ``step`` -> ``update``), bfloat16 conversion, seeds and
  data order (torch's DistributedSampler, ``set_epoch``); every epoch's train loss and eval loss
  (evaluation under the same autocast) are ``==``, and so are the last step's gradient norm and
  the scaler's scale. Under bf16-true the module's parameters are bfloat16;
- fp16 with a scaler starting too high (``scaler=GradScaler(init_scale=2**24)``, precision left
  unset, which means fp16-mixed): the Trainer's ``skipped_steps`` equals the number of steps in
  which the hand-written loop's parameters did not change (more than 0, fewer than all); the
  count and the scaler's state are saved with the checkpoint, so a run stopped after its first
  epoch and resumed ends ``torch.equal`` to the uninterrupted one with the same count (one
  process).

With a :class:`tandem.FullyShardedDataParallel` model (every Linear a unit, built without a
policy), against a hand-written loop over torch's FSDP2 (``fully_shard`` on every Linear and the
root, ``MixedPrecisionPolicy(param_dtype=low, reduce_dtype=low)``: Lightning's FSDP precision
for the two mixed names) with the same autocast, seeds and data order:

- ``bf16-mixed`` and ``fp16-mixed`` (the Trainer's scaler then torch's ``ShardedGradScaler``,
  the loop's too), with accumulation and a ``clip_grad_norm`` that does not bind (so fp16 takes
  the unscale, clip, step path; the grads are multiplied by exactly 1): the final float32
  master parameters, every epoch's train and eval loss, and the scale are equal bitwise;
  every all-gather of the run sent the low dtype, every reduce-scatter too; the shards and
  the optimizer state are float32;
- fp16 with ``ShardedGradScaler(init_scale=2**20)``: the Trainer's ``skipped_steps`` equals the
  steps in which the loop's parameters changed on no rank (more than 0, fewer than all), and
  the parameters stay bitwise equal; that run stopped after its first epoch and resumed ends
  bitwise where it ends whole, with the same skip count and scale;
- the agreement ``ShardedGradScaler`` adds: an inf put into one unit's gradient shard on rank 1
  only makes both ranks skip the step with the Trainer's scaler (parameters unchanged on both,
  equal scales), where a plain GradScaler would step on rank 0 and skip on rank 1;
- what the Trainer sets: the policy above on a wrapper without one; a wrapper's own policy
  (``reduce_dtype=float32``) and ``MixedPrecisionPolicy()`` (autocast alone) are kept; a plain
  GradScaler with FSDP is a ValueError naming ShardedGradScaler; a wrapper holding a frozen
  float32 parameter is a ValueError naming it and the way to autocast alone.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.data import DistributedSampler, TensorDataset

import tandem
import tandem.parallel.fsdp.flat as flat
from tandem.data.eval_sampler import shard_range
from tandem.train.precision import ScalerState, resolve_precision
from tandem.train.trainer import Trainer
from tests.harness import run_ranks

EPOCHS = 2
BATCH = 4
ACCUM = 2
CLIP = 0.5
N_TRAIN, N_EVAL = 40, 11  # 20 per rank: 5 batches, steps of 2, 2, 1
CPU = torch.device("cpu")


def _data() -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_TRAIN + N_EVAL, 8, generator=g) * 2
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), TensorDataset(x[N_TRAIN:], y[N_TRAIN:])


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3)
    )


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _autocast(precision: str, device_type: str = "cpu") -> contextlib.AbstractContextManager:
    dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(precision)
    return torch.autocast(device_type, dtype=dtype) if dtype else contextlib.nullcontext()


def _sum(values: list[float], world: int, device: torch.device) -> list[float]:
    """The ranks' float64 sums (on ``device``: NCCL takes no CPU tensors)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(t)
    return t.tolist()


def _trainer(
    run_dir: str,
    precision: str | None,
    epochs: int = EPOCHS,
    model: nn.Module | None = None,
    clip: float = CLIP,
    **kwargs,
) -> Trainer:
    train_set, eval_set = _data()
    return Trainer(
        model if model is not None else _model(),
        _optimizer,
        train_set,
        loss_fn=F.cross_entropy,
        eval_data=eval_set,
        max_epochs=epochs,
        save_every=1,
        batch_size=BATCH,
        eval_batch_size=N_EVAL,  # one batch per rank's shard
        grad_accum_steps=ACCUM,
        run_dir=run_dir,
        precision=precision,
        clip_grad_norm=clip,
        progress=False,
        **kwargs,
    )


def _hand_loop(
    precision: str,
    scaler: torch.amp.GradScaler | None,
    world: int,
    rank: int,
    device: torch.device = CPU,
):
    """The same training written out by hand on ``device``, torch's own DDP when there are
    ranks (tests/cuda runs it on a GPU)."""
    train_set, eval_set = _data()
    x_all, y_all = train_set.tensors
    model = _model().to(device)
    if precision == "bf16-true":
        model.to(torch.bfloat16)
    ddp = TorchDDP(model) if world > 1 else model
    opt = _optimizer(model.parameters())

    def cast(t: torch.Tensor) -> torch.Tensor:
        t = t.to(device)
        return t.bfloat16() if precision == "bf16-true" else t

    losses, norms, unchanged = [], [], 0
    for epoch in range(EPOCHS):
        sampler = DistributedSampler(train_set, world, rank, shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        order = list(sampler)
        batches = [order[i : i + BATCH] for i in range(0, len(order), BATCH)]
        total, count = 0.0, 0
        for start in range(0, len(batches), ACCUM):
            group = batches[start : start + ACCUM]
            for i, index in enumerate(group):
                last = i == len(group) - 1
                with contextlib.nullcontext() if last or world == 1 else ddp.no_sync():
                    with _autocast(precision, device.type):
                        loss = F.cross_entropy(ddp(cast(x_all[index])), y_all[index].to(device))
                    scaled = loss * (1 / len(group))
                    (scaler.scale(scaled) if scaler is not None else scaled).backward()
                total += loss.item() * len(index)
                count += len(index)
            before = [p.detach().clone() for p in model.parameters()]
            if scaler is not None:
                scaler.unscale_(opt)
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()
            unchanged += all(
                torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
            )
        total, count = _sum([total, count], world, device)
        # Evaluation: this rank's EvalSampler shard, one batch, as the Trainer's.
        x_eval, y_eval = eval_set.tensors
        shard = list(shard_range(N_EVAL, world, rank))
        with torch.no_grad(), _autocast(precision, device.type):
            eval_loss = F.cross_entropy(model(cast(x_eval[shard])), y_eval[shard].to(device))
        eval_total, eval_count = _sum(
            [float(eval_loss.double()) * len(shard), len(shard)], world, device
        )
        losses.append((total / count, eval_total / eval_count))
    return model, losses, norms[-1], unchanged


def _parity(run_dir: str, precision: str) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    trainer = _trainer(run_dir, precision)
    summary = trainer.train()
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16-mixed" else None
    model, losses, norm, _ = _hand_loop(precision, scaler, world, rank)
    return {
        "same_params": all(
            torch.equal(a, b)
            for a, b in zip(trainer.module.parameters(), model.parameters(), strict=True)
        ),
        "dtypes": {str(p.dtype) for p in trainer.module.parameters()},
        "losses": ([(r["train_loss"], r["eval_loss"]) for r in summary.history], losses),
        "norms": (trainer.last_grad_norm, norm),
        "scales": (
            trainer.scaler.get_scale() if trainer.scaler is not None else None,
            scaler.get_scale() if scaler is not None else None,
        ),
        "made_scaler": type(trainer.scaler).__name__,
    }


@pytest.mark.distributed
@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed", "bf16-true"])
def test_trainer_equals_a_hand_written_ddp_loop_bitwise(tmp_path, precision):
    for result in run_ranks(_parity, 2, args=(str(tmp_path), precision), timeout=90):
        assert result["same_params"], result
        got, want = result["losses"]
        assert got == want, result
        assert result["norms"][0] == result["norms"][1], result
        assert result["scales"][0] == result["scales"][1], result
        want_scaler = "GradScaler" if precision == "fp16-mixed" else "NoneType"
        assert result["made_scaler"] == want_scaler, result
        want_dtype = "torch.bfloat16" if precision == "bf16-true" else "torch.float32"
        assert result["dtypes"] == {want_dtype}, result


def _high_scaler() -> torch.amp.GradScaler:
    # float16 overflows in backward until the scale has halved below about 2**19.
    return torch.amp.GradScaler("cpu", init_scale=2.0**24)


def test_fp16_skipped_steps_are_counted_and_resume_with_the_checkpoint(tmp_path):
    whole = _trainer(str(tmp_path / "whole"), None, scaler=_high_scaler())
    assert whole.precision == "fp16-mixed"
    whole.train()
    model, _, _, unchanged = _hand_loop("fp16-mixed", _high_scaler(), 1, 0)
    for a, b in zip(whole.module.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    steps = whole.step
    assert 0 < whole.skipped_steps == unchanged < steps, (whole.skipped_steps, unchanged, steps)

    _trainer(str(tmp_path / "resumed"), None, epochs=1, scaler=_high_scaler()).train()
    resumed = _trainer(str(tmp_path / "resumed"), None, scaler=_high_scaler(), resume="latest")
    assert resumed.skipped_steps == min(unchanged, resumed.step)  # loaded with the checkpoint
    resumed.train()
    assert resumed.skipped_steps == whole.skipped_steps
    assert resumed.scaler.get_scale() == whole.scaler.get_scale()
    for a, b in zip(resumed.module.parameters(), whole.module.parameters(), strict=True):
        assert torch.equal(a, b)


# -- FullyShardedDataParallel: the wrapper's mixed precision, ShardedGradScaler -----------------

LOW = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}
NO_CLIP = 1e6  # never binds: clipping multiplies by exactly 1, and fp16 unscales before it


def _fsdp(policy=None) -> tandem.FullyShardedDataParallel:
    return tandem.FullyShardedDataParallel(_model(), auto_wrap={nn.Linear}, mixed_precision=policy)


def _sharded_scaler(init_scale: float = 2.0**16):
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler("cpu", init_scale=init_scale)


def _fsdp2_loop(precision: str, scaler, world: int, rank: int):
    """The Trainer's FSDP run written out by hand over torch's FSDP2 (fully_shard on every
    Linear and the root, Lightning's FSDP policy for the precision)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    train_set, eval_set = _data()
    x_all, y_all = train_set.tensors
    model = _model()
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=LOW[precision], reduce_dtype=LOW[precision])
    for module in [*(m for m in model if isinstance(m, nn.Linear)), model]:
        fully_shard(module, mesh=mesh, mp_policy=policy)
    opt = _optimizer(model.parameters())
    losses, unchanged = [], 0
    for epoch in range(EPOCHS):
        sampler = DistributedSampler(train_set, world, rank, shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        order = list(sampler)
        batches = [order[i : i + BATCH] for i in range(0, len(order), BATCH)]
        total, count = 0.0, 0
        for start in range(0, len(batches), ACCUM):
            group = batches[start : start + ACCUM]
            for index in group:  # every micro-batch reduce-scatters (the Trainer's FSDP)
                with _autocast(precision):
                    loss = F.cross_entropy(model(x_all[index]), y_all[index])
                scaled = loss * (1 / len(group))
                (scaler.scale(scaled) if scaler is not None else scaled).backward()
                total += loss.item() * len(index)
                count += len(index)
            before = [p.detach().to_local().clone() for p in model.parameters()]
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()
            same = all(
                torch.equal(a, p.detach().to_local())
                for a, p in zip(before, model.parameters(), strict=True)
            )
            changed = torch.tensor([0.0 if same else 1.0])
            dist.all_reduce(changed)
            unchanged += changed.item() == 0
        total, count = _sum([total, count], world, CPU)
        x_eval, y_eval = eval_set.tensors
        shard = list(shard_range(N_EVAL, world, rank))
        with torch.no_grad(), _autocast(precision):
            eval_loss = F.cross_entropy(model(x_eval[shard]), y_eval[shard])
        eval_total, eval_count = _sum(
            [float(eval_loss.double()) * len(shard), len(shard)], world, CPU
        )
        losses.append((total / count, eval_total / eval_count))
    weights = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return weights, losses, unchanged


class _Wire:
    """The input dtypes of tandem's FSDP all-gathers and reduce-scatters while recording; the
    checkpoints' all-gathers of the float32 masters (``FlatUnit.gather_exact``) apart."""

    def __init__(self) -> None:
        self.sent: dict[str, set[str]] = {"all_gather": set(), "reduce_scatter": set()}
        self.exact: set[str] = set()
        self.in_exact = False
        self.originals = (flat.all_gather_flat, flat.reduce_scatter_flat)
        self.gather_exact = flat.FlatUnit.gather_exact

    def _spy(self, op: str, fn):
        def call(output, input, *args, **kwargs):
            (self.exact if self.in_exact else self.sent[op]).add(str(input.dtype))
            return fn(output, input, *args, **kwargs)

        return call

    def __enter__(self) -> _Wire:
        flat.all_gather_flat = self._spy("all_gather", self.originals[0])
        flat.reduce_scatter_flat = self._spy("reduce_scatter", self.originals[1])
        wire, gather_exact = self, self.gather_exact

        def exact(unit):
            wire.in_exact = True
            try:
                return gather_exact(unit)
            finally:
                wire.in_exact = False

        flat.FlatUnit.gather_exact = exact
        return self

    def __exit__(self, *_) -> None:
        flat.all_gather_flat, flat.reduce_scatter_flat = self.originals
        flat.FlatUnit.gather_exact = self.gather_exact


def _equal_dicts(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(v, b[k]) for k, v in a.items())


def _fsdp_parity(run_dir: str, precision: str, init_scale: float | None) -> dict:
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    world, rank = dist.get_world_size(), dist.get_rank()
    kwargs = {} if init_scale is None else {"scaler": _sharded_scaler(init_scale)}
    model = _fsdp()
    with _Wire() as wire:
        trainer = _trainer(run_dir, precision, model=model, clip=NO_CLIP, **kwargs)
        summary = trainer.train()
    scaler = None
    if precision == "fp16-mixed":
        scaler = _sharded_scaler(init_scale if init_scale is not None else 2.0**16)
    weights, losses, unchanged = _fsdp2_loop(precision, scaler, world, rank)
    full = model.full_state_dict()
    optimizer_dtypes = {
        str(v.dtype)
        for state in trainer.optimizer.state.values()
        for v in state.values()
        if torch.is_tensor(v) and v.is_floating_point()
    }
    return {
        "same_params": None if full is None else _equal_dicts(full, weights),  # rank 0's
        "policy": (model.mixed_precision.param_dtype, model.mixed_precision.reduce_dtype),
        "wire": wire.sent,
        "saved_gathers": wire.exact,
        "shard_dtypes": {str(p.dtype) for p in model.parameters()},
        "optimizer_dtypes": optimizer_dtypes,
        "losses": ([(r["train_loss"], r["eval_loss"]) for r in summary.history], losses),
        "scales": (
            trainer.scaler.get_scale() if trainer.scaler is not None else None,
            scaler.get_scale() if scaler is not None else None,
        ),
        "scaler": type(trainer.scaler).__name__,
        "skipped": (trainer.skipped_steps, unchanged, trainer.step),
    }


@pytest.mark.distributed
@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_fsdp_mixed_precision_equals_a_hand_written_fsdp2_loop_bitwise(tmp_path, precision):
    low = str(LOW[precision])
    results = run_ranks(_fsdp_parity, 2, args=(str(tmp_path), precision, None), timeout=120)
    for rank, r in enumerate(results):
        context = (rank, r)
        assert r["same_params"] is (True if rank == 0 else None), context
        got, want = r["losses"]
        assert got == want, context
        assert r["scales"][0] == r["scales"][1], context
        assert r["policy"] == (LOW[precision], LOW[precision]), context
        assert r["wire"] == {"all_gather": {low}, "reduce_scatter": {low}}, context
        assert r["saved_gathers"] == {"torch.float32"}, context  # checkpoints: the masters
        assert r["shard_dtypes"] == r["optimizer_dtypes"] == {"torch.float32"}, context
        want_scaler = "ShardedGradScaler" if precision == "fp16-mixed" else "NoneType"
        assert r["scaler"] == want_scaler, context
        assert r["skipped"][0] == r["skipped"][1] == 0, context


@pytest.mark.distributed
def test_fsdp_fp16_skipped_steps_are_counted_as_by_the_fsdp2_loop(tmp_path):
    # float16 parameters overflow in backward until the scale is down to about 2**17: from
    # 2**20, 4 of the run's 6 steps are skipped (from 2**24, all 6 would be).
    results = run_ranks(_fsdp_parity, 2, args=(str(tmp_path), "fp16-mixed", 2.0**20), timeout=120)
    for rank, r in enumerate(results):
        context = (rank, r)
        assert r["same_params"] is (True if rank == 0 else None), context
        assert r["losses"][0] == r["losses"][1], context
        assert r["scales"][0] == r["scales"][1], context
        skipped, unchanged, steps = r["skipped"]
        assert 0 < skipped == unchanged < steps, context
    assert results[0]["skipped"] == results[1]["skipped"]


def _fsdp_fp16_resume(run_dir: str) -> dict:
    """The skipping fp16 FSDP run whole, and stopped after its first epoch then resumed."""

    def run(name: str, epochs: int, **kwargs) -> Trainer:
        trainer = _trainer(
            f"{run_dir}/{name}",
            None,
            epochs=epochs,
            model=_fsdp(),
            clip=NO_CLIP,
            scaler=_sharded_scaler(2.0**20),
            **kwargs,
        )
        trainer.train()
        return trainer

    whole = run("whole", EPOCHS)
    run("resumed", 1)
    resumed = run("resumed", EPOCHS, resume="latest")
    full = [t.model.full_state_dict() for t in (whole, resumed)]
    return {
        "same_params": None if full[0] is None else _equal_dicts(*full),
        "skipped": (whole.skipped_steps, resumed.skipped_steps),
        "scales": (whole.scaler.get_scale(), resumed.scaler.get_scale()),
        "policy": repr(resumed.model.mixed_precision),
    }


@pytest.mark.distributed
def test_fsdp_fp16_resume_continues_bitwise_with_the_skip_count(tmp_path):
    for rank, r in enumerate(run_ranks(_fsdp_fp16_resume, 2, args=(str(tmp_path),), timeout=120)):
        assert r["same_params"] is (True if rank == 0 else None), (rank, r)
        assert r["skipped"][0] == r["skipped"][1] > 0, (rank, r)
        assert r["scales"][0] == r["scales"][1], (rank, r)
        assert "float16" in r["policy"], (rank, r)


def _one_rank_overflows() -> dict:
    """One step whose gradient holds an inf in rank 1's shard of one unit only."""
    out = {}
    for kind in ("trainer", "plain"):
        model = _fsdp()
        precision, scaler = resolve_precision("fp16-mixed", None, model, torch.device("cpu"))
        precision.convert_module(model)
        if kind == "plain":
            scaler = torch.amp.GradScaler("cpu")  # what check_scaler refuses, to compare
        state = ScalerState(scaler)
        opt = _optimizer(model.parameters())
        x, y = _data()[0].tensors
        with precision.autocast():
            loss = F.cross_entropy(model(x[:BATCH]), y[:BATCH])
        scaler.scale(loss).backward()
        if dist.get_rank() == 1:
            model.units[0].shard.grad[0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        skipped = state.step(opt)
        out[kind] = {
            "scaler": type(scaler).__name__,
            "skipped": skipped,
            "unchanged": all(
                torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
            ),
            "scale": scaler.get_scale(),
        }
    return out


@pytest.mark.distributed
def test_sharded_grad_scaler_skips_on_every_rank_when_one_shard_overflows():
    results = run_ranks(_one_rank_overflows, 2, timeout=60)
    for rank, r in enumerate(results):
        t = r["trainer"]
        assert t["scaler"] == "ShardedGradScaler", (rank, r)
        assert t["skipped"] and t["unchanged"], (rank, r)
    assert results[0]["trainer"]["scale"] == results[1]["trainer"]["scale"]
    # Without the agreement the ranks part: rank 0 steps, rank 1 skips.
    assert [r["plain"]["skipped"] for r in results] == [False, True]
    assert results[0]["plain"]["scale"] != results[1]["plain"]["scale"]


def _frozen_model() -> tandem.FullyShardedDataParallel:
    net = _model()
    net[2].bias.requires_grad_(False)
    return tandem.FullyShardedDataParallel(net, auto_wrap={nn.Linear})


def _what_the_trainer_sets(run_dir: str) -> dict:
    from tandem import MixedPrecisionPolicy

    def policy(model, precision="bf16-mixed", **kwargs):
        _trainer(run_dir, precision, model=model, **kwargs)
        p = model.mixed_precision
        units = {(str(u.param_dtype), str(u.reduce_dtype)) for u in model.units}
        return (None if p is None else (str(p.param_dtype), str(p.reduce_dtype))), units

    def message(make, **kwargs):
        try:
            _trainer(run_dir, kwargs.pop("precision", "bf16-mixed"), model=make(), **kwargs)
        except ValueError as e:
            return str(e)
        return None

    return {
        "none": policy(_fsdp()),
        "fp16": policy(_fsdp(), "fp16-mixed"),
        "32-true": policy(_fsdp(), "32-true"),
        "own": policy(_fsdp(MixedPrecisionPolicy(torch.bfloat16, torch.float32))),
        "autocast_only": policy(_fsdp(MixedPrecisionPolicy())),
        "plain_scaler": message(_fsdp, precision="fp16-mixed", scaler=torch.amp.GradScaler("cpu")),
        "frozen": message(_frozen_model),
    }


@pytest.mark.distributed
def test_what_the_trainer_sets_on_an_fsdp_model(tmp_path):
    bf16, fp16, fp32 = "torch.bfloat16", "torch.float16", "torch.float32"
    for r in run_ranks(_what_the_trainer_sets, 2, args=(str(tmp_path),), timeout=90):
        assert r["none"] == ((bf16, bf16), {(bf16, bf16)}), r
        assert r["fp16"] == ((fp16, fp16), {(fp16, fp16)}), r
        assert r["32-true"] == (None, {(fp32, fp32)}), r
        assert r["own"] == ((bf16, fp32), {(bf16, fp32)}), r
        assert r["autocast_only"] == (("None", "None"), {(fp32, fp32)}), r
        assert "ShardedGradScaler" in r["plain_scaler"], r
        assert "GradScaler sees only this rank's gradient shards" in r["plain_scaler"], r
        assert "2.bias" in r["frozen"] and "MixedPrecisionPolicy()" in r["frozen"], r
