"""FullyShardedDataParallel with mixed precision takes the steps of torch's own FSDP2, bit for bit.

The oracle is ``torch.distributed.fsdp.fully_shard(module, mp_policy=MixedPrecisionPolicy(...))``
(FSDP2, over Gloo with a CPU device mesh) applied with the same policy to every submodule that
tandem makes a unit and to the root, run side by side in the same 2 ranks: the same model built
from the same seed, the same per-rank data, the same optimizer. Two models: an MLP (three
Linears and a root parameter) and one with tied weights (embedding and output projection share
one Parameter, kept by the root in both). Proven at world size 2, 10 steps:

- ``param_dtype=bfloat16, reduce_dtype=float32``, stages 3 and 2 (FSDP2 with
  ``reshard_after_forward`` True and False), SGD (momentum, weight decay) and AdamW, both
  models: every step's loss, the outputs' dtype and every final float32 master parameter equal
  FSDP2's bit for bit (``torch.equal``); so do two accumulation patterns (two micro-batches
  reduce-scattered each, and tandem's ``no_sync()`` against FSDP2's
  ``set_requires_gradient_sync(False)``, whose float32 sum of bfloat16 gradients is the same);
  and the other policies: ``reduce_dtype=None`` (gradients reduce-scattered in bfloat16, as
  torch does by default), ``output_dtype=float32`` (FSDP2 given it on the root's policy only:
  tandem casts the model's outputs, not every unit's) with ``cast_forward_inputs``, and float16
  parameters reduced in float32. Bitwise at world size 2 for the reason the float32 parity
  (tests/parallel/fsdp/test_fsdp_torch_parity.py) gives: the gathered bfloat16 values are the
  same casts of the same float32 shards, the forward and backward are the same ops on the same
  tensors, each element's gradient is the sum of two addends (which commute) divided by 2
  (exact) in the same dtype, and the optimizer is element-wise on float32 shards. At world size
  3 the two layouts put some elements on other owners, whose three addends Gloo adds in
  another order: that test shows the float32 bound, which is not repeated here.
- the bytes: every all-gather of a training step sends the bfloat16 cast of the float32 shard
  (its input dtype, recorded at ``tandem.parallel.fsdp.flat.all_gather_flat``), so a step's
  all-gathers move exactly half the bytes of the same run without mixed precision; every
  reduce-scatter sends float32 (``reduce_dtype``); the shards and their ``.grad`` are float32.
- checkpoints hold the float32 master weights: ``full_state_dict()`` of a mixed-precision run
  is all float32, equals FSDP2's final (float32, sharded) parameters and loads into the plain
  float32 model with ``strict=True``; a run saved after 5 steps (full model and optimizer state
  dicts, and each rank's sharded state) and loaded into a fresh wrapper continues bitwise as
  the uninterrupted run, and ``gathered()`` shows the float32 values, not the bfloat16 copies.
- a policy that differs across ranks raises a ValueError on every rank naming both, instead of
  all-gathers of different dtypes.
- ``set_mixed_precision(policy)`` on a wrapper built without one (what the Trainer does for
  its mixed precisions) trains as the wrapper built with it: bitwise FSDP2's, stages 3 and 2
  (stage 2's gathered float32 parameters are cast at the call, so its first forward gathers
  nothing), both models; ``set_mixed_precision(None)`` afterwards gathers float32 again. A
  policy set differently across ranks is a ValueError on every rank; the call between a
  forward and its backward is a RuntimeError on every rank, and the wrapper trains on after it.

Every configuration here runs under torch's ``fully_shard`` on CPU, so no hand-computed
reference is needed in processes; the one-process reference with the same casts is
tests/parallel/fsdp/test_fsdp_mixed_precision_single.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tandem.parallel.fsdp.flat as flat
from tandem.parallel.fsdp.precision import MixedPrecisionPolicy
from tests.harness import run_ranks
from tests.parallel.fsdp.models import (
    FSDP,
    OPTIMIZERS,
    PER_RANK,
    VOCAB,
    ScaledMLP,
    Tied,
    gathered_tensors,
    refused,
    seeded,
)

pytestmark = pytest.mark.distributed

try:  # FSDP2: public from torch 2.6 on
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard
except ImportError:
    pytest.skip("this torch has no FSDP2 (fully_shard)", allow_module_level=True)

STEPS = 10
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def MLP() -> nn.Module:
    """Three Linears (widths 2 does not divide evenly) and a root scale."""
    return ScaledMLP(mid=9)


def _floats(step: int, micro: int = 0):
    g = torch.Generator().manual_seed(1000 * step + micro)
    ws, rank = dist.get_world_size(), dist.get_rank()
    x, y = torch.randn(PER_RANK * ws, 6, generator=g), torch.randn(PER_RANK * ws, 3, generator=g)
    mine = slice(PER_RANK * rank, PER_RANK * (rank + 1))
    return x[mine], y[mine]


def _tokens(step: int, micro: int = 0):
    g = torch.Generator().manual_seed(2000 + 1000 * step + micro)
    ws, rank = dist.get_world_size(), dist.get_rank()
    x = torch.randint(0, VOCAB, (PER_RANK * ws, 6), generator=g)
    y = torch.randint(0, VOCAB, (PER_RANK * ws, 6), generator=g)
    mine = slice(PER_RANK * rank, PER_RANK * (rank + 1))
    return x[mine], y[mine]


def _mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
    out = model(x)
    return F.mse_loss(out.float(), y), out.dtype


def _cross_entropy(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    out = model(x)
    return F.cross_entropy(out.float().reshape(-1, VOCAB), y.reshape(-1)), out.dtype


# name: (model class, the submodules sharded on their own, data, loss)
CASES = {
    "mlp": (MLP, ("inp", "mid", "out"), _floats, _mse),
    "tied": (Tied, ("mid",), _tokens, _cross_entropy),
}
MAIN = {"param_dtype": BF16, "reduce_dtype": FP32}
# name: (policy fields, case, stage, optimizer, accumulation)
RUNS = {
    **{
        f"{case}-stage{stage}-{opt}": (MAIN, case, stage, opt, None)
        for case in CASES
        for stage in (3, 2)
        for opt in OPTIMIZERS
    },
    "accumulate": (MAIN, "mlp", 3, "adamw", "sync"),
    "no_sync": (MAIN, "mlp", 3, "adamw", "no_sync"),
    "no_sync-stage2-tied": (MAIN, "tied", 2, "sgd", "no_sync"),
    "reduce-bf16": ({"param_dtype": BF16}, "mlp", 3, "adamw", None),
    "output-fp32": ({**MAIN, "output_dtype": FP32}, "tied", 3, "adamw", None),
    "fp16": ({"param_dtype": FP16, "reduce_dtype": FP32}, "mlp", 3, "sgd", None),
    # built without a policy, given one by set_mixed_precision() before the first step
    "late-stage3": (MAIN, "mlp", 3, "adamw", None),
    "late-stage2-tied": ({"param_dtype": BF16}, "tied", 2, "sgd", None),
}


class _Wire:
    """Records the input dtype and bytes of every FSDP all-gather and reduce-scatter (tandem's
    flat collectives, replaced in this process while recording)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, torch.dtype, int]] = []
        self.originals = (flat.all_gather_flat, flat.reduce_scatter_flat)

    def _spy(self, op: str, fn):
        def call(output, input, *args, **kwargs):
            self.sent.append((op, input.dtype, input.numel() * input.element_size()))
            return fn(output, input, *args, **kwargs)

        return call

    def __enter__(self) -> _Wire:
        flat.all_gather_flat = self._spy("all_gather", self.originals[0])
        flat.reduce_scatter_flat = self._spy("reduce_scatter", self.originals[1])
        return self

    def __exit__(self, *_) -> None:
        flat.all_gather_flat, flat.reduce_scatter_flat = self.originals

    def of(self, op: str) -> list[tuple[torch.dtype, int]]:
        return [(dtype, size) for o, dtype, size in self.sent if o == op]


def _pair(fields: dict, case: str, stage: int, mesh, mixed: bool = True, late: bool = False):
    """tandem's and FSDP2's wrapping of the same model, with the same policy on every unit;
    tandem gets torch's policy object and its own by turns (both accepted)."""
    cls, wrapped, _, _ = CASES[case]
    picked_net = seeded(cls, seed=3)
    picked = {id(picked_net.get_submodule(name)) for name in wrapped}
    policy = (TorchPolicy if stage == 3 else MixedPrecisionPolicy)(**fields) if mixed else None
    ours = FSDP(
        picked_net,
        stage=stage,
        auto_wrap=lambda m: id(m) in picked,
        mixed_precision=None if late else policy,
    )
    if late:
        ours.set_mixed_precision(policy)
    theirs = seeded(cls, seed=3)
    # tandem casts to output_dtype the model's outputs only: FSDP2 with it on the root only
    inner = {k: v for k, v in fields.items() if k != "output_dtype"}
    for name in (*wrapped, ""):
        module = theirs.get_submodule(name) if name else theirs
        policy = TorchPolicy(**(fields if not name else inner)) if mixed else TorchPolicy()
        fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=stage == 3)
    return ours, theirs


def _step(model, opt, case: str, step: int, accumulate: str | None, ours: bool):
    _, _, data, loss_fn = CASES[case]
    opt.zero_grad()
    micros = (0, 1) if accumulate else (0,)
    for micro in micros:
        last = micro == micros[-1]
        unsynced = accumulate == "no_sync" and not last
        if ours:
            context = model.no_sync() if unsynced else _nothing()
        else:
            model.set_requires_gradient_sync(not unsynced)
            context = _nothing()
        with context:
            loss, dtype = loss_fn(model, *data(step, micro))
            loss.backward()
    opt.step()
    return loss.detach(), dtype


class _nothing:
    def __enter__(self) -> None:
        pass

    def __exit__(self, *_) -> None:
        pass


def _run(name: str, mesh) -> dict:
    fields, case, stage, optimizer, accumulate = RUNS[name]
    ours, theirs = _pair(fields, case, stage, mesh, late=name.startswith("late"))
    cls, kwargs = OPTIMIZERS[optimizer]
    our_opt, their_opt = cls(ours.parameters(), **kwargs), cls(theirs.parameters(), **kwargs)
    steps = []
    with _Wire() as wire:
        for s in range(STEPS):
            steps.append(
                (
                    _step(ours, our_opt, case, s, accumulate, ours=True),
                    _step(theirs, their_opt, case, s, accumulate, ours=False),
                )
            )
    their_params = {k: v.full_tensor() for k, v in theirs.state_dict().items()}
    our_params = gathered_tensors(ours, their_params)
    full = ours.full_state_dict()
    out = {
        "losses_bitwise": [torch.equal(a[0], b[0]) for a, b in steps],
        "output_dtypes": sorted({str(a[1]) for a, _ in steps} | {str(b[1]) for _, b in steps}),
        "params_bitwise": all(torch.equal(v, their_params[k]) for k, v in our_params.items()),
        "gathered_dtypes": sorted({str(v.dtype) for v in our_params.values()}),
        "shard_dtypes": sorted({str(u.shard.dtype) for u in ours.units}),
        "grad_dtypes": sorted({str(u.shard.grad.dtype) for u in ours.units}),
        "all_gather_dtypes": sorted({str(d) for d, _ in wire.of("all_gather")}),
        "reduce_scatter_dtypes": sorted({str(d) for d, _ in wire.of("reduce_scatter")}),
    }
    if full is not None:  # rank 0
        plain = seeded(CASES[case][0], seed=0)
        plain.load_state_dict(full, strict=True)
        out["full_dtypes"] = sorted({str(v.dtype) for v in full.values()})
        out["full_bitwise"] = list(full) == list(their_params) and all(
            torch.equal(v, their_params[k]) for k, v in full.items()
        )
    return out


def _bytes(mesh) -> dict:
    """One training step's all-gathers with and without mixed precision: (dtype, bytes)."""
    sent = {}
    for mixed in (True, False):
        ours, _ = _pair(MAIN, "mlp", 3, mesh, mixed=mixed)
        opt = torch.optim.SGD(ours.parameters(), lr=0.1)
        with _Wire() as wire:
            _step(ours, opt, "mlp", 0, None, ours=True)
        sent[mixed] = wire.of("all_gather")
    return {
        "mixed": sent[True],
        "plain": sent[False],
        "ratio": sum(b for _, b in sent[True]) / sum(b for _, b in sent[False]),
    }


def _resume(mesh) -> dict:
    """5 steps, state saved (full: model and optimizer state dicts on rank 0; sharded: each
    rank's shards and optimizer state), a fresh wrapper loads it and takes 5 more, against 10
    uninterrupted steps."""
    cls, kwargs = OPTIMIZERS["adamw"]

    def fresh():
        model, _ = _pair(MAIN, "mlp", 3, mesh)
        return model, cls(model.parameters(), **kwargs)

    model, opt = fresh()
    losses = [_step(model, opt, "mlp", s, None, ours=True)[0] for s in range(STEPS)]
    out = {}
    for kind in ("full", "sharded"):
        model, opt = fresh()
        for s in range(5):
            _step(model, opt, "mlp", s, None, ours=True)
        if kind == "full":
            box = [model.full_state_dict(), model.full_optim_state_dict(opt)]
            dist.broadcast_object_list(box, src=0)
        else:
            box = [model.sharded_state_dict(), opt.state_dict()]
        model, opt = fresh()
        if kind == "full":
            model.load_full_state_dict(box[0])
            model.load_full_optim_state_dict(opt, box[1])
        else:
            model.load_sharded_state_dict(box[0])
            opt.load_state_dict(box[1])
        resumed = [_step(model, opt, "mlp", s, None, ours=True)[0] for s in range(5, STEPS)]
        out[kind] = all(torch.equal(a, b) for a, b in zip(losses[5:], resumed, strict=True))
    with model.gathered(writeback=False) as net:
        out["gathered_dtype"] = str(net.inp.weight.dtype)
    return out


def _disagreement() -> str | None:
    policy = MixedPrecisionPolicy(param_dtype=BF16 if dist.get_rank() == 0 else FP16)
    return refused(lambda: FSDP(seeded(MLP), mixed_precision=policy))


def _set_later(mesh) -> dict:
    """set_mixed_precision(): refused across differing ranks and inside a step; None undoes."""
    out = {}
    model, _ = _pair(MAIN, "mlp", 3, mesh, mixed=False)
    other = {"param_dtype": BF16 if dist.get_rank() == 0 else FP16}
    out["differing"] = refused(model.set_mixed_precision, other)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _floats(0)
    loss = F.mse_loss(model(x), y)  # its backward is pending
    try:
        model.set_mixed_precision(MAIN)
        out["mid_step"] = None
    except RuntimeError as e:
        out["mid_step"] = str(e)
    loss.backward()
    opt.step()
    model.set_mixed_precision(MAIN)
    with _Wire() as wire:
        _step(model, opt, "mlp", 1, None, ours=True)
    model.set_mixed_precision(None)
    with _Wire() as plain:
        _step(model, opt, "mlp", 2, None, ours=True)
    out["gathered"] = (
        sorted({str(d) for d, _ in wire.of("all_gather")}),
        sorted({str(d) for d, _ in plain.of("all_gather")}),
    )
    out["policy"] = repr(model.mixed_precision)
    return out


def _all() -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    # Linear on a 3-d input returns a view; nothing here writes to outputs in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out: dict = {("run", name): _run(name, mesh) for name in RUNS}
    out["bytes"] = _bytes(mesh)
    out["resume"] = _resume(mesh)
    out["disagreement"] = _disagreement()
    out["set_later"] = _set_later(mesh)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_all, 2, timeout=120)


@pytest.mark.parametrize("name", list(RUNS))
def test_training_equals_fsdp2(results, name):
    fields = RUNS[name][0]
    param = str(fields["param_dtype"])
    reduce = str(fields.get("reduce_dtype") or fields["param_dtype"])
    output = str(fields.get("output_dtype") or fields["param_dtype"])
    for rank, r in enumerate(results):
        t = r[("run", name)]
        context = f"rank {rank}: {t}"
        assert all(t["losses_bitwise"]) and t["params_bitwise"], context
        assert t["output_dtypes"] == [output], context
        assert t["all_gather_dtypes"] == [param], context
        assert t["reduce_scatter_dtypes"] == [reduce], context
        assert t["shard_dtypes"] == t["grad_dtypes"] == t["gathered_dtypes"] == ["torch.float32"]
        if rank == 0:
            assert t["full_dtypes"] == ["torch.float32"] and t["full_bitwise"], context


def test_all_gathers_send_half_the_bytes(results):
    for rank, r in enumerate(results):
        b = r["bytes"]
        assert b["mixed"] and {d for d, _ in b["mixed"]} == {BF16}, (rank, b)
        assert {d for d, _ in b["plain"]} == {FP32}, (rank, b)
        assert len(b["mixed"]) == len(b["plain"]) and b["ratio"] == 0.5, (rank, b)


def test_resume_from_full_and_sharded_state_is_bitwise(results):
    expected = {"full": True, "sharded": True, "gathered_dtype": "torch.float32"}
    for rank, r in enumerate(results):
        assert r["resume"] == expected, rank


def test_policy_differing_across_ranks_raises_everywhere(results):
    for rank, r in enumerate(results):
        message = r["disagreement"]
        assert message is not None and "mixed precision differs" in message, (rank, message)
        assert "bfloat16" in message and "float16" in message, (rank, message)


def test_set_mixed_precision_refusals_and_undo(results):
    for rank, r in enumerate(results):
        t = r["set_later"]
        assert t["differing"] is not None and "mixed precision differs" in t["differing"], t
        assert "bfloat16" in t["differing"] and "float16" in t["differing"], t
        assert t["mid_step"] is not None and "between optimizer steps" in t["mid_step"], t
        assert t["gathered"] == (["torch.bfloat16"], ["torch.float32"]), (rank, t)
        assert t["policy"] == "None", (rank, t)
