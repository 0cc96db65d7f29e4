"""tandem.DDP alongside the torch features that bend DDP's rules, against torch's own DDP.

Oracle: torch.nn.parallel.DistributedDataParallel on the same seeds and data; after 30 SGD steps
(momentum 0.9) the parameters of both engines are ``torch.equal`` on every rank, and so are
which parameters were left with ``.grad`` None and the final bucket layout. Real processes, Gloo.

1. Activation checkpointing (``torch.utils.checkpoint``), reentrant and not, with the output
   layer inside a checkpointed block, with and without find_unused_parameters. Reentrant mode
   runs each block's backward as a nested backward, and the graph of the outputs reaches only
   the block's inputs, not its parameters. torch's DDP trains all of it, except reentrant with
   find_unused_parameters=True: its graph walk cannot see the parameters behind the checkpoint,
   marks them unused, and their gradients then raise "Expected to mark a variable ready only
   once" in the first backward. tandem trains that combination too (the parameters a custom
   autograd Function may hide are reduced once backward is done, if they got no gradient); its
   oracle is torch's DDP with non-reentrant checkpointing, torch's supported way.
2. static_graph=True with torch's meaning, world sizes 2 and 3: a layer applied twice; a block
   checkpointed (reentrant) twice, or used both inside and outside a checkpointed block, whose
   parameters get several gradients in one backward; a parameter that never gets a gradient
   (it keeps ``.grad`` None, and the rebuilt buckets put it last, as torch does: at world size 3
   another layout changes the bits). Without static_graph both engines raise for the reentrant
   reuse.
3. Buckets: tandem's ``reducer.layout`` (parameter indices per bucket, in launch order) and
   bucket sizes in bytes are torch's, read from torch's reducer and from its logging data
   (``_get_ddp_logging_data()``: "bucket_sizes", "rebuilt_bucket_sizes",
   "rebuilt_per_bucket_param_indices"), before the first backward and after every one of the
   first backwards, so at the rebuild too: one bucket until the ready order is known (rebuilt
   at the second forward, with static_graph at the third), a 1 MiB first bucket under the
   default cap, an explicit cap for every bucket, find_unused_parameters cut once from the
   reversed registration order and never rebuilt. The model's forward order differs from its
   registration order, so the rebuild changes the buckets. World size 3, where the buckets
   decide how Gloo's ring splits the sums, for bitwise parity.
4. Inputs that are namedtuples, dataclasses and dicts of lists of tensors reach the wrapped
   module as their own types (device_ids=None, CPU), and a namedtuple output is followed for
   the end of backward and for unused parameters.
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.checkpoint import checkpoint

import tandem
from tandem.parallel.ddp.reducer import Reducer
from tests import models
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed

STEPS = 30
PER_RANK = 6


# -- models -----------------------------------------------------------------------------------


class Checkpointed(nn.Module):
    """A stem, then two blocks and the output layer each run through checkpoint().

    The stem is not checkpointed, as in most models (an embedding): in reentrant mode the
    input of a checkpointed block must require grad, or its parameters get no gradient.
    """

    def __init__(self, reentrant: bool, never: bool = False) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.stem = nn.Linear(10, 16)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2)])
        self.head = nn.Linear(16, 3)
        # Registered, never called: something for find_unused_parameters to find.
        self.never = nn.Linear(16, 3) if never else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=self.reentrant)
        return checkpoint(self.head, h, use_reentrant=self.reentrant)


class Twice(nn.Module):
    """The same Linear applied twice in one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(10, 16)
        self.shared = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h))
        return self.head(h)


class ReentrantReuse(nn.Module):
    """One block run twice per forward through reentrant checkpointing ("twice"), or once
    inside and once outside a checkpoint ("inside_outside"): its parameters' gradient hooks
    fire twice per backward, once in a nested backward."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.stem = nn.Linear(10, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        h = checkpoint(self.block, h, use_reentrant=True)
        # the second use: checkpointed again, or plain
        again = partial(checkpoint, self.block, use_reentrant=True)
        h = (again if self.mode == "twice" else self.block)(h)
        return checkpoint(self.head, h, use_reentrant=True)


class NeverGrad(nn.Module):
    """A layer that never takes part in forward, so its parameters never get a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(10, 16)
        self.idle = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.inp(x)))


class Shuffled(nn.Module):
    """Eight parameters of varied sizes, registered in an order unlike the forward's.

    Parameter indices (``named_parameters`` order, the root's own parameter first, as torch's
    DDP numbers them): scale 0, a.weight 1 (exactly 1 MiB in float64), a.bias 2, b.weight 3,
    b.bias 4, c.weight 5, c.bias 6, d.weight 7. Forward runs c, d, scale, a, b, so gradients
    become ready in the order 4 3 2 1 0 7 6 5, not the reverse of registration.
    """

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(256, 512)
        self.b = nn.Linear(512, 3)
        self.c = nn.Linear(10, 128)
        self.d = nn.Linear(128, 256, bias=False)
        self.scale = nn.Parameter(torch.ones(256))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.scale * self.d(torch.tanh(self.c(x))))
        return self.b(torch.tanh(self.a(h)))


Pair = namedtuple("Pair", ["x", "gate"])
Out = namedtuple("Out", ["logits", "hidden"])


@dataclass
class Shift:
    bias: torch.Tensor
    label: str = "shift"


class Containers(nn.Module):
    """forward(pair: Pair, feats: {"side": [tensor, ...]}, shift: Shift) -> Out; raises
    TypeError when an argument arrives as another type."""

    def __init__(self, never: bool) -> None:
        super().__init__()
        self.enc = nn.Linear(10, 16)
        self.side = nn.Linear(4, 16)
        self.head = nn.Linear(16, 3)
        self.never = nn.Linear(16, 3) if never else None

    def forward(self, pair: Pair, feats: dict, shift: Shift) -> Out:
        _expect(pair, Pair, "pair")
        _expect(feats, dict, "feats")
        _expect(feats["side"], list, "feats['side']")
        _expect(shift, Shift, "shift")
        for t in [pair.x, pair.gate, shift.bias, *feats["side"]]:
            _expect(t, torch.Tensor, "a leaf")
        side = sum(self.side(t) for t in feats["side"])
        h = torch.tanh(self.enc(pair.x) * pair.gate + side + shift.bias)
        return Out(self.head(h), h)


def _expect(value: Any, kind: type, what: str) -> None:
    if type(value) is not kind:
        raise TypeError(f"{what} reached the module as {type(value).__name__}, not {kind.__name__}")


def _build(model: str, seed: int, **kw: Any) -> nn.Module:
    torch.manual_seed(seed)
    factories = {
        "checkpointed": Checkpointed,
        "twice": Twice,
        "reentrant_reuse": ReentrantReuse,
        "never_grad": NeverGrad,
        "shuffled": Shuffled,
        "containers": Containers,
    }
    return factories[model](**kw).double()


# -- parity runner ----------------------------------------------------------------------------
# Each test is one run of real processes looping over its cases: the first torch DDP built in a
# process imports torch._dynamo (seconds), which a run per case would pay again and again.


def _inputs(model: str, step: int, rank: int) -> tuple[tuple, dict, torch.Tensor]:
    x, y = models.batch(step, rank, PER_RANK, (10,))
    if model != "containers":
        return (x,), {}, y
    g = torch.Generator().manual_seed(7000 + 100 * step + rank)
    pair = Pair(x, torch.rand(PER_RANK, 16, generator=g, dtype=x.dtype))
    feats = {"side": [torch.randn(PER_RANK, 4, generator=g, dtype=x.dtype) for _ in range(2)]}
    return (pair, feats), {"shift": Shift(torch.randn(16, generator=g, dtype=x.dtype))}, y


def _loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    if isinstance(out, Out):
        return F.cross_entropy(out.logits, y) + 0.01 * out.hidden.pow(2).mean()
    return F.cross_entropy(out, y)


def _torch_layout(ddp: TorchDDP) -> list[list[int]]:
    """Parameter indices per bucket of torch's reducer, in bucket (launch) order."""
    index = {id(p): i for i, p in enumerate(ddp.module.parameters())}
    return [
        [index[id(p)] for p in bucket.parameters()]
        for bucket in ddp.reducer._get_zeros_like_grad_buckets()
    ]


def _train_both(
    model: str, ours_kw: dict, theirs_kw: dict, model_kw: dict, theirs_model_kw: dict
) -> dict:
    """STEPS steps of tandem.DDP and of torch's DDP on the same seeds and data."""
    rank = dist.get_rank()
    ours = tandem.DDP(_build(model, rank, **model_kw), **ours_kw)
    theirs = TorchDDP(_build(model, rank, **{**model_kw, **theirs_model_kw}), **theirs_kw)
    opt_ours = models.make_optimizer("sgd", ours.parameters())
    opt_theirs = models.make_optimizer("sgd", theirs.parameters())
    grads_none = []
    for step in range(STEPS):
        for ddp, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            args, kwargs, y = _inputs(model, step, rank)
            opt.zero_grad()
            _loss(ddp(*args, **kwargs), y).backward()
            opt.step()
        grads_none.append(
            [[n for n, p in m.module.named_parameters() if p.grad is None] for m in (ours, theirs)]
        )
    pairs = zip(ours.module.parameters(), theirs.module.parameters(), strict=True)
    return {
        "equal": all(torch.equal(a, b) for a, b in pairs),
        "moved": not torch.equal(ours.module.head.weight, _build(model, 0, **model_kw).head.weight),
        "grads_none": grads_none,
        "layouts": (ours.reducer.layout, _torch_layout(theirs)),
    }


def _train_cases(cases: dict[str, tuple]) -> dict[str, dict]:
    return {name: _train_both(*args) for name, args in cases.items()}


def _assert_parity(results: list[dict[str, dict]]) -> None:
    for rank, by_case in enumerate(results):
        for case, result in by_case.items():
            assert result["equal"], f"{case}, rank {rank}: parameters differ from torch's DDP"
            assert result["moved"], f"{case}, rank {rank}: the output layer never trained"
            assert result["layouts"][0] == result["layouts"][1], (case, rank, result["layouts"])
            for step, (ours_none, theirs_none) in enumerate(result["grads_none"]):
                assert ours_none == theirs_none, (case, rank, step, ours_none, theirs_none)


# -- 1. activation checkpointing ----------------------------------------------------------------


def test_activation_checkpointing_equals_torch_ddp():
    cases = {}
    for reentrant in (True, False):
        for find_unused in (False, True):
            ddp_kw = {"find_unused_parameters": find_unused}
            model_kw = {"reentrant": reentrant, "never": find_unused}
            # torch refuses reentrant + find_unused_parameters (see the test below): the oracle
            # is then torch's DDP with non-reentrant checkpointing, the same gradients through a
            # graph that torch can walk.
            theirs_model_kw = {"reentrant": False} if reentrant and find_unused else {}
            name = f"reentrant={reentrant}, find_unused_parameters={find_unused}"
            cases[name] = ("checkpointed", ddp_kw, ddp_kw, model_kw, theirs_model_kw)
    results = run_ranks(_train_cases, 2, args=(cases,))
    _assert_parity(results)
    for by_case in results:
        for case, result in by_case.items():
            if "find_unused_parameters=True" in case:
                # the never-called layer keeps .grad None on every rank, as in torch
                assert all("never.weight" in step[0] for step in result["grads_none"]), case


def _first_backward(engine: str, model: str, model_kw: dict, ddp_kw: dict) -> str:
    rank = dist.get_rank()
    wrap = TorchDDP if engine == "torch" else tandem.DDP
    ddp = wrap(_build(model, rank, **model_kw), **ddp_kw)
    args, kwargs, y = _inputs(model, 0, rank)
    with pytest.raises(RuntimeError) as info:
        _loss(ddp(*args, **kwargs), y).backward()
    return str(info.value)


def _refusals() -> dict[str, str]:
    find_unused = {"find_unused_parameters": True}
    out = {
        "torch, reentrant + find_unused_parameters": _first_backward(
            "torch", "checkpointed", {"reentrant": True, "never": True}, find_unused
        )
    }
    for engine in ("torch", "tandem"):
        for mode in ("twice", "inside_outside"):
            out[f"{engine}, reuse {mode}"] = _first_backward(
                engine, "reentrant_reuse", {"mode": mode}, {}
            )
    return out


def test_reentrant_checkpointing_torch_refuses():
    # torch refuses reentrant checkpointing with find_unused_parameters=True (its graph walk
    # cannot see the parameters behind the checkpoint; tandem trains it, above), and a block
    # reused in reentrant checkpointing without static_graph; tandem refuses the latter too,
    # pointing to static_graph=True. If torch starts to accept them, these become parity cases.
    for messages in run_ranks(_refusals, 2):
        for case, message in messages.items():
            if case.startswith("torch"):
                assert "Expected to mark a variable ready only once" in message, (case, message)
            else:
                assert "received a gradient twice" in message, (case, message)
                assert "static_graph=True" in message, (case, message)


# -- 2. static_graph --------------------------------------------------------------------------

STATIC = {"static_graph": True}
STATIC_CASES = {
    "layer_twice": ("twice", STATIC, STATIC, {}, {}),
    "checkpointed_twice": ("reentrant_reuse", STATIC, STATIC, {"mode": "twice"}, {}),
    "inside_and_outside_checkpoint": (
        "reentrant_reuse", STATIC, STATIC, {"mode": "inside_outside"}, {},
    ),
    "never_gets_a_gradient": ("never_grad", STATIC, STATIC, {}, {}),
}  # fmt: skip


@pytest.mark.parametrize("world_size", [2, 3])
def test_static_graph_equals_torch_ddp(world_size):
    results = run_ranks(_train_cases, world_size, args=(STATIC_CASES,))
    _assert_parity(results)
    for by_case in results:
        # a parameter with no gradient keeps .grad None, as in torch
        assert all("idle.weight" in s[0] for s in by_case["never_gets_a_gradient"]["grads_none"])


# -- 3. buckets -------------------------------------------------------------------------------

SMALL_CAP_MB = 0.002  # 2097 bytes: several buckets for Shuffled

BUCKET_CASES = {
    "default": {},
    "small_cap": {"bucket_cap_mb": SMALL_CAP_MB},
    "find_unused": {"find_unused_parameters": True},
    "find_unused_small_cap": {"find_unused_parameters": True, "bucket_cap_mb": SMALL_CAP_MB},
    "static_graph": {"static_graph": True, "bucket_cap_mb": SMALL_CAP_MB},
    "bucket_view": {"gradient_as_bucket_view": True, "bucket_cap_mb": SMALL_CAP_MB},
}
WATCHED = 4  # backwards after which the buckets are compared: past static_graph's rebuild


def _ours(reducer: Reducer) -> tuple[list[list[int]], list[int]]:
    return reducer.layout, [b.flat.numel() * b.flat.element_size() for b in reducer.buckets]


def _buckets_and_parity(case: str) -> dict:
    rank = dist.get_rank()
    kw = BUCKET_CASES[case]
    ours = tandem.DDP(_build("shuffled", rank), **kw)
    theirs = TorchDDP(_build("shuffled", rank), **kw)
    timeline = [(_ours(ours.reducer), _torch_layout(theirs))]  # before any backward
    initial_log = theirs._get_ddp_logging_data()
    opt_ours = models.make_optimizer("sgd", ours.parameters())
    opt_theirs = models.make_optimizer("sgd", theirs.parameters())
    for step in range(STEPS):
        for ddp, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            x, y = models.batch(step, rank, PER_RANK, (10,))
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
        if step < WATCHED:
            timeline.append((_ours(ours.reducer), _torch_layout(theirs)))
    pairs = zip(ours.module.parameters(), theirs.module.parameters(), strict=True)
    return {
        "timeline": timeline,
        "initial_log": initial_log,
        "final_log": theirs._get_ddp_logging_data(),
        "equal": all(torch.equal(a, b) for a, b in pairs),
    }


def _all_bucket_cases() -> dict[str, dict]:
    return {case: _buckets_and_parity(case) for case in BUCKET_CASES}


def _ints(logged: str) -> list[int]:
    return [int(s) for s in logged.split(",")]


def _groups(logged: str) -> list[list[int]]:
    return [[int(s) for s in group.split()] for group in logged.split(",")]


def test_buckets_equal_torch_ddp():
    results = run_ranks(_all_bucket_cases, 3)
    for rank, by_case in enumerate(results):
        for case, r in by_case.items():
            where = f"{case}, rank {rank}"
            assert r["equal"], f"{where}: parameters differ from torch's DDP"
            for n, ((layout, _), theirs) in enumerate(r["timeline"]):
                assert layout == theirs, f"{where}, after {n} backwards: {layout} != {theirs}"
            (initial, initial_sizes), _ = r["timeline"][0]
            (final, final_sizes), _ = r["timeline"][-1]
            assert initial_sizes == _ints(r["initial_log"]["bucket_sizes"]), where
            log = r["final_log"]
            if "find_unused" in case:
                # cut once, from the reversed registration order, and never rebuilt
                assert "rebuilt_per_bucket_param_indices" not in log, where
                assert final == initial, where
            else:
                assert initial == [list(range(8))], where  # one bucket until the order is known
                assert final == _groups(log["rebuilt_per_bucket_param_indices"]), where
                assert final_sizes == _ints(log["rebuilt_bucket_sizes"]), where
                # in the order gradients became ready, not the reverse of registration
                assert [i for bucket in final for i in bucket] == [4, 3, 2, 1, 0, 7, 6, 5], where
    expected = {
        "default": [[4, 3, 2, 1], [0, 7, 6, 5]],  # a 1 MiB first bucket, then 25 MiB
        "find_unused": [[2, 3, 4, 5, 6, 7], [0, 1]],  # registration order, 1 MiB first
        "small_cap": [[4, 3], [2], [1], [0, 7], [6, 5]],
    }
    for case, layout in expected.items():
        assert results[0][case]["timeline"][-1][0][0] == layout, case


# -- 4. containers in, containers out ---------------------------------------------------------

CONTAINER_CASES = {
    f"find_unused_parameters={find_unused}": (
        "containers",
        {"device_ids": None, "find_unused_parameters": find_unused},
        {"device_ids": None, "find_unused_parameters": find_unused},
        {"never": find_unused},
        {},
    )
    for find_unused in (False, True)
}


def test_container_inputs_reach_the_module_as_their_types():
    # The module raises TypeError on a wrong type, so parity implies the types arrived intact.
    _assert_parity(run_ranks(_train_cases, 2, args=(CONTAINER_CASES,)))
