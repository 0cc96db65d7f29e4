"""tandem's sharded engines on CUDA take the steps of torch's own, bit for bit.

Oracles, run side by side in the same ranks on the same device, from the same seeds and data:

1. FullyShardedDataParallel, float32, against torch's FSDP2 (``fully_shard`` on a CUDA device
   mesh, the same modules made units, the rest to the root in both): stage 3 against
   ``reshard_after_forward=True``, stage 2 against ``reshard_after_forward=False``; an MLP and
   a model with tied weights; SGD (momentum, weight decay) and AdamW; 5 steps. Every step's
   loss on every rank and every final parameter are ``torch.equal`` to FSDP2's (the CPU proof
   and its reasoning: tests/parallel/fsdp/test_fsdp_torch_parity.py; bitwise at world size 2
   because each reduced element is the sum of two addends, which commute, divided by 2, which
   is exact).
2. Mixed precision, ``param_dtype=bfloat16, reduce_dtype=float32`` (tandem's policy) against
   ``MixedPrecisionPolicy(...)`` of the same fields on every ``fully_shard``, stages 3 and 2,
   both models, AdamW; and ``reduce_dtype=None`` (reduced in bfloat16, torch's default) with
   SGD: losses, output dtypes and final float32 master parameters ``torch.equal`` to FSDP2's,
   as on the CPU (tests/parallel/fsdp/test_fsdp_mixed_precision.py); every all-gather tandem
   sends is bfloat16, every reduce-scatter the reduce dtype, the shards stay float32.
3. ShardedOptimizer (ZeRO-1, under tandem.DDP) against torch's ``ZeroRedundancyOptimizer``
   (under tandem.DDP too), Adam and AdamW, 5 steps: both end bitwise equal to each other and
   to the plain optimizer run in one process on the whole batch (a model whose gradients are
   exact, as in tests/parallel/test_zero.py); each parameter's state lives on one rank.
4. World size 1 over NCCL (a real GPU): FSDP stage 3 and 2 against ``fully_shard``, float32
   and bfloat16, bitwise.

World size 2 is two processes on the one GPU, over Gloo with CUDA tensors (NCCL, a GPU each,
where there are two). What Gloo does with CUDA tensors, read in torch's source
(``torch/csrc/distributed/c10d/ProcessGroupGloo.cpp``, ``ProcessGroupGlooCuda.cpp``):
``broadcast`` (``AsyncBroadcastCUDAWork``), ``all_reduce`` (the CUDA entry of
``GlooAllreduceRegistry``: ``AsyncAllreduceCUDAHostWork`` over TCP, which has no GPUDirect;
AVG is the sum divided by N) and ``all_gather`` (``AsyncAllgatherCUDAWork``) copy through
pinned host memory; ``all_gather_into_tensor`` is ``_allgather_base``, which chunks the output
and calls ``allgather``; ``reduce_scatter_tensor`` is ``_reduce_scatter_base`` ->
``reduce_scatter_tensor_coalesced``, which all-reduces a clone of the input and copies this
rank's chunk out when the work is waited for (a ``LambdaWork``); the list ``reduce_scatter`` is
one all-reduce per rank (since pytorch#149869, 2025; before it Gloo refused it on every
device). Not on CUDA: ``allreduce_coalesced`` (refuses any device but the CPU) and
``allgather_coalesced`` (no CUDA work). Neither FSDP issues those: tandem sends one flat buffer
per unit (``broadcast`` at construction, ``all_gather_into_tensor``, ``reduce_scatter_tensor``
with SUM), FSDP2 one ``all_gather_into_tensor`` and one ``reduce_scatter_tensor`` per group,
with AVG for float32 and bfloat16 (``_fsdp_collectives._get_gradient_divide_factors``). An
older ``reduce_scatter_tensor_coalesced`` (pytorch commit c194358a) built the all-reduce's
options and did not pass them: the op was dropped, AVG came back as the sum. So each
collective the FSDP engines send, with its dtypes and ops, is probed and its values checked
in a test of its own (its own pair of ranks: one that crashes the process names itself), and
each FSDP case runs in a pair of ranks of its own too; the ZeRO run probes its collectives
first and skips, naming the collective, if one raises or returns a wrong value.

``init_device_mesh("cuda", ...)`` over a Gloo default group makes a new Gloo group for the
mesh (torch's ``device_mesh.py``) and sets the rank's device from ``LOCAL_RANK`` unless CUDA
is initialized: each rank picks its device (``gpu.device()``) and touches it first.

The models differ from the CPU tests' in one way: every parameter starts a multiple of 256
bytes into tandem's flat buffer (in float32 and in bfloat16), as FSDP2's parameters (each its
own allocation) do. cuBLASLt picks its kernel by the alignment of the operands' pointers
(torch's ``CUDABlas.cpp`` passes it as ``CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES``), so with
other offsets the two could run different kernels on the same numbers, which says nothing of
the engines. The uneven shards stay: the MLP's last layer has 3 rows, its scale 3 elements.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

import tandem
import tandem.parallel.fsdp.flat as flat
from tandem.parallel.fsdp.precision import MixedPrecisionPolicy
from tandem.parallel.zero import ShardedOptimizer
from tests.cuda import gpu
from tests.harness import run_ranks
from tests.parallel.fsdp.models import FSDP, OPTIMIZERS, gathered_tensors, seeded

try:  # FSDP2: public from torch 2.6 on
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard
except ImportError:
    pytest.skip("this torch has no FSDP2 (fully_shard)", allow_module_level=True)

pytestmark = [pytest.mark.cuda, pytest.mark.distributed]

STEPS = 5
PER_RANK = 4
VOCAB = 16
TIMEOUT = 120  # seconds per run of processes: a hang fails fast, with every rank's stack
BF16, FP32 = torch.bfloat16, torch.float32
EPS = torch.finfo(FP32).eps
EXPECTED_DEVICE = "cpu" if gpu.ON_CPU else "cuda"


# -- models: each parameter 256 bytes aligned in its unit's flat buffer (see the docstring) -----


class MLP(nn.Module):
    """Units ``inp`` (128 + 16 elements), ``mid`` (256 + 16), ``out`` (48: 3 rows, no bias) and
    the root's ``scale`` (3 elements: padded by both engines at world size 2)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 16)
        self.out = nn.Linear(16, 3, bias=False)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(torch.tanh(self.inp(x))))
        return self.out(h) * self.scale


class Tied(nn.Module):
    """Embedding and output projection share one weight (kept by the root in both engines, with
    the head's bias after its 256 elements); ``mid`` is a unit of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.embed(tokens))))


def _mine(*tensors: torch.Tensor, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """This rank's slice of each global batch, on ``dev``."""
    rank = dist.get_rank()
    return tuple(t[PER_RANK * rank : PER_RANK * (rank + 1)].to(dev) for t in tensors)


def _floats(step: int, dev: torch.device):
    g = torch.Generator().manual_seed(1000 + step)
    n = PER_RANK * dist.get_world_size()
    return _mine(torch.randn(n, 8, generator=g), torch.randn(n, 3, generator=g), dev=dev)


def _tokens(step: int, dev: torch.device):
    g = torch.Generator().manual_seed(2000 + step)
    n = PER_RANK * dist.get_world_size()
    x, y = (torch.randint(0, VOCAB, (n, 6), generator=g) for _ in range(2))
    return _mine(x, y, dev=dev)


def _mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
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
# name: (policy fields or None, case, stage, optimizer)
FLOAT32_RUNS = {
    f"{case}-stage{stage}-{opt}": (None, case, stage, opt)
    for case in CASES
    for stage in (3, 2)
    for opt in OPTIMIZERS
}
MIXED_RUNS = {
    **{
        f"bf16-{case}-stage{stage}": (MAIN, case, stage, "adamw")
        for case in CASES
        for stage in (3, 2)
    },
    "bf16-reduce-bf16": ({"param_dtype": BF16}, "mlp", 3, "sgd"),
}
NCCL_RUNS = {
    "mlp-stage3-adamw": (None, "mlp", 3, "adamw"),
    "tied-stage2-sgd": (None, "tied", 2, "sgd"),
    "bf16-mlp-stage3": (MAIN, "mlp", 3, "adamw"),
}


# -- which collectives the group runs right on this device --------------------------------------


def _reduce_scatter(output, input, op, async_op=False):
    """torch's flat reduce-scatter (``reduce_scatter_single`` from torch 2.13) with ``op``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=op, async_op=async_op)


def _check(got: torch.Tensor, expected: list[float]) -> str | None:
    values = got.float().cpu().tolist()
    return None if values == expected else f"returned {values}, expected {expected}"


def _probe_broadcast(dev, rank, ws, dtype):
    t = torch.full((5,), rank + 1, dtype=dtype, device=dev)
    dist.broadcast(t, src=0)
    return _check(t, [1.0] * 5)


def _probe_all_reduce(dev, rank, ws, dtype):
    t = torch.full((3,), rank + 1.0, dtype=dtype, device=dev)
    dist.all_reduce(t)
    return _check(t, [ws * (ws + 1) / 2] * 3)


def _probe_all_gather(dev, rank, ws, dtype):
    out = torch.empty(3 * ws, dtype=dtype, device=dev)
    flat.all_gather_flat(out, torch.full((3,), rank + 1.0, dtype=dtype, device=dev))
    return _check(out, [float(r + 1) for r in range(ws) for _ in range(3)])


def _probe_reduce_scatter(dev, rank, ws, dtype, op):
    base = torch.arange(2 * ws, dtype=dtype, device=dev)
    out = torch.empty(2, dtype=dtype, device=dev)
    # asynchronous, waited for later: how tandem issues it
    _reduce_scatter(out, base * (rank + 1), op, async_op=True).wait()
    total = ws * (ws + 1) / 2 / (ws if op == dist.ReduceOp.AVG else 1)
    return _check(out, [v * total for v in range(2 * rank, 2 * rank + 2)])


# name: the probe, (device, rank, world size) -> what went wrong or None
PROBES = {
    "broadcast(float32)": lambda *a: _probe_broadcast(*a, FP32),
    "broadcast(uint8)": lambda *a: _probe_broadcast(*a, torch.uint8),
    "all_reduce(SUM, float32)": lambda *a: _probe_all_reduce(*a, FP32),
    "all_gather_into_tensor(float32)": lambda *a: _probe_all_gather(*a, FP32),
    "all_gather_into_tensor(bfloat16)": lambda *a: _probe_all_gather(*a, BF16),
    "reduce_scatter_tensor(SUM, float32)": lambda *a: _probe_reduce_scatter(
        *a, FP32, dist.ReduceOp.SUM
    ),
    "reduce_scatter_tensor(AVG, float32)": lambda *a: _probe_reduce_scatter(
        *a, FP32, dist.ReduceOp.AVG
    ),
    "reduce_scatter_tensor(AVG, bfloat16)": lambda *a: _probe_reduce_scatter(
        *a, BF16, dist.ReduceOp.AVG
    ),
}
FSDP_OPS = [name for name in PROBES if not name.startswith("all_reduce")]
ZERO_OPS = ["broadcast(float32)", "broadcast(uint8)", "all_reduce(SUM, float32)"]


def _gaps(dev: torch.device, names: list[str]) -> list[str]:
    """The collectives of ``names`` that this group cannot run right on ``dev``, each with what
    it did, on any rank (every rank answers the same)."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    mine = []
    for name in names:
        try:
            problem = PROBES[name](dev, rank, ws)
        except (RuntimeError, NotImplementedError, ValueError) as e:
            problem = f"raised {type(e).__name__}: {str(e).strip().splitlines()[0]}"
        if problem is not None:
            mine.append(f"{dist.get_backend()} {name} on {dev.type} tensors {problem}")
    everyone: list = [None] * ws
    dist.all_gather_object(everyone, mine)
    return sorted({gap for gaps in everyone for gap in gaps})


def _skip_if_gaps(results: list[dict]) -> None:
    gaps = results[0].get("gaps")
    if gaps:
        pytest.skip("the group cannot run what the engines send: " + "; ".join(gaps))


# -- FSDP against fully_shard, in ranks ----------------------------------------------------------


def _device_and_mesh(world_size: int):
    """This rank's device (touched, so that CUDA is initialized) and a 1-d mesh over it."""
    from torch.distributed.device_mesh import init_device_mesh

    dev = gpu.device()
    torch.zeros(1, device=dev)  # the mesh keeps the current device only once CUDA is initialized
    # Linear on a 3-d input returns a view; nothing here writes to outputs in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    return dev, init_device_mesh(dev.type, (world_size,))


def _pair(fields: dict | None, case: str, stage: int, mesh, dev: torch.device):
    """tandem's and FSDP2's wrapping of the same model on ``dev``, cut into the same groups,
    with the same policy on every unit (tandem's own class at stage 2, torch's at stage 3:
    both are accepted)."""
    cls, wrapped, _, _ = CASES[case]
    net = seeded(cls, seed=3).to(dev)
    picked = {id(net.get_submodule(name)) for name in wrapped}
    ours_policy = None
    if fields is not None:
        ours_policy = (TorchPolicy if stage == 3 else MixedPrecisionPolicy)(**fields)
    ours = FSDP(net, stage=stage, auto_wrap=lambda m: id(m) in picked, mixed_precision=ours_policy)
    theirs = seeded(cls, seed=3).to(dev)
    for name in (*wrapped, ""):
        fully_shard(
            theirs.get_submodule(name),
            mesh=mesh,
            reshard_after_forward=stage == 3,
            mp_policy=TorchPolicy(**(fields or {})),
        )
    return ours, theirs


class _Wire:
    """The input dtypes of tandem's all-gathers and reduce-scatters while it is entered
    (``tandem.parallel.fsdp.flat``'s functions, replaced in this process meanwhile)."""

    def __init__(self) -> None:
        self.sent: dict[str, set[str]] = {"all_gather": set(), "reduce_scatter": set()}
        self.originals = (flat.all_gather_flat, flat.reduce_scatter_flat)

    def _spy(self, op: str, fn):
        def call(output, input, *args, **kwargs):
            self.sent[op].add(str(input.dtype))
            return fn(output, input, *args, **kwargs)

        return call

    def __enter__(self) -> _Wire:
        flat.all_gather_flat = self._spy("all_gather", self.originals[0])
        flat.reduce_scatter_flat = self._spy("reduce_scatter", self.originals[1])
        return self

    def __exit__(self, *_) -> None:
        flat.all_gather_flat, flat.reduce_scatter_flat = self.originals


def _whole(v) -> torch.Tensor:
    """The whole of an FSDP2 parameter (a DTensor sharded on dim 0), on the CPU: every rank's
    local chunk (``torch.chunk``'s, unpadded), gathered as objects and joined in rank order.
    Not ``full_tensor()``: DTensor's padded all-gather, then unpad, over Gloo with CUDA tensors
    crashes the process with a segfault in torch 2.11 (seen on an H100: ``unpad_tensor`` in
    ``_collective_utils.py``), after both engines' training has ended."""
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, v.to_local().detach().cpu())
    return torch.cat(parts, dim=0)


def _run(spec: tuple, mesh, dev: torch.device) -> dict:
    fields, case, stage, optimizer = spec
    _, _, data, loss_fn = CASES[case]
    ours, theirs = _pair(fields, case, stage, mesh, dev)
    cls, kwargs = OPTIMIZERS[optimizer]
    opts = (cls(ours.parameters(), **kwargs), cls(theirs.parameters(), **kwargs))
    losses, dtypes = [], set()
    with _Wire() as wire:
        for step in range(STEPS):
            pair = []
            for model, opt in zip((ours, theirs), opts, strict=True):
                opt.zero_grad()
                loss, dtype = loss_fn(model, *data(step, dev))
                loss.backward()
                opt.step()
                pair.append(loss.detach())
                dtypes.add(str(dtype))
            losses.append(pair)
    their_params = {k: _whole(v) for k, v in theirs.state_dict().items()}
    our_params = {k: v.cpu() for k, v in gathered_tensors(ours, their_params).items()}
    return {
        "losses_bitwise": [torch.equal(a, b) for a, b in losses],
        "loss_eps": max(((a - b).abs() / b.abs()).item() for a, b in losses) / EPS,
        "params_bitwise": list(our_params) == list(their_params)
        and all(torch.equal(v, their_params[k]) for k, v in our_params.items()),
        "param_eps": max(
            ((v - their_params[k]).abs() / their_params[k].abs().clamp_min(1)).max().item()
            for k, v in our_params.items()
        )
        / EPS,
        "devices": sorted(
            {u.shard.device.type for u in ours.units} | {p.device.type for p in theirs.parameters()}
        ),
        "sharded": all(type(p).__name__ == "DTensor" for p in theirs.parameters()),
        "output_dtypes": sorted(dtypes),
        "shard_dtypes": sorted({str(u.shard.dtype) for u in ours.units}),
        "grad_dtypes": sorted({str(u.shard.grad.dtype) for u in ours.units}),
        "all_gather_dtypes": sorted(wire.sent["all_gather"]),
        "reduce_scatter_dtypes": sorted(wire.sent["reduce_scatter"]),
    }


def _fsdp_runs(names: list[str]) -> dict:
    gpu.deterministic()
    dev, mesh = _device_and_mesh(dist.get_world_size())
    runs = {**FLOAT32_RUNS, **MIXED_RUNS, **NCCL_RUNS}
    return {name: _run(runs[name], mesh, dev) for name in names}


def _fsdp_results(name: str) -> list[dict]:
    # One pair of ranks per case: a case that crashes its ranks fails alone, with its stack.
    return run_ranks(
        _fsdp_runs, 2, args=([name],), timeout=TIMEOUT, init=gpu.backend(2), env=gpu.env()
    )


def _check_run(results: list[dict], name: str, fields: dict | None) -> None:
    param = str((fields or {}).get("param_dtype", FP32))
    reduce = str((fields or {}).get("reduce_dtype") or param)
    for rank, r in enumerate(results):
        t = r[name]
        context = f"rank {rank} of {len(results)}, {name}: {t}"
        assert t["devices"] == [EXPECTED_DEVICE] and t["sharded"], context
        assert all(t["losses_bitwise"]) and t["params_bitwise"], context
        assert t["output_dtypes"] == [param], context
        assert t["shard_dtypes"] == t["grad_dtypes"] == [str(FP32)], context
        if len(results) > 1:  # one rank sends nothing
            assert t["all_gather_dtypes"] == [param], context
            assert t["reduce_scatter_dtypes"] == [reduce], context


def _probe(name: str) -> list[str]:
    gpu.deterministic()
    return _gaps(gpu.device(), [name])


@pytest.mark.parametrize("name", FSDP_OPS)
def test_the_group_runs_each_fsdp_collective_right(name):
    results = run_ranks(
        _probe, 2, args=(name,), timeout=TIMEOUT, init=gpu.backend(2), env=gpu.env()
    )
    assert results[0] == [], results[0]


@pytest.mark.parametrize("name", list(FLOAT32_RUNS))
def test_fsdp_float32_equals_fully_shard(name):
    _check_run(_fsdp_results(name), name, None)


@pytest.mark.parametrize("name", list(MIXED_RUNS))
def test_fsdp_mixed_precision_equals_fully_shard(name):
    _check_run(_fsdp_results(name), name, MIXED_RUNS[name][0])


@gpu.needs_real_gpu("NCCL")
def test_world_size_1_nccl_fsdp_equals_fully_shard():
    results = run_ranks(
        _fsdp_runs, 1, args=(list(NCCL_RUNS),), timeout=TIMEOUT, init="nccl", env=gpu.env()
    )
    assert "gaps" not in results[0], results[0]  # NCCL runs every one of them
    for name, spec in NCCL_RUNS.items():
        _check_run(results, name, spec[0])


# -- ShardedOptimizer against ZeroRedundancyOptimizer, in ranks ---------------------------------

HEADS = (5, 3, 1, 4)
WHOLE_BATCH = 16  # a power of two that the world size divides: exact means
ZERO_OPTIMIZERS = {
    "adam": (torch.optim.Adam, {"lr": 0.01, "betas": (0.8, 0.99), "weight_decay": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.02, "weight_decay": 0.1}),
}


class Heads(nn.Module):
    """Linear heads of several sizes (8 parameters). With a loss linear in the outputs, the
    gradient is ``targets^T inputs / batch``: exact in float32 for small integer data on any
    split of the batch and in any order of summation, so every run sees bitwise the same
    gradients and any difference is the optimizer's."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(6, k) for k in HEADS)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(h(x) for h in self.heads)


def _heads_batch(step: int, dev: torch.device, part: slice = slice(None)):
    g = torch.Generator().manual_seed(300 + step)
    x = torch.randint(-3, 4, (WHOLE_BATCH, 6), generator=g).float()
    targets = [torch.randint(-3, 4, (WHOLE_BATCH, k), generator=g).float() for k in HEADS]
    return x[part].to(dev), [t[part].to(dev) for t in targets]


def _heads_step(model: nn.Module, opt, step: int, dev: torch.device, part=slice(None)) -> None:
    x, targets = _heads_batch(step, dev, part)
    opt.zero_grad()
    outputs = model(x)
    loss = sum((out * t).sum() for out, t in zip(outputs, targets, strict=True)) / x.shape[0]
    loss.backward()
    opt.step()


def _zero_runs() -> dict:
    gpu.deterministic()
    dev = gpu.device()
    gaps = _gaps(dev, ZERO_OPS)
    if gaps:
        return {"gaps": gaps}
    rank, ws = dist.get_rank(), dist.get_world_size()
    part = slice(rank * WHOLE_BATCH // ws, (rank + 1) * WHOLE_BATCH // ws)
    out = {}
    for name, (cls, kwargs) in ZERO_OPTIMIZERS.items():
        ours, theirs = tandem.DDP(seeded(Heads).to(dev)), tandem.DDP(seeded(Heads).to(dev))
        plain_model = seeded(Heads).to(dev)  # one process, the whole batch
        zero = ShardedOptimizer(ours.parameters(), cls, **kwargs)
        torch_zero = ZeroRedundancyOptimizer(theirs.parameters(), cls, **kwargs)
        plain = cls(plain_model.parameters(), **kwargs)
        for step in range(STEPS):
            _heads_step(ours, zero, step, dev, part)
            _heads_step(theirs, torch_zero, step, dev, part)
            _heads_step(plain_model, plain, step, dev)
        mine, torchs, plains = (
            [p.detach() for p in m.parameters()] for m in (ours, theirs, plain_model)
        )
        index = {id(p): i for i, p in enumerate(ours.parameters())}
        out[name] = {
            "ours_torch": [torch.equal(a, b) for a, b in zip(mine, torchs, strict=True)],
            "ours_plain": [torch.equal(a, b) for a, b in zip(mine, plains, strict=True)],
            "torch_plain": [torch.equal(a, b) for a, b in zip(torchs, plains, strict=True)],
            "diff": max((a - b).abs().max().item() for a, b in zip(mine, plains, strict=True)),
            "devices": sorted({p.device.type for p in [*mine, *torchs]}),
            "state": sorted(index[id(p)] for p in zero.optimizer.state),
            "params": len(mine),
        }
    return out


def test_sharded_optimizer_equals_zero_redundancy_optimizer():
    results = run_ranks(_zero_runs, 2, timeout=TIMEOUT, init=gpu.backend(2), env=gpu.env())
    _skip_if_gaps(results)
    for name in ZERO_OPTIMIZERS:
        held = []
        for rank, r in enumerate(results):
            t = r[name]
            context = f"{name}, rank {rank}: {t}"
            assert t["devices"] == [EXPECTED_DEVICE], context
            assert all(t["ours_torch"]), context
            assert all(t["ours_plain"]) and all(t["torch_plain"]), context
            held.append(t["state"])
        # each parameter's optimizer state on exactly one rank
        assert sorted(i for h in held for i in h) == list(range(results[0][name]["params"])), held
