"""tandem.DDP on CUDA trains bit for bit as torch's own DistributedDataParallel.

Oracle: torch.nn.parallel.DistributedDataParallel built in the same process, from the same
seeds, on the same device, fed the same data. After a few SGD steps (momentum 0.9) the
parameters and buffers of both engines are ``torch.equal`` on every rank, and after every step
the same parameters are left with ``.grad`` None. World size 2 is two processes on the one GPU
over Gloo with CUDA tensors (NCCL, a GPU each, where there are two), with deterministic
kernels (``gpu.deterministic()``); at world size 2 the mean is exact whatever the order of the
sum, so any difference is the engine's.

1. Parity, one run of two processes per group of cases (a case that raises is reported, and
   the next one still runs): an MLP; a wide MLP (large gradients copied into their bucket as
   they become ready, the division fused, handed back as views of the bucket); a conv net
   with BatchNorm (buffers broadcast); find_unused_parameters=True on a model whose heads sit
   out some steps, one of them never called (its ``.grad`` stays None on every rank, as in
   torch); gradient accumulation under no_sync; static_graph=True with a layer applied twice
   and one never used; gradient_as_bucket_view=True; tandem's fp16 and bf16 compression hooks
   against torch's own (``default_hooks``); activation checkpointing (non-reentrant
   ``torch.utils.checkpoint`` inside forward), with and without find_unused_parameters.
2. Uneven inputs (rank r holds 3 + 2r batches): ``tandem.join`` against torch's
   ``model.join()``, for a conv net with BatchNorm and for the mean over the ranks still
   training; every replica ends with the last joiner's model.
3. A parameter that gets no gradient, without find_unused_parameters: UnusedParametersError on
   every rank, naming each rank's parameters and the flag, also when only one rank missed it
   (where torch's DDP hangs). On a GPU the count is read without making the CPU wait for the
   GPU, so the error comes at the next forward (``end_of_backward.py``); on the CPU (the
   rehearsal) in the backward itself. Never a hang: the harness timeout fails one.
4. World size 1 over NCCL (a real GPU): the same parity, inputs moved by ``device_ids``.
5. Peak GPU memory (a real GPU): tandem.DDP's ``torch.cuda.max_memory_allocated()`` over a
   few steps of 8 x Linear(1024, 1024) exceeds torch's DDP's by at most one bucket (25 MiB),
   measured in the same process, one engine after the other (torch's first), from the model's
   construction on.
"""

from __future__ import annotations

import gc
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.checkpoint import checkpoint

import tandem
from tandem.doctor import records
from tandem.parallel.ddp.comm_hooks import bf16_compress_hook, fp16_compress_hook
from tandem.parallel.ddp.end_of_backward import UnusedParametersError
from tests import models
from tests.cuda import gpu
from tests.harness import run_ranks

pytestmark = [pytest.mark.cuda, pytest.mark.distributed]

STEPS = 4
PER_RANK = 6
TIMEOUT = 120  # seconds per run of processes: a hang fails fast, with every rank's stack
MiB = 1024 * 1024


# -- models (device-aware: built on the CPU from a seed, then moved) ---------------------------


class Branchy(nn.Module):
    """A trunk and two heads; ``use`` picks the heads, so some parameters sit out some steps.

    tests.models.Branchy creates its zeros on the CPU; these follow the input.
    """

    def __init__(self, never: bool = True) -> None:
        super().__init__()
        self.trunk = nn.Linear(10, 16)
        self.left = nn.Linear(16, 3)
        self.right = nn.Linear(16, 3)
        self.never = nn.Linear(16, 3) if never else None  # registered, never called

    def forward(self, x: torch.Tensor, use: str = "both") -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        out = x.new_zeros(x.shape[0], 3)
        if use in ("left", "both"):
            out = out + self.left(h)
        if use in ("right", "both"):
            out = out + self.right(h)
        return out


class Static(nn.Module):
    """A layer applied twice per forward and one never used: static_graph's cases."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(10, 16)
        self.shared = nn.Linear(16, 16)
        self.idle = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h))
        return self.head(h)


class Checkpointed(nn.Module):
    """A stem, then two blocks and the output layer, each through non-reentrant checkpoint()."""

    def __init__(self, never: bool = False) -> None:
        super().__init__()
        self.stem = nn.Linear(10, 16)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2)])
        self.head = nn.Linear(16, 3)
        self.never = nn.Linear(16, 3) if never else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False)
        return checkpoint(self.head, h, use_reentrant=False)


def _build(name: str, seed: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
    if name in ("mlp", "wide", "conv_bn"):
        return getattr(models, name)(seed=seed, dtype=dtype).to(device)
    torch.manual_seed(seed)
    local = {
        "branchy": Branchy,
        "static": Static,
        "checkpointed": Checkpointed,
        "checkpointed_never": lambda: Checkpointed(never=True),
        "branchy_two_heads": lambda: Branchy(never=False),
    }
    return local[name]().to(dtype).to(device)


def _torch_bf16_hook(state, bucket):
    # torch refuses its bf16 hook by name unless on CUDA+NCCL; called through this wrapper it
    # runs on Gloo too, and it is torch's own code that runs.
    return default_hooks.bf16_compress_hook(state, bucket)


# hook name: (tandem's hook, torch's hook)
HOOKS = {
    "fp16": (fp16_compress_hook, default_hooks.fp16_compress_hook),
    "bf16": (bf16_compress_hook, _torch_bf16_hook),
}

# name: model, input shape, dtype, DDP kwargs (both engines), hook, micro-batches per step
CASES: dict[str, tuple] = {
    "plain": ("mlp", (10,), torch.float64, {}, None, 1),
    "large_gradients": ("wide", (10,), torch.float64, {}, None, 1),
    "conv_bn": ("conv_bn", (1, 6, 6), torch.float64, {}, None, 1),
    "find_unused": ("branchy", (10,), torch.float64, {"find_unused_parameters": True}, None, 1),
    "no_sync": ("mlp", (10,), torch.float64, {}, None, 3),
    "static_graph": ("static", (10,), torch.float64, {"static_graph": True}, None, 1),
    "bucket_view": ("wide", (10,), torch.float64, {"gradient_as_bucket_view": True}, None, 1),
    "fp16_hook": ("mlp", (10,), torch.float32, {}, "fp16", 1),
    "bf16_hook": ("mlp", (10,), torch.float32, {}, "bf16", 1),
    "checkpoint": ("checkpointed", (10,), torch.float64, {}, None, 1),
    "checkpoint_find_unused": (
        "checkpointed_never", (10,), torch.float64, {"find_unused_parameters": True}, None, 1,
    ),
}  # fmt: skip

# the parameters that never get a gradient, per case: .grad None after every step, both engines
NEVER = {
    "find_unused": "never.weight",
    "static_graph": "idle.weight",
    "checkpoint_find_unused": "never.weight",
}


def _use_for(step: int, rank: int) -> str:
    # Same on all ranks in some steps, different in others: both unused paths get exercised.
    return ["both", "left", "left" if rank == 0 else "right"][step % 3]


# -- 1. parity -------------------------------------------------------------------------------


def _train_both(case: str, device_ids: bool = False) -> dict:
    """STEPS steps of tandem.DDP and of torch's DDP on the same seeds, data and device.

    ``device_ids``: pass ``[device index]`` to both engines and leave the inputs on the CPU
    (each engine moves them); otherwise the inputs are moved here.
    """
    rank = dist.get_rank()
    dev = gpu.device()
    name, shape, dtype, ddp_kw, hook, micro = CASES[case]
    kw = dict(ddp_kw)
    if device_ids:
        kw["device_ids"] = [dev.index]
    ours = tandem.DDP(_build(name, rank, dtype, dev), **kw)
    theirs = TorchDDP(_build(name, rank, dtype, dev), **kw)
    if hook is not None:
        ours.register_comm_hook(None, HOOKS[hook][0])
        theirs.register_comm_hook(None, HOOKS[hook][1])
    start = [p.detach().clone() for p in ours.module.parameters()]
    opt_ours = models.make_optimizer("sgd", ours.parameters())
    opt_theirs = models.make_optimizer("sgd", theirs.parameters())
    grads_none = []
    for step in range(STEPS):
        for model, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            opt.zero_grad(set_to_none=True)
            for m in range(micro):
                x, y = models.batch(step * 10 + m, rank, PER_RANK, shape, dtype)
                x, y = (x if device_ids else x.to(dev)), y.to(dev)
                kwargs = {"use": _use_for(step, rank)} if name == "branchy" else {}
                if m < micro - 1:
                    with model.no_sync():
                        F.cross_entropy(model(x, **kwargs), y).backward()
                else:
                    F.cross_entropy(model(x, **kwargs), y).backward()
            opt.step()
        grads_none.append(
            [[n for n, p in m.module.named_parameters() if p.grad is None] for m in (ours, theirs)]
        )
    ours_state, theirs_state = ours.module.state_dict(), theirs.module.state_dict()
    return {
        "device": str(dev),
        "on": str(next(ours.module.parameters()).device),
        "equal": all(torch.equal(ours_state[k], theirs_state[k]) for k in ours_state),
        "diff": models.max_diff(ours.module, theirs.module),
        "moved": any(
            not torch.equal(a, p) for a, p in zip(start, ours.module.parameters(), strict=True)
        ),
        "grads_none": grads_none,
    }


def _train_cases(cases: list[str], device_ids: bool = False) -> dict[str, dict]:
    gpu.deterministic()
    # One run of processes for several cases: each run pays for process start, the CUDA
    # context, and the first torch DDP's import of torch._dynamo. A case that raises (on every
    # rank alike, or the ranks would wait for each other until the timeout) is reported, and
    # the next case still runs: the GPU machine runs this file once.
    out = {}
    for case in cases:
        try:
            out[case] = _train_both(case, device_ids)
        except Exception:
            out[case] = {"error": traceback.format_exc()}
    return out


def _assert_parity(results: list[dict[str, dict]]) -> None:
    failures = []
    for rank, by_case in enumerate(results):
        for case, r in by_case.items():
            if "error" in r:
                failures.append(f"{case}, rank {rank} raised:\n{r['error']}")
                continue
            where = f"{case}, rank {rank} on {r['on']}"
            if r["on"] != r["device"]:
                failures.append(f"{where}: the model is not on {r['device']}")
            if not r["equal"]:
                failures.append(f"{where}: differs from torch's DDP by up to {r['diff']:.3g}")
            if not r["moved"]:
                failures.append(f"{where}: the parameters never moved")
            for step, (ours_none, theirs_none) in enumerate(r["grads_none"]):
                if ours_none != theirs_none:
                    failures.append(f"{where}, step {step}: .grad None {ours_none}, {theirs_none}")
            never = NEVER.get(case)
            if never and not all(never in ours for ours, _ in r["grads_none"]):
                failures.append(f"{where}: {never} got a gradient: {r['grads_none']}")
    assert not failures, "\n".join(failures)


# One run of two processes per group (a few seconds each, most of it fixed cost).
GROUPS = {
    "dense": ["plain", "large_gradients", "conv_bn", "no_sync", "bucket_view"],
    "graph": ["find_unused", "static_graph", "checkpoint", "checkpoint_find_unused"],
    "hooks": ["fp16_hook", "bf16_hook"],
}
assert sorted(c for g in GROUPS.values() for c in g) == sorted(CASES)


@pytest.mark.parametrize("group", list(GROUPS))
def test_equals_torch_ddp(group):
    results = run_ranks(
        _train_cases,
        2,
        args=(GROUPS[group],),
        timeout=TIMEOUT,
        init=gpu.backend(2),
        env=gpu.env(),
    )
    _assert_parity(results)


# -- 2. uneven inputs: join ------------------------------------------------------------------

JOIN_CASES = {
    # name: model, input shape, divide_by_initial_world_size
    "conv_bn": ("conv_bn", (1, 6, 6), True),
    "divide_by_training_ranks": ("mlp", (10,), False),
}


def _train_joined(engine: str, case: str) -> dict:
    rank = dist.get_rank()
    dev = gpu.device()
    name, shape, divide_initial = JOIN_CASES[case]
    wrapper = tandem.DDP if engine == "tandem" else TorchDDP
    model = wrapper(_build(name, rank, torch.float64, dev))
    opt = models.make_optimizer("sgd", model.parameters())
    if engine == "tandem":
        context = tandem.join([model], divide_by_initial_world_size=divide_initial)
    else:
        context = model.join(divide_by_initial_world_size=divide_initial)
    steps = 0
    with context:
        for step in range(3 + 2 * rank):
            x, y = models.batch(step, rank, 4, shape)
            opt.zero_grad()
            F.cross_entropy(model(x.to(dev)), y.to(dev)).backward()
            opt.step()
            steps += 1
    return {"state": model.module.state_dict(), "steps": steps}


def _join_cases() -> dict[str, dict]:
    gpu.deterministic()
    out = {}
    for case in JOIN_CASES:
        ours = _train_joined("tandem", case)
        theirs = _train_joined("torch", case)
        out[case] = {
            "equal": all(torch.equal(v, theirs["state"][k]) for k, v in ours["state"].items()),
            "diff": max(
                (v.double() - theirs["state"][k].double()).abs().max().item()
                for k, v in ours["state"].items()
            ),
            "steps": (ours["steps"], theirs["steps"]),
            "state": {k: v.cpu() for k, v in ours["state"].items()},
        }
    return out


def test_join_with_uneven_inputs_equals_torch():
    results = run_ranks(_join_cases, 2, timeout=TIMEOUT, init=gpu.backend(2), env=gpu.env())
    for rank, by_case in enumerate(results):
        for case, r in by_case.items():
            assert r["equal"], f"{case}, rank {rank}: differs from torch's by {r['diff']:.3g}"
            assert r["steps"] == (3 + 2 * rank, 3 + 2 * rank), (case, rank, r["steps"])
    for case in JOIN_CASES:
        # every replica ends with the last joiner's model
        first, second = results[0][case]["state"], results[1][case]["state"]
        assert all(torch.equal(first[k], second[k]) for k in first), case


# -- 3. a parameter without a gradient -------------------------------------------------------


def _missing_gradient(only_rank0: bool) -> dict:
    """A good step, then one where rank 0 (or every rank) leaves out the right head, then the
    next forward: where does UnusedParametersError come?"""
    rank = dist.get_rank()
    dev = gpu.device()
    model = tandem.DDP(_build("branchy_two_heads", rank, torch.float32, dev))
    x, y = (t.to(dev) for t in models.batch(0, rank, 4, (10,), torch.float32))
    F.cross_entropy(model(x, use="both"), y).backward()  # no rank misses anything
    use = "left" if (rank == 0 or not only_rank0) else "both"
    where = ""
    with pytest.raises(UnusedParametersError) as info:
        where = "backward"
        F.cross_entropy(model(x, use=use), y).backward()
        where = "next forward"
        model(x, use="both")
        where = "nowhere"
    return {"message": str(info.value), "where": where, "device": dev.type}


def _missing_gradients() -> dict[bool, dict]:
    gpu.deterministic()
    return {only_rank0: _missing_gradient(only_rank0) for only_rank0 in (False, True)}


def test_missing_gradient_without_flag_raises_on_every_rank():
    results = run_ranks(_missing_gradients, 2, timeout=TIMEOUT, init=gpu.backend(2), env=gpu.env())
    for rank, by_case in enumerate(results):
        for only_rank0, r in by_case.items():
            what = f"rank {rank}, only rank 0 missed: {only_rank0}"
            # On a GPU the count is read at the next forward, on the CPU at once.
            expected = "next forward" if r["device"] == "cuda" else "backward"
            assert r["where"] == expected, (what, r)
            message = r["message"]
            assert "find_unused_parameters=True" in message, (what, message)
            assert "rank 0: right.weight, right.bias" in message, (what, message)
            # rank 1 used the right head in the one-rank case: no line for it then
            assert ("rank 1: right.weight, right.bias" in message) is (not only_rank0), (
                what,
                message,
            )


# -- 4. world size 1 over NCCL ---------------------------------------------------------------


@gpu.needs_real_gpu("NCCL")
def test_world_size_1_nccl_equals_torch_ddp():
    cases = ["plain", "large_gradients", "find_unused", "bucket_view", "fp16_hook", "bf16_hook"]
    results = run_ranks(
        _train_cases, 1, args=(cases, True), timeout=TIMEOUT, init="nccl", env=gpu.env()
    )
    _assert_parity(results)


# -- 5. peak GPU memory ----------------------------------------------------------------------

MEMORY_LAYERS = 8
MEMORY_WIDTH = 1024
BUCKET_BYTES = 25 * MiB  # bucket_cap_mb's default, in both engines


def _stack(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(MEMORY_LAYERS):
        layers += [nn.Linear(MEMORY_WIDTH, MEMORY_WIDTH), nn.Tanh()]
    return nn.Sequential(*layers)


def _memory(engine: str) -> dict:
    """CUDA memory allocated by one engine over STEPS steps, above what was there before: its
    peak, what is left at the end, and (a diagnosis for a failure) the collectives whose work
    tandem's records still hold (a Work keeps its tensors alive)."""
    rank = dist.get_rank()
    dev = gpu.device()
    gc.collect()
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    wrapper = tandem.DDP if engine == "tandem" else TorchDDP
    model = wrapper(_stack(rank).to(dev))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x = torch.randn(32, MEMORY_WIDTH, generator=g).to(dev)
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
    torch.cuda.synchronize(dev)
    out = {
        "peak": torch.cuda.max_memory_allocated(dev) - before,
        "end": torch.cuda.memory_allocated(dev) - before,
        "held": [
            f"{r.op} ({r.context}) {r.shapes}" for r in records.recent() if r.work is not None
        ],
    }
    del model, opt, x
    gc.collect()
    return out


def _peaks() -> dict[str, dict]:
    gpu.deterministic()
    # torch's first: what tandem leaves allocated (or frees late) then cannot shift its baseline.
    return {engine: _memory(engine) for engine in ("torch", "tandem")}


@gpu.needs_real_gpu("CUDA memory statistics")
def test_peak_memory_within_one_bucket_of_torch_ddp():
    results = run_ranks(_peaks, 2, timeout=TIMEOUT, init=gpu.backend(2), env=gpu.env())
    for rank, by_engine in enumerate(results):
        ours, theirs = by_engine["tandem"], by_engine["torch"]
        message = (
            f"rank {rank}: tandem.DDP peak {ours['peak'] / MiB:.1f} MiB ({ours['peak']} bytes), "
            f"torch DDP peak {theirs['peak'] / MiB:.1f} MiB ({theirs['peak']} bytes), one bucket "
            f"{BUCKET_BYTES / MiB:.0f} MiB; left allocated after the steps: tandem "
            f"{ours['end'] / MiB:.1f} MiB, torch {theirs['end'] / MiB:.1f} MiB; collectives whose "
            f"work tandem's records still held: {ours['held']}"
        )
        assert theirs["peak"] > 0, message  # the measurement saw the model at all
        assert ours["peak"] - theirs["peak"] <= BUCKET_BYTES, message
